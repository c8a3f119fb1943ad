"""Benchmark: a PPO actor update vs a plain next-token-loss Megatron step, same model and batch.

    torchrun --nproc-per-node 1 scripts/bench/update.py --model builtin:llama-1.5b --out result.json

Both steps run the same megatron-core pipeline schedule, DDP and distributed optimizer over the
same token-budget micro-batches; they differ in the loss: the PPO step computes exact
vocab-parallel log-probs at the sampling temperature, entropy, the clipped surrogate and KL, with
the LM head only at the positions that predict a response token (``logits_mask``, as the trainer
runs it); the plain step is megatron's ``vocab_parallel_cross_entropy`` NLL over every position.
Reported: tokens/s, MFU (6 N + 12 L h s FLOPs per token against the matmul peak measured in the same
run, bf16 on a GPU and fp32 on a CPU, and the 989 TFLOP/s bf16 datasheet figure of an H100/H200), and
the ratio PPO / plain.

``--skewed``: rows of random lengths from 16 to ``--seq-len`` (right-padded) instead of full rows, and
beside them a batch of as many rows all of the mean length (the same real tokens): the PPO step's
time on the skewed batch with packed sequences (``ppo``) and without (``ppo_unpacked``) and on the
uniform one, the ratios to the uniform (1.0: padding costs nothing), and for each the tokens the
micro-batches computed and the share of them that is padding. Tokens/s and MFU then count real
tokens. ``--no-pack``: the plain and PPO steps without packing.

``--profile``: one more PPO step under torch.profiler: its wall time, the time the GPU was busy,
that time split by kind of kernel (GEMM, attention, compiled, optimizer, ...) against the step's
FLOPs at the measured matmul peak, and the 25 costliest kernels (CPU operators in CPU mode), also
written beside ``--out`` as ``.profile.txt``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import DATASHEET_BF16_FLOPS, loop_seconds, matmul_peak, wall_seconds, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=8192, help="token budget per micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skewed", action="store_true", help="rows of 16..seq-len tokens vs rows of their mean length")
    parser.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack sequences into shared rows of a micro-batch (--skewed runs both anyway)",
    )
    parser.add_argument("--profile", action="store_true", help="profile one more PPO step (torch.profiler)")
    args = parser.parse_args()

    from megatron.core import tensor_parallel

    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.training.objectives import PPOLossConfig, ppo_actor_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.schedule import logits_only_at, micro_batches
    from megatron_rlhf.training.train import train_step

    env = init_distributed(args.device)
    on_gpu = env.device.type == "cuda"
    arch = architecture_of(args.model)
    role = build_role(
        "actor",
        ModelConfig(path=args.model, tp=env.world_size),
        arch,
        world_size=env.world_size,
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device=env.device,
    )
    state = make_train_state(role, OptimConfig(lr=1e-6, clip_grad=1.0))

    g = torch.Generator().manual_seed(0)

    def make_batch(lengths: list[int]) -> dict[str, torch.Tensor]:
        """Right-padded rows of these lengths, each a quarter prompt and three quarters response."""
        shape = (len(lengths), max(lengths))
        positions = torch.arange(shape[1])
        length = torch.tensor(lengths)[:, None]
        mask = (positions < length).long()
        response = ((positions >= length // 4) & (positions < length)).float()
        return {
            "input_ids": torch.randint(0, arch.vocab_size, shape, generator=g) * mask,
            "attention_mask": mask,
            "response_mask": response,
            "loss_mask": response,
            "old_logprobs": -10.0 + 0.1 * torch.randn(shape, generator=g),
            "ref_logprobs": -10.0 + 0.1 * torch.randn(shape, generator=g),
            "advantages": torch.randn(shape, generator=g) * response,
        }

    if args.skewed:
        lengths = torch.randint(16, args.seq_len + 1, (args.batch,), generator=g).tolist()
        batch = make_batch(lengths)
        same_tokens = make_batch([round(sum(lengths) / len(lengths))] * args.batch)
    else:
        batch = make_batch([args.seq_len] * args.batch)
    ppo = ppo_actor_loss(role, PPOLossConfig(entropy_coef=0.01, kl_loss_coef=0.01), temperature=0.7)
    tp_group = role.groups.pg_collection.tp

    def plain_nll(
        piece: dict[str, torch.Tensor], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        targets = piece["input_ids"][:, 1:]
        nll = tensor_parallel.vocab_parallel_cross_entropy(
            logits[:, :-1].float().contiguous(), targets.contiguous(), tp_group=tp_group
        )
        mask = piece["loss_mask"][:, 1:]
        return (nll * mask).sum(), mask.sum(), {}

    def timed_steps(loss_fn: Any, batch: dict[str, torch.Tensor], pack: bool) -> float:
        """Seconds per optimizer step, after ``--warmup`` untimed ones, every rank waited for."""

        def step() -> None:
            train_step(state, batch, loss_fn, max_tokens_per_micro_batch=args.max_tokens, pack_sequences=pack)

        return loop_seconds(step, calls=args.steps, warmup=args.warmup, device=env.device, barrier=True)

    # Alternate the runs twice so that none benefits from running later.
    # name -> (loss, batch, packed)
    # The PPO step as the trainer runs it: the LM head only where a response token is predicted;
    # the plain step's loss reads every position.
    ppo_batch = logits_only_at(batch, "response_mask")
    variants = {"plain": (plain_nll, batch, args.pack), "ppo": (ppo, ppo_batch, args.pack)}
    if args.skewed:
        variants |= {
            "ppo_unpacked": (ppo, ppo_batch, False),
            "ppo_same_tokens_uniform": (ppo, logits_only_at(same_tokens, "response_mask"), args.pack),
        }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, (loss_fn, run_batch, pack) in variants.items():
            times[name].append(timed_steps(loss_fn, run_batch, pack))
    tokens = int(batch["attention_mask"].sum())
    params = sum(p.numel() for p in role.model.parameters())
    embedding = arch.vocab_size * arch.hidden_size / env.world_size
    flops_per_token = 6 * (params - embedding) * env.world_size + 12 * arch.num_layers * arch.hidden_size * args.seq_len
    peak = matmul_peak(env.device)
    result = {
        "model": args.model,
        "layout": str(role.groups.layout),
        "tokens_per_step": tokens,
        "micro_batch_token_budget": args.max_tokens,
        "matmul_peak_TFLOPs": peak / 1e12,
    }
    for name, runs in times.items():
        step_s = min(runs)
        throughput = tokens / step_s
        result[f"{name}_step_s"] = step_s
        result[f"{name}_tokens_per_s"] = throughput
        result[f"{name}_TFLOPs"] = throughput * flops_per_token / 1e12 / env.world_size
        result[f"{name}_MFU_vs_measured_peak"] = throughput * flops_per_token / env.world_size / peak
        result[f"{name}_MFU_vs_989_TFLOPs"] = throughput * flops_per_token / env.world_size / DATASHEET_BF16_FLOPS
    result["ratio_ppo_over_plain"] = result["ppo_tokens_per_s"] / result["plain_tokens_per_s"]
    result["packed"] = args.pack
    for name, (_, run_batch, pack) in variants.items():
        pieces, _ = micro_batches(run_batch, args.max_tokens, role.groups, torch.device("cpu"), pack=pack)
        computed = sum(p["input_ids"].numel() for p in pieces)
        result[f"{name}_tokens_computed"] = computed
        result[f"{name}_padding_percent"] = 100 * (computed - int(run_batch["attention_mask"].sum())) / computed
    if args.skewed:
        result["skewed_lengths"] = f"{min(lengths)}-{max(lengths)}, mean {sum(lengths) / len(lengths):.0f}"
        for name in ("ppo", "ppo_unpacked"):
            result[f"ratio_{name}_over_same_tokens_uniform"] = (
                result[f"{name}_step_s"] / result["ppo_same_tokens_uniform_step_s"]
            )
    if on_gpu:
        result["gpu_peak_GiB"] = torch.cuda.max_memory_allocated() / 1024**3
    if args.profile:

        def ppo_step() -> None:
            train_step(state, ppo_batch, ppo, max_tokens_per_micro_batch=args.max_tokens, pack_sequences=args.pack)

        floor_s = tokens * flops_per_token / env.world_size / peak
        result["profile"] = profile_step(ppo_step, env.device, floor_s, args.out if env.rank == 0 else None)
    write_report(result, args.out)


def profile_step(step: Callable[[], None], device: torch.device, floor_s: float, out: Path | None) -> dict[str, float]:
    """One ``step()`` under torch.profiler: wall and busy time, busy time by kind of kernel, and
    the costliest kernels (operators on the CPU), printed and written beside ``out``."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_rlhf.metrics.kernels import by_kind, costliest, op_times, print_report

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        wall = wall_seconds(step, device)
    times = op_times(prof)
    busy_s = sum(us for us, _ in times.values()) / 1e6
    kinds = {kind: us / 1e6 for kind, us in by_kind(times).items()}
    figures = {
        "wall_s": wall,
        "busy_s": busy_s,
        "floor_at_matmul_peak_s": floor_s,
        "launches": sum(n for _, n in times.values()),
    }
    figures |= {f"{kind}_s": seconds for kind, seconds in kinds.items()}
    unit = "GPU kernels" if on_gpu else "CPU operators (no kernels in CPU mode)"
    lines = [
        f"== one PPO step: {wall:.3f} s wall, {busy_s:.3f} s in {unit}, {figures['launches']} launches; "
        f"its FLOPs at the matmul peak: {floor_s:.3f} s"
    ]
    lines += [f"{seconds:9.3f} s {100 * seconds / busy_s:5.1f}%  {kind}" for kind, seconds in kinds.items()]
    print_report([*lines, "-- costliest", *costliest(times, 25)], out)
    return figures


if __name__ == "__main__":
    main()
