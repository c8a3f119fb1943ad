"""The RL-step floor (scripts/bench/roofline.py) against figures worked out by hand for builtin:tiny-llama."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from megatron_rlhf.checkpoint.sources import architecture_of
from tests.helpers import REPO


def _load_roofline() -> ModuleType:
    """The benchmarks' roofline module, loaded from its file: scripts/bench/ is a folder of scripts, not a package."""
    spec = importlib.util.spec_from_file_location("bench_roofline", REPO / "scripts" / "bench" / "roofline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


roofline = _load_roofline()
ModelWork, StepShape, rl_step_floor = roofline.ModelWork, roofline.StepShape, roofline.rl_step_floor


def test_tiny_llama_work():
    # vocab 512, hidden 128, FFN 352, 4 layers, 4 heads / 2 KV groups of 32, untied:
    # per layer q 128*128 + k, v 128*64 each + o 128*128 + 3 * 128*352 + 2 norms of 128 = 184,576;
    # embedding and LM head 512*128 = 65,536 each; final norm 128.
    work = ModelWork.of(architecture_of("builtin:tiny-llama"), dtype_bytes=2)
    assert work.params == 4 * 184_576 + 2 * 65_536 + 128 == 869_504
    assert work.matmul_params == 803_968  # all but the input embedding
    assert work.kv_bytes_per_token == 2 * 4 * 2 * 32 * 2  # K and V, 4 layers, 2 groups of 32, bf16
    assert work.forward_flops_per_token(6) == 2 * 803_968 + 4 * 4 * 128 * 6
    assert work.train_flops_per_token(6) == 3 * work.forward_flops_per_token(6)


def test_step_floor_by_hand():
    work = ModelWork.of(architecture_of("builtin:tiny-llama"), dtype_bytes=2)
    shape = StepShape(num_sequences=2, prompt_len=3, response_len=3)
    floor = rl_step_floor(work, shape, flops_per_s=1e9, bytes_per_s=2.5e8, forward_passes=[work])
    # Forward FLOPs per token at context s: 1,607,936 + 2,048 s.
    assert floor["train"] == pytest.approx(2 * 6 * 3 * (1_607_936 + 2_048 * 6) / 1e9)  # 6 tokens a row, 3x forward
    assert floor["forward_passes"] == pytest.approx(2 * 6 * (1_607_936 + 2_048 * 6) / 1e9)
    assert floor["prefill"] == pytest.approx(2 * 3 * (1_607_936 + 2_048 * 3) / 1e9)
    # Two decode steps (the prefill gave the first token), at contexts 4 and 5: reading the weights
    # (803,968 x 2 bytes) and 2 rows of KV cache (1,024 bytes a token) takes longer than the FLOPs.
    compute = [2 * (1_607_936 + 2_048 * c) / 1e9 for c in (4, 5)]
    memory = [(1_607_936 + 2 * c * 1_024) / 2.5e8 for c in (4, 5)]
    assert all(m > c for m, c in zip(memory, compute, strict=True))
    assert floor["decode"] == pytest.approx(sum(memory))
    assert floor["decode_compute_bound"] == pytest.approx(sum(compute))
    assert floor["optimizer"] == pytest.approx(869_504 * 30 / 2.5e8)
    parts = ("prefill", "decode", "forward_passes", "train", "optimizer")
    assert floor["step"] == pytest.approx(sum(floor[k] for k in parts)) and floor["step"] == pytest.approx(0.204732928)


def test_four_model_step_floor_by_hand():
    """PPO: the policy generates; the reference and old log-prob passes are the policy's work, the
    values and the reward model's passes a score-head model's; the policy and the critic each take
    an optimizer step."""
    arch = architecture_of("builtin:tiny-llama")
    policy = ModelWork.of(arch, dtype_bytes=2)
    scorer = ModelWork.of(arch.with_score_head(), dtype_bytes=2)
    # The score head (1 x 128) replaces the LM head (512 x 128); the input embedding is a lookup.
    assert scorer.params == 4 * 184_576 + 65_536 + 128 + 128 and scorer.matmul_params == 4 * 184_576 + 128 + 128
    shape = StepShape(num_sequences=2, prompt_len=3, response_len=3)
    floor = rl_step_floor(
        policy,
        shape,
        flops_per_s=1e9,
        bytes_per_s=2.5e8,
        forward_passes=[policy, policy, scorer, scorer],
        updated=[policy, scorer],
    )
    grpo = rl_step_floor(policy, shape, flops_per_s=1e9, bytes_per_s=2.5e8, forward_passes=[policy])
    scorer_forward = 12 * (2 * scorer.matmul_params + 2_048 * 6) / 1e9  # 12 tokens at context 6
    assert floor["forward_passes"] == pytest.approx(2 * grpo["forward_passes"] + 2 * scorer_forward)
    assert floor["train"] == pytest.approx(grpo["train"] + 3 * scorer_forward)
    assert floor["optimizer"] == pytest.approx((869_504 + scorer.params) * 30 / 2.5e8)
    assert floor["generate"] == pytest.approx(grpo["generate"])
