"""The native generation engine: HF greedy parity, trainer log-prob parity, TP2, prompt limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("generate_worker.py")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_matches_hf_and_trainer(tp: int, tmp_path: Path) -> None:
    proc = run_torchrun(WORKER, tp, str(tmp_path), str(tp))
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(v == 0 for k, v in results.items() if k.endswith("greedy_mismatches"))
    assert all(v < 1e-5 for k, v in results.items() if "logprob_max_abs_diff" in k)


def _tiny_engine(on_long_prompt: str):
    from megatron_rlhf.config.schema import ModelConfig
    from megatron_rlhf.models.roles import build_role
    from megatron_rlhf.models.sources import architecture_of
    from megatron_rlhf.rollout.native import NativeEngine, NativeEngineConfig

    role = build_role("actor", ModelConfig(path="builtin:tiny-llama"), architecture_of("builtin:tiny-llama"),
                      world_size=1, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    return NativeEngine(role, NativeEngineConfig(max_batch_size=4, max_seq_len=16, on_long_prompt=on_long_prompt))


def test_long_prompt_is_an_error_naming_the_prompt(world_of_one) -> None:
    from megatron_rlhf.rollout.native import PromptTooLongError
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    with pytest.raises(PromptTooLongError, match=r"prompt 1 has 20 tokens; max_seq_len=16 leaves room for at most 15"):
        engine.generate([[5, 6], list(range(20))], SamplingParams(temperature=0.0, max_new_tokens=4))


def test_long_prompt_truncation_is_counted_and_stops_at_the_context(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("truncate")
    short, long = engine.generate([[5, 6], list(range(20))], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert short.prompt_tokens_dropped == 0 and len(short.token_ids) == 4 and short.finish_reason == "length"
    assert long.prompt_tokens_dropped == 5 and long.prompt_ids == list(range(5, 20))
    assert len(long.token_ids) == 1 and long.finish_reason == "length"  # the 16-token context is full


def test_stop_token_ends_a_sample(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    free_run = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0]
    stop = free_run.token_ids[2]
    stopped = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop) + 1]
    assert stopped.finish_reason == "stop"
