"""Every model of a run reads the actor's token ids: a model whose tokenizer encodes text otherwise is
refused at start-up (``trainer.start``), whatever the sizes of the vocabularies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.data import load_tokenizer
from megatron_rlhf.trainer.start import RunModel, require_one_encoding
from tests.helpers import make_chat_tokenizer


def _models(**paths: Path) -> dict[str, RunModel]:
    arch = architecture_of("builtin:tiny-llama")  # not read by the check
    return {role: RunModel(ModelConfig(path=str(path)), arch) for role, path in paths.items()}


def test_a_reward_model_of_another_tokenizer_is_refused_and_one_of_the_same_is_not(tmp_path: Path) -> None:
    actor = make_chat_tokenizer("qwen2", tmp_path / "actor")
    other = make_chat_tokenizer("llama3", tmp_path / "other")
    same = Path(shutil.copytree(actor, tmp_path / "same"))
    bare = tmp_path / "bare"
    bare.mkdir()
    tokenizer = load_tokenizer(actor)
    require_one_encoding(_models(actor=actor, reward=same, critic=bare), "actor", tokenizer)
    with pytest.raises(ConfigError) as info:
        require_one_encoding(_models(actor=actor, reward=other, critic=same), "actor", tokenizer)
    assert str(info.value).startswith(f"reward.path='{other}': its tokenizer (HFTokenizer(")
    assert "encodes text otherwise than the actor's" in str(info.value) and "critic" not in str(info.value)
