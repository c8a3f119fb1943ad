"""The old-log-prob pass and when it is skipped: a run whose rollout feeds exactly one optimizer step
takes the old log-probs from the update's own forward; its steps must equal those of the same run
with the pass forced (``algorithm.recompute_old_logprobs=always``), which is the reference here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.trainer.ppo_config import PPOConfig, old_logprob_pass

TINY = (
    "device=cpu",
    "prompts_per_step=4",
    "rollout.sampling.n=4",
    "mini_batch_size=0",
    "ppo_epochs=1",
    "rollout.sampling.max_new_tokens=8",
    "samples_per_step=0",
    "algorithm.loss.entropy_coef=0.01",
    "max_tokens_per_micro_batch=64",
    "data.max_prompt_length=56",
)
"""ppo-tiny (GRPO, a KL loss to the reference) on 16 sequences, one optimizer step per rollout made
of several micro-batches (64 tokens each, prompts of at most 56), so that rows are recorded from
more than one."""


def _config(*overrides: str) -> PPOConfig:
    return load_config("ppo-tiny", [*TINY, *overrides], schema=PPOConfig)


@pytest.mark.parametrize(
    "overrides, recompute",
    [
        ((), False),
        (("mini_batch_size=16",), False),  # the whole rollout, named
        (("ppo_epochs=2",), True),
        (("mini_batch_size=8",), True),
        (("algorithm.kl_penalty.coef=0.05",), True),  # the reward reads them before the advantages
        (("algorithm.kl_penalty.type=adaptive", "algorithm.kl_penalty.coef=0.05"), True),
        (("algorithm.recompute_old_logprobs=always",), True),
        (
            ("algorithm.advantage_estimator=gae", "algorithm.loss.kl_loss_coef=0"),
            False,
        ),  # critic values are another pass
    ],
)
def test_the_pass_is_skipped_only_when_provably_redundant(overrides: tuple[str, ...], recompute: bool) -> None:
    needed, reason = old_logprob_pass(_config(*overrides))
    assert needed == recompute, reason


def _run(tmp_path: Path, env, recompute: str, steps: int) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    from megatron_rlhf.trainer.ppo import ppo_step, set_up_ppo

    cfg = _config(f"output_dir={tmp_path / recompute}", f"algorithm.recompute_old_logprobs={recompute}")
    run = set_up_ppo(cfg, env)
    assert run.old_logprob_pass == (recompute == "always")
    per_step = cfg.prompts_per_step
    metrics = [
        ppo_step(run, step, list(range((step - 1) * per_step, step * per_step)))[0] for step in range(1, steps + 1)
    ]
    return metrics, {name: p.detach().clone() for name, p in run.actor.role.model.named_parameters()}


def test_skipping_the_pass_trains_as_recomputing_does(world_of_one, tmp_path: Path) -> None:
    """Three steps each way give the same figures and weights, bit for bit: on CPU a row's log-probs
    do not depend on the micro-batch it shares (train mode, shuffled rows, in the update) or on
    the pass it is computed in, so the recomputed ratio is exactly 1 too. (On a GPU, kernels chosen
    by batch shape can round differently: there the two runs agree to float rounding.) The skipped
    run's ``kl/per_sequence`` and ``rollout/logprob_max_abs_diff`` come from the update's forward;
    a row or column recorded in the wrong place would change them."""
    skipped, skipped_weights = _run(tmp_path, world_of_one, "auto", steps=3)
    recomputed, recomputed_weights = _run(tmp_path, world_of_one, "always", steps=3)
    for step, (a, b) in enumerate(zip(skipped, recomputed, strict=True), start=1):
        assert "timing_s/old_log_prob" not in a and "timing_s/old_log_prob" in b
        assert set(a) == set(b) - {"timing_s/old_log_prob", "timing_s/old_log_prob/std"}
        figures = sorted(key for key in a if not key.startswith(("timing_s/", "perf/")))
        assert {key: a[key] for key in figures} == {key: b[key] for key in figures}, step
        assert a["actor/approx_kl"] == 0.0 and a["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
        assert 0 < a["rollout/logprob_max_abs_diff"] < 1e-5  # the engine's against the update's
    assert skipped[0]["kl/per_sequence"] == 0.0  # the actor still equals the reference at step 1
    assert abs(skipped[1]["kl/per_sequence"]) > 1e-2  # ... and no longer at step 2: the figure is live
    initial = _initial_weights()
    for name, weight in skipped_weights.items():
        assert not torch.equal(weight, initial[name]), f"{name} did not move: the comparison proves nothing"
        assert torch.equal(weight, recomputed_weights[name]), name


def _initial_weights() -> dict[str, torch.Tensor]:
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role

    role = build_role(
        "actor",
        ModelConfig(path="builtin:tiny-llama"),
        architecture_of("builtin:tiny-llama"),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return {name: p.detach().clone() for name, p in role.model.named_parameters()}
