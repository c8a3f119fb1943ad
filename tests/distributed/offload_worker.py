"""torchrun worker (1 rank, gloo, bf16): the optimizer with part or all of its state on the host
(``cpu_offload_fraction``) trains like the plain one and resumes bit for bit.

For each fraction: 4 SFT steps with the plain distributed optimizer and with the offloading one;
then 2 offloading steps, save, a fresh model + optimizer, load, 2 steps: must equal the 4 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.distributed.resume_worker import batch_for
from tests.launch import WorkerSession, worker_session

LR = 3e-3


def main(session: WorkerSession) -> None:
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.checkpoint.train_state import load_train_state, save_train_state
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env, out, results = session.env, session.out, session.results

    def fresh(fraction: float):
        role = build_role(
            "actor",
            ModelConfig(path="builtin:tiny-llama"),
            architecture_of("builtin:tiny-llama"),
            world_size=env.world_size,
            dtype=torch.bfloat16,
            device=env.device,
        )
        return make_train_state(role, OptimConfig(lr=LR, weight_decay=0.01, cpu_offload_fraction=fraction))

    def run(state, steps: range) -> list[float]:
        return [
            train_step(state, batch_for(step, 0, 1), sft_loss(state.role), max_tokens_per_micro_batch=64)["loss"]
            for step in steps
        ]

    def weights(state) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in state.role.model.named_parameters()}

    plain = fresh(0.0)
    plain_losses = run(plain, range(1))
    plain_one_step = weights(plain)
    plain_losses += run(plain, range(1, 4))
    for fraction in (1.0, 0.5):
        state = fresh(fraction)
        hdo = state.optimizer.chained_optimizers[0].optimizer
        assert isinstance(hdo, HybridDeviceOptimizer), type(hdo)
        losses = run(state, range(1))
        a, b = plain_one_step, weights(state)
        # One bf16 ulp of the larger of the two values (2^-7 relative bounds it from above).
        one_step_within_ulp = all(
            bool(((a[k] - b[k]).abs() <= torch.maximum(a[k].abs(), b[k].abs()) * 2**-7).all()) for k in a
        )
        one_step_differing = sum(int((a[k] != b[k]).sum()) for k in a) / sum(v.numel() for v in a.values())
        losses += run(state, range(1, 4))
        a, b = weights(plain), weights(state)
        resumed = fresh(fraction)
        run(resumed, range(2))
        save_train_state(resumed, out / f"ckpt{fraction}")
        resumed = fresh(fraction)
        load_train_state(resumed, out / f"ckpt{fraction}")
        resumed_losses = run(resumed, range(2, 4))
        c = weights(resumed)
        results[str(fraction)] = {
            "host_params": sum(p.numel() for o in hdo.cpu_optimizers for g in o.param_groups for p in g["params"]),
            "device_params": sum(p.numel() for g in hdo.gpu_optimizer.param_groups for p in g["params"])
            if hdo.gpu_optimizer
            else 0,
            "loss_max_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(plain_losses, losses, strict=True)),
            "one_step_within_one_bf16_ulp": one_step_within_ulp,
            "one_step_differing_fraction": one_step_differing,
            "four_steps_max_abs_diff": max((a[k] - b[k]).abs().max().item() for k in a),
            "resume_losses_equal": resumed_losses == losses[2:],
            "resume_bit_identical": all(torch.equal(b[k], c[k]) for k in b),
        }


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
