"""A critic or a reward model started from a causal LM: the LM's backbone, no LM head, a score
head at zero. Checked against the LM built from the same files (the backbone) and by hand (the
head); the reward role and megatron checkpoints refuse it."""

from __future__ import annotations

import torch

from megatron_rlhf.checkpoint.sources import ModelConfig, build_role, model_errors
from megatron_rlhf.models.roles import HEAD_FROM_LM


def test_the_critic_gets_the_backbone_and_a_zero_head(world_of_one) -> None:
    lm_path = "builtin:tiny-llama"
    errors, critic_arch = model_errors("critic", ModelConfig(path=lm_path), 1, score_head=True, head_from_lm=True)
    assert not errors and critic_arch.score_head and critic_arch.hf_class_name == "LlamaForSequenceClassification"
    errors, lm_arch = model_errors("actor", ModelConfig(path=lm_path), 1, score_head=False)
    kwargs = dict(world_size=1, dtype=torch.float32, device=torch.device("cpu"))
    critic = build_role("critic", ModelConfig(path=lm_path), critic_arch, **kwargs)
    lm = build_role("actor", ModelConfig(path=lm_path), lm_arch, **kwargs)
    critic_params, lm_params = dict(critic.model.named_parameters()), dict(lm.model.named_parameters())
    assert set(critic_params) == set(lm_params)
    for name, param in critic_params.items():
        if name == "output_layer.weight":
            assert param.shape == (1, lm_arch.hidden_size) and not param.any()
        else:
            assert torch.equal(param, lm_params[name]), name
    tokens = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        values = critic.model(tokens, torch.arange(4)[None], None)
    assert values.shape == (1, 4, 1) and not values.any()


def test_only_roles_that_may_start_from_an_lm_do() -> None:
    assert {"critic"} == HEAD_FROM_LM
    errors, _ = model_errors("reward", ModelConfig(path="builtin:tiny-llama"), 1, score_head=True)
    assert errors == [
        "reward.path='builtin:tiny-llama' is a LlamaForCausalLM; the reward needs a "
        "*ForSequenceClassification (score head) model"
    ]
    errors, _ = model_errors("model", ModelConfig(path="builtin:tiny-llama-rm"), 1, score_head=False, head_from_lm=True)
    assert errors and "needs a *ForCausalLM" in errors[0]  # head_from_lm never removes a head
