"""ppo with a LoRA actor (CPU, one process, float32): rollouts from the merged weights, the base
untouched, the reference as the actor's base with its adapters off.

References, independent of the code under test: the trainer's forward with the adapters running
unmerged (what the engine's sampling log-probs must equal), a reference model of the same base built
without LoRA (the free reference's log-probs), the base weights as a model built without LoRA holds
them (the actor's base after rollouts and updates)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.config.loader import ConfigError, load_config
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config, reference_from_actor
from tests.helpers import PPO_TINY_ROLLOUT, response_logprobs

TINY = ("device=cpu", *PPO_TINY_ROLLOUT, "actor.lora.rank=8", "save_hf=false")
"""ppo-tiny (GRPO, a KL loss to the reference, actor and reference on builtin:tiny-llama) with a LoRA
actor, on 16 sequences."""
TOLERANCE = 1e-5
"""The engine's log-probs against the trainer's, as for full fine-tuning (tests/distributed/test_ppo.py)."""


def _config(*overrides: str) -> PPOConfig:
    return load_config("ppo-tiny", [*TINY, *overrides], schema=PPOConfig)


@pytest.mark.parametrize(
    ("overrides", "free"),
    [
        ((), True),
        (("reference.path=''",), True),  # empty: the actor's
        (("actor.lora.rank=0",), False),  # the base trains: it is not the initial policy any more
        (("reference.path=/models/other",), False),
        (("algorithm.loss.kl_loss_coef=0",), False),  # no KL term: no reference at all
        (("reference.update=ema",), False),
    ],
)
def test_the_reference_is_the_actors_base_when_it_can_be(overrides: tuple[str, ...], free: bool) -> None:
    assert reference_from_actor(_config(*overrides)) == free


def test_ppo_accepts_a_lora_actor() -> None:
    check_ppo_config(_config(), 1)  # raises ConfigError otherwise


def test_ppo_refuses_lora_dropout() -> None:
    """Dropout is on in the update's forward only: with 0.1 the first mini-batch's ratio was not 1.
    (tests/unit/test_lora.py shows dropout on in train mode and off in eval mode.)"""
    with pytest.raises(ConfigError, match=r"actor.lora.dropout=0.1 must be 0 in ppo: dropout acts in the update"):
        check_ppo_config(_config("actor.lora.dropout=0.1"), 1)


def _base_model(path: str = "builtin:tiny-llama"):
    """The base as built without LoRA: the independent reference model."""
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role

    return build_role(
        "reference",
        ModelConfig(path=path),
        architecture_of(path),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def _split(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, adapters): the model's parameters by name, copied."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapters = {name: p for name, p in params.items() if "_lora." in name}
    return {name: p for name, p in params.items() if name not in adapters}, adapters


def test_rollouts_use_the_merged_weights_and_the_reference_is_the_base(world_of_one, tmp_path: Path) -> None:
    """With B random (the adapters matter), one rollout from the zero-copy layout: the engine's
    log-probs equal the trainer's with the adapters running unmerged, the actor's weights are
    bit-identical after it and its adapters on again, and the reference's log-probs (the actor with
    its adapters off, no reference model built) equal a separately built model of the base."""
    import dataclasses

    from megatron_rlhf.metrics.phases import PhaseTimer
    from megatron_rlhf.models.lora import adapters
    from megatron_rlhf.trainer.ppo import _rollout_logprobs, forward_passes, rollout_batch, set_up_ppo

    cfg = _config(f"output_dir={tmp_path}")
    run = set_up_ppo(cfg, world_of_one)
    assert run.reference is None and run.reference_is_actor_base
    assert run.generation.resharder.zero_copy and run.generation.resharder.merges_in_place
    actor = run.actor.role
    with torch.no_grad():
        for adapter in adapters(actor.model):
            for b in adapter.lora_B.values():
                b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(7))
    before = {name: p.detach().clone() for name, p in actor.model.named_parameters()}

    prompts = [run.prompts[i].prompt_ids.tolist() for i in range(cfg.prompts_per_step)]
    completions = run.generation.generate(prompts, dataclasses.replace(cfg.rollout.sampling, seed=11))
    after = dict(actor.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert all(adapter.enabled for adapter in adapters(actor.model))

    batch = rollout_batch(completions, run.tokenizer.pad_id)
    mask = batch["response_mask"]
    adapted = response_logprobs(actor, batch, cfg.max_tokens_per_micro_batch)
    base = response_logprobs(_base_model(), batch, cfg.max_tokens_per_micro_batch)
    assert ((adapted - base).abs() * mask).max() > 1e-2  # the adapters matter: an unmerged rollout would show
    assert ((_rollout_logprobs(completions, mask) - adapted).abs() * mask).max() < TOLERANCE
    reference = forward_passes(run, batch, PhaseTimer(run.device)).ref_logprobs
    assert reference is not None
    assert torch.equal(reference * mask, base * mask)  # bit for bit: the same weights through the same passes


def test_grpo_steps_train_only_the_adapters(world_of_one, tmp_path: Path) -> None:
    """Three GRPO steps from B = 0: the KL to the free reference is 0 at step 1 and not after, the
    engine's log-probs stay within the tolerance, the base is bit-identical to a model built without
    LoRA, and the adapters moved."""
    from megatron_rlhf.trainer.ppo import ppo_step, set_up_ppo

    cfg = _config(f"output_dir={tmp_path}", "actor_optim.lr=1e-3")
    run = set_up_ppo(cfg, world_of_one)
    assert run.reference is None and run.reference_is_actor_base
    _, initial_adapters = _split(run.actor.role.model)
    per_step = cfg.prompts_per_step
    metrics = [ppo_step(run, step, list(range((step - 1) * per_step, step * per_step)))[0] for step in range(1, 4)]
    assert metrics[0]["kl/per_sequence"] == 0.0  # B = 0: the actor is its base
    assert abs(metrics[2]["kl/per_sequence"]) > 0.0
    assert all(m["rollout/logprob_max_abs_diff"] < TOLERANCE for m in metrics)
    assert "timing_s/gen/lora_base_weights_back" in metrics[0] and "timing_s/ref" in metrics[0]
    base, trained = _split(run.actor.role.model)
    expected, _ = _split(_base_model().model)
    assert base.keys() == expected.keys()
    assert all(torch.equal(base[name], expected[name]) for name in expected)
    moved = [name for name in trained if not torch.equal(trained[name], initial_adapters[name])]
    assert len(moved) == len(trained), sorted(set(trained) - set(moved))
