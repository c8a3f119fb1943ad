"""Benchmark: a run checkpoint of the actor's train state (weights + distributed-optimizer state +
LR schedule), written synchronously and in the background (``async_save``), then loaded.

    python scripts/bench/checkpoint.py --model builtin:llama-1.5b --dir /tmp/bench_checkpoint   # one GPU
    python scripts/bench/checkpoint.py --model builtin:tiny-llama --dir /tmp/bench_checkpoint   # CPU check

The actor is built as the ppo trainer builds it (``build_role`` + ``make_train_state``: the run's
dtype, bf16 on a GPU, and the distributed optimizer) and takes one optimizer step so that its Adam
state exists. Saves go through ``RunCheckpointWriter``, as in a run. Printed after each
measurement, one JSON line with the figures so far (a run cut short keeps them):
``sync_save_s`` (blocking, the whole save), ``async_blocking_s`` (until training could continue)
and ``async_total_s`` (until the checkpoint is complete: renamed, ``latest`` written),
``size_GB`` on disk, ``write_GBps`` (size / sync save), ``load_s``; ``--async-only`` measures the
background save alone. The first save of a process
also starts megatron's results-queue manager: ``warmup_save_s`` (a tiny model's save) pays it
first, so that neither measured save does.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from common import RunningReport, clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_checkpoint"), help="checkpoints go here (emptied)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--async-only", action="store_true", help="only the background save (no sync save, no load)")
    args = parser.parse_args()

    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter, load_run_checkpoint
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.config.run import resolve_dtype
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, TrainState, make_train_state
    from megatron_rlhf.training.train import train_step

    env = init_distributed(args.device)
    dtype = resolve_dtype("auto", env.device)

    def train_state(model: str) -> TrainState:
        role = build_role(
            "actor",
            ModelConfig(path=model, tp=env.world_size),
            architecture_of(model),
            world_size=env.world_size,
            dtype=dtype,
            device=env.device,
        )
        state = make_train_state(role, OptimConfig(lr=1e-6))
        ids = torch.randint(
            0, role.arch.vocab_size, (env.world_size * 2, 64), generator=torch.Generator().manual_seed(0)
        )
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        train_step(state, batch, sft_loss(role), max_tokens_per_micro_batch=256)
        return state

    def synchronized() -> float:
        return clock(env.device, barrier=True)

    if env.rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()

    def save(state: TrainState, name: str, background: bool, step: int = 1) -> tuple[float, float, Path]:
        """(blocking s, until complete s, the checkpoint). A background save's blocking time is
        reported as soon as it is known: writing can take minutes on a slow disk."""
        writer = RunCheckpointWriter(args.dir / name, keep_last=1, background=background)
        start = synchronized()
        writer.save(step, train_states={"actor": state}, weights={}, run_state={}, config_yaml="")
        returned = synchronized()
        if background:
            report.add(async_blocking_s=returned - start)
        writer.wait()
        done = synchronized()
        return returned - start, done - start, args.dir / name / f"step_{step}"

    report = RunningReport(model=args.model, device=env.device.type, dtype=str(dtype).removeprefix("torch."))

    report.add(warmup_save_s=save(train_state("builtin:tiny-llama"), "warmup", background=False)[1])
    state = train_state(args.model)
    report.add(layout=str(state.role.groups.layout))
    if not args.async_only:
        sync_s, _, ckpt = save(state, "sync", background=False)
        size = sum(path.stat().st_size for path in ckpt.rglob("*") if path.is_file())
        report.add(sync_save_s=sync_s, size_GB=size / 1e9, write_GBps=size / 1e9 / sync_s)
        start = synchronized()
        load_run_checkpoint(ckpt, train_states={"actor": state}, weights={})
        report.add(load_s=synchronized() - start)
        if env.rank == 0:
            shutil.rmtree(args.dir / "sync")  # room on the disk for the next one
        dist.barrier()
    _, async_total_s, _ = save(state, "async", background=True)
    report.add(async_total_s=async_total_s)
    if env.rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
