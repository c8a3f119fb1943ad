"""Test tiers: unit (default), ``distributed`` (torchrun + gloo) and ``gpu`` (skipped without CUDA)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Built-in models are written under the cache dir: keep tests out of the user's home.
os.environ.setdefault("MEGATRON_RLHF_CACHE", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "mrlhf"))


LONGEST_FIRST = ("tests/distributed/test_pipeline.py",)
"""Test files that take minutes in one piece (the README's main job): collected first, so that a
parallel run (scripts/test.sh: pytest-xdist, whole files per worker) does not end on them alone."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)  # stable: otherwise as collected
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def world_of_one():
    """torch.distributed with one gloo rank in this process (CPU mode), for single-rank tests."""
    from megatron_rlhf.parallel.distributed import init_distributed

    return init_distributed("cpu")


@pytest.fixture(scope="session")
def tool_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory with a Qwen2.5-shaped chat template that renders tool calls and messages
    (``tests/helpers.py``'s ``qwen25_tools`` style)."""
    from tests.helpers import make_chat_tokenizer

    return make_chat_tokenizer("qwen25_tools", tmp_path_factory.mktemp("qwen25_tools"))


@pytest.fixture(scope="session")
def tool_chat_tokenizer(tool_chat_dir: Path):
    """``tool_chat_dir``'s tokenizer (an ``HFTokenizer``)."""
    from megatron_rlhf.data.tokenizer import HFTokenizer, load_tokenizer

    loaded = load_tokenizer(tool_chat_dir)
    assert isinstance(loaded, HFTokenizer)
    return loaded
