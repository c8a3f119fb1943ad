"""Where a run's numbers go: ``metrics.jsonl``, TensorBoard events and other JSONL row files.

Global rank 0 writes; on every other rank the sink is a no-op, so callers need no rank checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_rlhf.metrics.log import is_rank0


class MetricsSink:
    def __init__(self, out_dir: Path) -> None:
        self.enabled = is_rank0()
        self.out_dir = out_dir
        self._jsonl = None
        self._tb = None
        self._row_files: dict[str, Any] = {}
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = (out_dir / "metrics.jsonl").open("w", encoding="utf-8")
            self._tb = SummaryWriter(log_dir=str(out_dir / "tb"))

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"split": split, "step": step, **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{split}/{name}", value, step)

    def write_rows(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Append rows to ``out_dir/<name>.jsonl`` (made on first use)."""
        if not self.enabled or not rows:
            return
        if name not in self._row_files:
            self._row_files[name] = (self.out_dir / f"{name}.jsonl").open("w", encoding="utf-8")
        handle = self._row_files[name]
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
        handle.flush()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
            for handle in self._row_files.values():
                handle.close()
