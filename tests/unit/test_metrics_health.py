"""The health figures every PPO step logs whatever the config: the policy's entropy (without an
entropy bonus, against a float64 softmax of the model's own logits) and the share of groups whose
scores all match (hand-counted)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.trainer.ppo import uniform_group_fraction, uniform_groups
from megatron_rlhf.training.objectives import PPOLossConfig, ppo_actor_loss, token_aligned
from megatron_rlhf.training.optim import OptimConfig, make_train_state
from megatron_rlhf.training.schedule import Batch
from megatron_rlhf.training.train import forward_pass, train_step
from tests.unit.test_packing import LENGTHS, batch_of, build


def test_uniform_groups_hand_counted() -> None:
    raw = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1e-6])
    assert uniform_groups(raw, 4).tolist() == [True, False, True, False]
    assert uniform_group_fraction(raw, 4) == 0.5
    assert uniform_group_fraction(raw, 2) == 5 / 8  # pairs: (1,1) (1,1) (0,1) (0,1) (.5,.5) (.5,.5) (0,0) (0,1e-6)
    assert uniform_group_fraction(raw, 1) == 1.0  # one sample per prompt: nothing to compare


def test_the_entropy_is_reported_without_a_bonus_and_is_the_policys(world_of_one) -> None:
    """entropy_coef=0: ``actor/entropy`` is the token mean over the response of -sum p log p of
    softmax(logits / T), the logits those of the update's forward (a float64 reference from the
    same weights), and the loss leaves it out."""
    temperature = 0.7
    batch = batch_of(LENGTHS)
    actor = build("builtin:tiny-llama")
    vocab = actor.arch.vocab_size

    def entropy(piece: Batch, logits: torch.Tensor) -> torch.Tensor:
        z = logits[:, :-1, :vocab].double() / temperature  # the padded vocabulary has no probability
        p = z.softmax(-1)
        return token_aligned(piece, torch.logsumexp(z, -1) - (p * z).sum(-1))

    reference = forward_pass(actor, batch, entropy, max_tokens_per_micro_batch=10_000)
    assert reference is not None
    mask = batch["response_mask"]
    expected = float((reference * mask).sum() / mask.sum())
    assert 0.5 < expected < torch.log(torch.tensor(float(vocab)))  # a real spread, below uniform's

    cfg = PPOLossConfig(entropy_coef=0.0, kl_loss_coef=0.05)
    state = make_train_state(actor, OptimConfig(lr=1e-2))
    metrics = train_step(
        state, batch, ppo_actor_loss(actor, cfg, temperature=temperature), max_tokens_per_micro_batch=10_000
    )
    assert metrics["actor/entropy"] == pytest.approx(expected, rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["actor/pg_loss"] + 0.05 * metrics["actor/kl_loss"], rel=1e-6)
