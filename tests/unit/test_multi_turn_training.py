"""Training on multi-turn trajectories: the environment's tokens between policy turns are gaps in
``response_mask``. The rollout batch's masks and the reward's position are checked by hand; every
advantage estimator, aggregation mode and KL computation against float64 references made by
removing the environment tokens and running the single-turn computation; and the trainer's own
passes on the tiny built-in model: packed log-probs equal unpacked ones, an update does not
depend on anything at the environment's positions, and a whole step runs on trajectories."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from megatron_rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    KL_MEASURES,
    AdvantageConfig,
    aggregate_loss,
    apply_kl_penalty,
    controller_kl,
    kl_loss,
    ppo_policy_loss,
    value_loss,
)
from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.metrics.phases import PhaseTimer
from megatron_rlhf.rollout.engine import Agent, Completion, RolloutEngine
from megatron_rlhf.rollout.sampling import SamplingParams
from megatron_rlhf.trainer.ppo import outcome_rewards, ppo_step, rollout_batch, set_up_ppo
from megatron_rlhf.trainer.ppo_config import PPOConfig
from megatron_rlhf.training.objectives import PPOLossConfig, critic_loss, logprobs_output, ppo_actor_loss
from megatron_rlhf.training.optim import OptimConfig, make_train_state
from megatron_rlhf.training.schedule import logits_only_at, micro_batches
from megatron_rlhf.training.train import forward_pass, train_step
from tests.helpers import PPO_TINY_ROLLOUT

F64 = torch.float64


def trajectory(prompt: list[int], *turns: tuple[list[int], bool], prompt_index: int = 0) -> Completion:
    """A completion whose response is ``turns`` one after the other, each (tokens, sampled by the
    policy); the environment's tokens have log-prob 0, as the engine reports them."""
    tokens = [t for ids, _ in turns for t in ids]
    policy = [sampled for ids, sampled in turns for _ in ids]
    return Completion(
        prompt_index=prompt_index,
        sample_index=0,
        prompt_ids=prompt,
        token_ids=tokens,
        logprobs=[-0.5 if sampled else 0.0 for sampled in policy],
        finish_reason="stop",
        policy_mask=policy,
    )


def test_rollout_batch_masks_the_environment_tokens_out_by_hand() -> None:
    """Prompt 3 tokens, policy 2, tool 3, policy 2; a single-turn row beside it is unchanged; a
    trajectory cut while the environment spoke ends on environment tokens."""
    completions = [
        trajectory([5, 6, 7], ([11, 12], True), ([40, 41, 42], False), ([13, 14], True)),
        Completion(prompt_index=1, sample_index=0, prompt_ids=[5, 6], token_ids=[20, 21, 22], logprobs=[-1.0] * 3),
        trajectory([5], ([30], True), ([43, 44], False), prompt_index=2),
    ]
    batch = rollout_batch(completions, pad_id=0)
    F, T = False, True
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 11, 12, 40, 41, 42, 13, 14],
        [5, 6, 20, 21, 22, 0, 0, 0, 0, 0],
        [5, 30, 43, 44, 0, 0, 0, 0, 0, 0],
    ]
    assert batch["response_mask"].tolist() == [
        [F, F, F, T, T, F, F, F, T, T],
        [F, F, T, T, T, F, F, F, F, F],
        [F, T, F, F, F, F, F, F, F, F],
    ]
    assert batch["attention_mask"].sum(1).tolist() == batch["lengths"].tolist() == [10, 5, 4]
    # The outcome reward sits on the last policy token, not on the sequence's last token.
    rewards = outcome_rewards(torch.tensor([1.0, 2.0, 3.0]), batch["response_mask"])
    assert rewards.nonzero().tolist() == [[0, 9], [1, 4], [2, 1]]
    assert rewards[rewards != 0].tolist() == [1.0, 2.0, 3.0]


def test_a_policy_mask_of_the_wrong_length_is_named() -> None:
    bad = trajectory([5], ([11, 12], True))
    bad.policy_mask = [True]
    with pytest.raises(ValueError, match=r"completion 0 \(prompt 0, sample 0\): policy_mask has 1 entries.* \(2\)"):
        rollout_batch([bad], pad_id=0)


# --------------------------------------------------------------------------- against the compacted batch


def gapped_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) float64 per-token inputs, a response mask with gaps (two groups of three rows) and the
    group of each row. Row 0 is the first test's trajectory's response (policy 2, tool 3, policy 2);
    row 3 is single-turn. The masked positions hold NaN: nothing may read them."""
    g = torch.Generator().manual_seed(seed)
    T = 11
    mask = torch.zeros(6, T, dtype=torch.bool)
    mask[0, [0, 1, 5, 6]] = True
    mask[1, [0, 1, 2, 6, 7, 9, 10]] = True  # three policy turns, two tool results
    mask[2, [0, 4, 5, 6]] = True
    mask[3, :8] = True
    mask[4, [0, 1, 2, 3, 8]] = True
    mask[5, [1, 2, 3, 4, 5, 6, 7, 8, 9]] = True
    values = torch.randn(6, T, generator=g, dtype=F64).masked_fill(~mask, float("nan"))
    return values, mask, torch.tensor([0, 0, 0, 1, 1, 1])


def compacted(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's masked entries removed, the rest moved left and right-padded with 0: the
    single-turn batch of the same policy tokens, and its (contiguous) mask."""
    width = int(mask.sum(1).max())
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    kept = torch.arange(width)[None] < mask.sum(1)[:, None]
    out[kept] = x[mask]
    return out, kept


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_skips_the_environment_tokens(name: str) -> None:
    """Outcome score at each row's last policy token plus a per-token penalty, values on every
    token: advantages and returns equal the estimator's on the batch with the gaps removed."""
    noise, mask, groups = gapped_batch(0)
    values, _, _ = gapped_batch(1)
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, -0.5], dtype=F64)
    rewards = outcome_rewards(scores, mask) + 0.01 * noise.nan_to_num(0.0)
    rewards = rewards.masked_fill(~mask, float("nan"))
    config = AdvantageConfig(gamma=0.9, lam=0.8)
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    advantages, returns = estimator(
        token_rewards=rewards, response_mask=mask, values=values, group_index=groups, config=config
    )
    compact_rewards, compact_mask = compacted(rewards, mask)
    expected = estimator(
        token_rewards=compact_rewards,
        response_mask=compact_mask,
        values=compacted(values, mask)[0],
        group_index=groups,
        config=config,
    )
    assert advantages.dtype == F64 and advantages[mask].abs().sum() > 0
    for got, want in zip((advantages, returns), expected, strict=True):
        torch.testing.assert_close(got[mask], want[compact_mask], rtol=1e-12, atol=1e-12)
        assert not got[~mask].any()


@pytest.mark.parametrize("agg_mode", AGG_MODES.names())
def test_every_aggregation_mode_counts_policy_tokens_only(agg_mode: str) -> None:
    """The policy loss (with its metrics), the KL loss and the value loss: the same numerator and
    denominator as on the batch with the gaps removed."""
    logprobs, mask, _ = gapped_batch(2)
    old_logprobs, advantages, values = (gapped_batch(seed)[0] for seed in (3, 4, 5))
    logprobs, old_logprobs = logprobs * 0.1 - 2.0, old_logprobs * 0.1 - 2.0
    settings = {"agg_mode": agg_mode, "loss_scale_factor": 16.0}

    def losses(m: torch.Tensor, *x: torch.Tensor) -> list[torch.Tensor]:
        lp, old, adv, v = x
        num, den, metrics = ppo_policy_loss(lp, old, adv, m, clip_low=0.02, clip_high=0.03, dual_clip_c=3.0, **settings)
        kl = kl_loss(lp, old, m, estimator="k3", **settings)
        value = value_loss(v, v + adv * 0.3, adv, m, clip_range=0.1, **settings)
        return [num, den, *metrics.values(), *kl, *value[:2], *value[2].values()]

    tensors = (logprobs, old_logprobs, advantages, values)
    got = losses(mask, *tensors)
    compact_mask = compacted(advantages, mask)[1]
    want = losses(compact_mask, *(compacted(x, mask)[0] for x in tensors))
    assert all(x.isfinite() for x in got) and got[2] > 0  # some tokens are clipped
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # A token-mean divides by the policy tokens (counted by hand), not by every response token.
    assert aggregate_loss(torch.ones_like(advantages), mask, "token-mean")[1] == 4 + 7 + 4 + 8 + 5 + 9


def test_the_kl_penalty_and_the_controllers_measure_skip_the_environment_tokens() -> None:
    logprobs, mask, _ = gapped_batch(6)
    ref_logprobs, rewards = gapped_batch(7)[0], gapped_batch(8)[0]
    compact_mask = compacted(rewards, mask)[1]
    for estimator in KL_ESTIMATORS.names():
        kl = KL_ESTIMATORS.get(estimator)(logprobs * 0.1 - 2.0, ref_logprobs * 0.1 - 2.0)
        penalised = apply_kl_penalty(rewards, kl, 0.2, mask)
        expected = apply_kl_penalty(*(compacted(x, mask)[0] for x in (rewards, kl)), 0.2, compact_mask)
        torch.testing.assert_close(penalised[mask], expected[compact_mask], rtol=1e-12, atol=1e-12)
        for measure in KL_MEASURES.names():
            torch.testing.assert_close(
                controller_kl(kl, mask, measure),
                controller_kl(compacted(kl, mask)[0], compact_mask, measure),
                rtol=1e-12,
                atol=1e-12,
            )


# --------------------------------------------------------------------------- the trainer's passes

CPU = torch.device("cpu")
BUDGET = 64
"""Tokens per micro-batch: several pieces, several trajectories packed into a row of each."""


def tool_trajectories(seed: int) -> list[Completion]:
    """Ten rollouts on the tiny model's vocabulary: prompts of 2-8 tokens, eight trajectories of two
    or three policy turns (1-6 tokens) with tool results (1-5 tokens) between them, and two
    single-turn responses."""
    rng = random.Random(seed)

    def ids(low: int, high: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(rng.randint(low, high))]

    out = []
    for index in range(10):
        turns: list[tuple[list[int], bool]] = [(ids(1, 6), True)]
        for _ in range(0 if index >= 8 else rng.randint(1, 2)):
            turns += [(ids(1, 5), False), (ids(1, 6), True)]
        out.append(trajectory(ids(2, 8), *turns, prompt_index=index))
    out[8].policy_mask = out[9].policy_mask = None  # the single-turn ones
    return out


def build(path: str):
    return build_role(
        "actor", ModelConfig(path=path), architecture_of(path), world_size=1, dtype=torch.float32, device=CPU
    )


@pytest.mark.parametrize("pack", [True, False])
def test_the_lm_head_runs_at_policy_tokens_only_and_packing_changes_nothing(world_of_one, pack: bool) -> None:
    """The rollout batch as the trainer's log-prob passes read it (``logits_only_at`` its
    response_mask): one LM-head position per policy token, the log-probs of a pass with every
    position's logits there (float32), 0 on the environment's tokens."""
    batch = rollout_batch(tool_trajectories(0), pad_id=0)
    policy = batch["response_mask"]
    environment = batch["attention_mask"] & ~policy & (torch.arange(policy.shape[1]) > 0)
    assert environment.sum() > 10
    actor = build("builtin:tiny-llama")
    fn = logprobs_output(actor, temperature=0.7)
    selected = logits_only_at(batch, "response_mask")
    pieces, _ = micro_batches(selected, BUDGET, actor.groups, CPU, pack=pack)
    assert len(pieces) > 1 and any("cu_seqlens" in p for p in pieces) == pack
    assert sum(len(p["logit_index"]) for p in pieces) == int(policy.sum())
    full = forward_pass(actor, batch, fn, max_tokens_per_micro_batch=BUDGET, pack_sequences=False)
    got = forward_pass(actor, selected, fn, max_tokens_per_micro_batch=BUDGET, pack_sequences=pack)
    torch.testing.assert_close(got[policy], full[policy], rtol=1e-5, atol=1e-6)
    assert not got[~policy].any() and full[environment].all()


def per_token_inputs(batch: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The update's token-aligned inputs, random on every position of the rows."""
    g = torch.Generator().manual_seed(seed)
    shape = batch["input_ids"].shape
    return {
        "old_logprobs": -3.0 + 0.3 * torch.randn(shape, generator=g),
        "ref_logprobs": -3.0 + 0.3 * torch.randn(shape, generator=g),
        "advantages": torch.randn(shape, generator=g),
        "old_values": torch.randn(shape, generator=g),
        "returns": torch.randn(shape, generator=g),
    }


@pytest.mark.parametrize("role_name", ["actor", "critic"])
def test_an_update_reads_nothing_at_the_environment_tokens(world_of_one, role_name: str) -> None:
    """A PPO step (the actor with entropy bonus and KL loss, or the critic) on packed trajectories:
    other advantages, log-probs, values and returns at the environment's tokens give the same loss
    and bit-identical gradients; the same change at one policy token does not (the control)."""
    batch = rollout_batch(tool_trajectories(1), pad_id=0)
    policy = batch["response_mask"]
    environment = batch["attention_mask"] & ~policy
    inputs = per_token_inputs(batch, 0)
    other = per_token_inputs(batch, 1)
    control = policy & (policy.cumsum(1) == 2)  # each row's second policy token
    cfg = PPOLossConfig(agg_mode="seq-mean-token-mean", entropy_coef=0.01, kl_loss_coef=0.05, value_clip=0.2)
    results = []
    for changed in (None, environment, control):
        per_token = inputs if changed is None else {k: torch.where(changed, other[k], v) for k, v in inputs.items()}
        role = build("builtin:tiny-llama" if role_name == "actor" else "builtin:tiny-llama-rm")
        state = make_train_state(role, OptimConfig(lr=1e-2, clip_grad=100.0))
        loss_fn = ppo_actor_loss(role, cfg, temperature=0.7) if role_name == "actor" else critic_loss(cfg)
        step_batch = {**batch, **per_token}
        if role_name == "actor":
            step_batch = logits_only_at(step_batch, "response_mask")
        metrics = train_step(state, step_batch, loss_fn, max_tokens_per_micro_batch=BUDGET)
        results.append((metrics["loss"], torch.cat([b.grad_data for b in state.ddp_model.buffers])))
    (loss, grads), (env_loss, env_grads), (control_loss, control_grads) = results
    assert grads.abs().sum() > 0
    assert env_loss == loss and torch.equal(env_grads, grads)
    assert control_loss != loss and not torch.allclose(control_grads, grads)


@dataclasses.dataclass
class ToolResultsInside:
    """The run's engine with tokens 2-4 of each response relabelled as a tool's result (policy_mask
    False, log-prob 0): multi-turn completions from the tiny model without an agent loop."""

    engine: RolloutEngine

    @property
    def layout_description(self) -> str:
        return self.engine.layout_description

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        timer: PhaseTimer | None = None,
        agent: Agent | None = None,
    ) -> list[Completion]:
        out = []
        for c in self.engine.generate(prompts, params, timer):
            policy = [not 2 <= i < 5 for i in range(len(c.token_ids))]
            logprobs = [logprob if sampled else 0.0 for logprob, sampled in zip(c.logprobs, policy, strict=True)]
            out.append(dataclasses.replace(c, policy_mask=policy, logprobs=logprobs))
        return out


def test_a_ppo_step_with_a_critic_and_a_kl_penalty_trains_on_trajectories(world_of_one, tmp_path: Path) -> None:
    """One whole step (GAE, the critic, the KL penalty in the reward) on trajectories: every figure
    finite, the response length is the policy's tokens (8 sampled, 3 of them relabelled), the
    engine's log-probs agree with the trainer's on them."""
    cfg = load_config(
        "ppo-tiny",
        [
            "device=cpu",
            *PPO_TINY_ROLLOUT,
            "rollout.sampling.ignore_eos=true",
            "algorithm.advantage_estimator=gae",
            "algorithm.kl_penalty.coef=0.05",
            "algorithm.loss.kl_loss_coef=0",
            f"output_dir={tmp_path}",
        ],
        schema=PPOConfig,
    )
    run = set_up_ppo(cfg, world_of_one)
    run.generation = ToolResultsInside(run.generation)
    metrics, _ = ppo_step(run, 1, [0, 1, 2, 3])
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())
    assert metrics["response_length/mean"] == metrics["response_length/max"] == 8 - 3
    assert metrics["rollout/logprob_max_abs_diff"] < 1e-5 and metrics["critic/vf_loss"] > 0
