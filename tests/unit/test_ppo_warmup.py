"""The start-up warm-up (``trainer/ppo.py::warm_up``) runs every phase of a step once and keeps
nothing: a run warmed up must train exactly as the same run without it. The reference is that run
(``warmup=never``): every figure of every step and every weight after the last, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.trainer.ppo_config import PPOConfig
from tests.helpers import PPO_TINY_ROLLOUT

TINY = ("device=cpu", *PPO_TINY_ROLLOUT)


def _run(tmp_path: Path, env, warmup: str, extra: tuple[str, ...], steps: int = 2):
    from megatron_rlhf.trainer.ppo import ppo_step, set_up_ppo

    cfg = load_config(
        "ppo-tiny", [*TINY, *extra, f"warmup={warmup}", f"output_dir={tmp_path / warmup}"], schema=PPOConfig
    )
    run = set_up_ppo(cfg, env)
    per_step = cfg.prompts_per_step
    metrics = [
        ppo_step(run, step, list(range((step - 1) * per_step, step * per_step)))[0] for step in range(1, steps + 1)
    ]
    states = [run.actor] + ([run.critic] if run.critic is not None else [])
    weights = {
        f"{s.role.role}.{name}": p.detach().clone() for s in states for name, p in s.role.model.named_parameters()
    }
    return metrics, weights, run


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("algorithm.advantage_estimator=gae", "algorithm.loss.kl_loss_coef=0"),
        ("actor.lora.rank=8", "save_hf=false"),  # merged generation weights, the actor's base as the reference
    ],
    ids=["grpo-kl-loss", "gae-critic", "lora-actor"],
)
def test_a_warmed_up_run_trains_exactly_as_one_without(world_of_one, tmp_path: Path, extra: tuple[str, ...]) -> None:
    warm, warm_weights, warm_run = _run(tmp_path, world_of_one, "always", extra)
    cold, cold_weights, _ = _run(tmp_path, world_of_one, "never", extra)
    assert warm_run.actor.step == 2  # the warm-up made no optimizer step of its own
    for step, (a, b) in enumerate(zip(warm, cold, strict=True), start=1):
        assert set(a) == set(b)
        figures = sorted(key for key in a if not key.startswith(("timing_s/", "perf/")))
        assert {key: a[key] for key in figures} == {key: b[key] for key in figures}, step
    assert warm[1]["actor/grad_norm"] > 0
    for name, weight in warm_weights.items():
        assert torch.equal(weight, cold_weights[name]), name


@pytest.mark.parametrize(
    ("pass_rows", "update_rows", "expected"),
    [
        (64, 64, [42, 22]),  # the 1.5B bench at 64 sequences: a full micro-batch of 42 rows, then 22
        (256, 256, [42, 4]),  # 6 x 42 + 4
        (256, 32, [42, 32, 4]),  # mini-batches of 32 rows: one micro-batch each
        (84, 84, [42, 2]),  # no remainder: 2 rows stand for the sizes of varied lengths
        (8, 8, [8, 2]),  # one micro-batch per pass
        (2, 2, [2]),
    ],
)
def test_the_warm_up_runs_each_micro_batch_size_of_a_step(
    pass_rows: int, update_rows: int, expected: list[int]
) -> None:
    from megatron_rlhf.trainer.ppo import warm_up_rows

    assert warm_up_rows(pass_rows=pass_rows, update_rows=update_rows, full_rows=42) == expected
