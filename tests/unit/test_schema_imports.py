"""Loading and checking a trainer command's config imports no megatron-core (nor the other heavy
libraries a run needs), so that a mistake is reported within moments of the start
(``scripts/bench/first_error.py`` times it).

One fresh interpreter runs each command's ``--print-config`` (every start-up check, then the config)
and a refused setting, and reports what was imported after each: this process has imported
megatron-core already.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.launch import run

HEAVY = ("megatron", "transformers", "matplotlib", "tensorboard", "wandb", "pyarrow")
"""Imported by a run (or by a sink, or for parquet files), never by its config's checks."""

PROBE = f"""
import json, sys
from megatron_rlhf.cli import main
for args in json.loads(sys.argv[1]):
    code = main(args)
    print(json.dumps({{"args": args, "code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def test_checking_each_trainer_config_imports_no_megatron(tmp_path: Path) -> None:
    sft_rows = tmp_path / "sft.jsonl"
    sft_rows.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    cases = [
        (["ppo", "--config", "ppo-tiny", "--print-config"], 0),
        (["sft", "--config", "sft-tiny", f"data.train=[{sft_rows}]", "--print-config"], 0),
        (["rm", "--config", "rm-tiny", f"data.train=[{pairs}]", "--print-config"], 0),
        (["pipeline", "--print-config"], 0),
        (["smoke", "--print-config"], 0),
        (["ppo", "bad.key=1"], 2),
        (["ppo", "--config", "ppo-tiny", "algorithm.advantage_estimator=nope"], 2),
        (["sft", "bad.key=1"], 2),
    ]
    proc = run([sys.executable, "-c", PROBE, json.dumps([args for args, _ in cases])], cwd=tmp_path, timeout=300)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"args"')]
    assert [(r["args"], r["code"]) for r in reports] == cases, proc.stderr[-3000:]
    assert [r["heavy"] for r in reports] == [[]] * len(cases), reports
