"""torchrun worker (2 ranks, gloo): the HF export of a LoRA model at TP1, TP2 and PP2 (float32),
and TP1's PEFT adapter read back at TP2 and PP2.

One tiny Qwen2 with adapters on all seven projections, the same full adapter values in every layout
(``lora_worker.set_full_values``), exported with ``export_hf`` to OUT/<layout>/hf (merged) and
OUT/<layout>/hf_adapter (PEFT); the test compares the layouts' files and loads them in transformers
and PEFT. At TP2 and PP2 a second model starts from TP1's hf_adapter/ (``lora.adapter_path``): its
adapter shards must equal the first model's. Rank 0 writes the figures to OUT/results.json.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.distributed.lora_worker import set_full_values
from tests.helpers import PAD_ID, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

LAYOUTS = ((1, 1), (2, 1), (1, 2))


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.export import export_hf
    from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.models.lora_config import LoraConfig

    env = session.env
    hf_dir = session.out / "base"
    if env.rank == 0:
        make_tiny_hf_model("qwen2", False, hf_dir)
    dist.barrier()
    arch = load_architecture(hf_dir)
    cfg = ModelConfig(path=str(hf_dir), lora=LoraConfig(rank=4, alpha=8.0))
    tokenizer: Any = types.SimpleNamespace(pad_id=PAD_ID, bos_id=None, eos_id=None, stop_ids=(), chat_template=None)
    for tp, pp in LAYOUTS:
        tag = f"tp{tp}pp{pp}"
        cfg.tp, cfg.pp = tp, pp
        role = build_role("actor", cfg, arch, world_size=env.world_size, dtype=torch.float32, device=env.device)
        set_full_values(role.model, tp, role.groups.pg_collection.tp.rank())
        before = [p.detach().clone() for p in role.model.parameters()]
        export_hf(role, tokenizer, session.out / tag / "hf", adapter_dir=session.out / tag / "hf_adapter")
        same = all(torch.equal(p, b) for p, b in zip(role.model.parameters(), before, strict=True))
        found = torch.tensor([float(same)])
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        session.results[f"{tag}/model_untouched"] = found.item()
        dist.barrier()
        if (tp, pp) != LAYOUTS[0]:
            written = str(session.out / "tp1pp1" / "hf_adapter")
            from_file = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, adapter_path=written))
            read = build_role(
                "actor", from_file, arch, world_size=env.world_size, dtype=torch.float32, device=env.device
            )
            same = all(
                torch.equal(mine, theirs)
                for (name, mine), (_, theirs) in zip(
                    read.model.named_parameters(), role.model.named_parameters(), strict=True
                )
                if "_lora." in name
            )
            found = torch.tensor([float(same)])
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
            session.results[f"{tag}/adapter_read_back"] = found.item()


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
