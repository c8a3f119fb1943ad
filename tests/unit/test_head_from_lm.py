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


def test_a_reward_model_or_critic_of_several_labels_is_refused_as_transformers_reads_its_config(tmp_path) -> None:
    """A num_labels=2 classifier as reward model trained PPO on logit 0 with no word; one saved by
    transformers 5 (which leaves 2 labels' id2label out) failed blaming its weights' shape."""
    import json

    from tests.helpers import make_tiny_hf_model

    make_tiny_hf_model("qwen2", True, tmp_path / "rm2", num_labels=2)
    config = json.loads((tmp_path / "rm2" / "config.json").read_text())
    for key in ("num_labels", "id2label", "label2id"):
        config.pop(key, None)
    (tmp_path / "rm2" / "config.json").write_text(json.dumps(config))  # as transformers 5 saves 2 labels
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "rm2").num_labels == 2
    for role in ("reward", "critic"):
        errors, _ = model_errors(role, ModelConfig(path=str(tmp_path / "rm2")), 1, score_head=True, head_from_lm=True)
        assert errors == [
            f"{role}.path='{tmp_path / 'rm2'}' is a Qwen2ForSequenceClassification with 2 labels (its config's "
            f"num_labels or id2label; without either, transformers reads 2); the {role} reads one score per "
            "position (num_labels=1), as a Bradley-Terry reward model has: a classifier's logit is not one"
        ]
    make_tiny_hf_model("qwen2", True, tmp_path / "rm1")
    assert model_errors("reward", ModelConfig(path=str(tmp_path / "rm1")), 1, score_head=True)[0] == []
