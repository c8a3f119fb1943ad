"""torchrun worker (2 ranks, gloo): training-state checkpoints resume exactly and reshard.

A: 3 SFT steps uninterrupted at TP1xDP2 (distributed optimizer sharded over DP).
B: 2 steps, save, fresh model + optimizer, load, 1 step: must equal A bit for bit.
C: load the same checkpoint at TP2xDP1, 1 step: must equal A to 1e-5 relative (Frobenius).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import load_all_tensors
from tests.launch import WorkerSession, worker_session


def batch_for(step: int, dp_rank: int, dp: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 512, (8, 16), generator=g)
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    rows = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
    return {"input_ids": ids[rows], "attention_mask": mask[rows], "loss_mask": loss_mask[rows]}


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.hf import save_hf_checkpoint
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.checkpoint.train_state import load_train_state, save_train_state
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env, out, results = session.env, session.out, session.results
    optim = OptimConfig(lr=3e-3, warmup_steps=2, decay_style="cosine", decay_steps=10, min_lr=1e-4, clip_grad=1.0)

    def fresh(tp: int):
        role = build_role(
            "actor",
            ModelConfig(path="builtin:tiny-llama", tp=tp),
            architecture_of("builtin:tiny-llama"),
            world_size=env.world_size,
            dtype=torch.float32,
            device=env.device,
        )
        return make_train_state(role, optim)

    def run(state, steps: range) -> None:
        for step in steps:
            batch = batch_for(step, state.role.groups.dp_rank, state.role.groups.layout.dp)
            train_step(state, batch, sft_loss(state.role), max_tokens_per_micro_batch=32)

    a = fresh(1)
    run(a, range(3))
    save_hf_checkpoint(a.role.model, a.role.arch, a.role.groups, out / "A")

    b = fresh(1)
    run(b, range(2))
    save_train_state(b, out / "ckpt")
    b = fresh(1)
    load_train_state(b, out / "ckpt")
    steps = [s["step"] for inner in b.optimizer.chained_optimizers for s in inner.optimizer.state.values()]
    distinct = len({id(s) for s in steps}) == len(steps)
    step_values = sorted({float(s) for s in steps})
    run(b, range(2, 3))
    save_hf_checkpoint(b.role.model, b.role.arch, b.role.groups, out / "B")

    c = fresh(2)
    load_train_state(c, out / "ckpt")
    run(c, range(2, 3))
    save_hf_checkpoint(c.role.model, c.role.arch, c.role.groups, out / "C")

    if env.rank == 0:
        ta, tb, tc = (load_all_tensors(out / k) for k in "ABC")
        results.update(
            adam_steps_distinct_after_load=distinct,
            adam_step_values=step_values,
            resume_bit_identical=all(torch.equal(ta[k], tb[k]) for k in ta),
            resume_max_abs_diff=max((ta[k] - tb[k]).abs().max().item() for k in ta),
            reshard_max_rel_diff=max(((tc[k] - ta[k]).norm() / ta[k].norm()).item() for k in ta),
        )
        assert results["adam_steps_distinct_after_load"] and results["adam_step_values"] == [2.0], results
        assert results["resume_bit_identical"], results
        assert results["reshard_max_rel_diff"] < 1e-5, results


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
