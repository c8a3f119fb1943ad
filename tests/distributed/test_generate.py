"""The native generation engine: HF greedy parity, trainer log-prob parity, TP2, prompt limits."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.launch import run_worker

WORKER = Path(__file__).with_name("generate_worker.py")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_matches_hf_and_trainer(tp: int, tmp_path: Path) -> None:
    results = run_worker(WORKER, tp, tmp_path, str(tp))
    assert all(v == 0 for k, v in results.items() if k.endswith("greedy_mismatches"))
    assert all(v < 1e-5 for k, v in results.items() if "logprob_max_abs_diff" in k)
    # Both decode paths meet HF above: the engine's own layer forward, and megatron's modules for
    # qwen3, whose Q/K norms the engine's forward does not compute.
    fused = {k.split("/")[0]: v for k, v in results.items() if k.endswith("fused_decode")}
    assert fused == {"llama": 1, "qwen2": 1, "mistral": 1, "qwen3": 0}, fused


def _tiny_engine(on_long_prompt: str):
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig

    role = build_role(
        "actor",
        ModelConfig(path="builtin:tiny-llama"),
        architecture_of("builtin:tiny-llama"),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return NativeEngine(role, NativeEngineConfig(max_batch_size=4, max_seq_len=16, on_long_prompt=on_long_prompt))


def test_long_prompt_is_an_error_naming_the_prompt(world_of_one) -> None:
    from megatron_rlhf.rollout.native import PromptTooLongError
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    with pytest.raises(
        PromptTooLongError, match=r"prompt 1 has 20 tokens; rollout.engine.max_seq_len=16 leaves room for at most 15"
    ):
        engine.generate([[5, 6], list(range(20))], SamplingParams(temperature=0.0, max_new_tokens=4))


def test_long_prompt_truncation_is_counted_and_leaves_room_for_the_response(world_of_one) -> None:
    """Before, truncation kept 15 of the 16 positions for the prompt: one new token of the 4 asked for."""
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("truncate")
    short, fits, long = engine.generate(
        [[5, 6], list(range(15)), list(range(20))], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    )
    assert short.prompt_tokens_dropped == 0 and len(short.token_ids) == 4 and short.finish_reason == "length"
    assert fits.prompt_tokens_dropped == 0 and len(fits.token_ids) == 1  # room for one token: not truncated
    assert long.prompt_tokens_dropped == 8 and long.prompt_ids == list(range(8, 20))
    assert len(long.token_ids) == 4 and long.finish_reason == "length"


def test_stop_token_ends_a_sample(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    free_run = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0]
    stop = free_run.token_ids[2]
    stopped = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop) + 1]
    assert stopped.finish_reason == "stop"


def test_stops_with_continuous_batching_equal_single_sequence_runs(world_of_one) -> None:
    # More prompts than slots, different stop points: every sample equals its own one-at-a-time
    # run cut after the first stop token (the device runs one step ahead of the host; the extra
    # token of a stopped sample must be dropped, and a freed slot must serve the next prompt).
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14, 15], [3, 4], [8, 8], [20, 1, 2]]
    free = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    single = [engine.generate([p], free)[0].token_ids for p in prompts]
    counts = collections.Counter(token for run in single for token in set(run))
    stop = counts.most_common(1)[0][0]  # the token in the most runs: they stop at different steps
    engine.cfg.max_batch_size = 2
    batched = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    for run, completion in zip(single, batched, strict=True):
        expected = run[: run.index(stop) + 1] if stop in run else run
        assert completion.token_ids == expected
        assert completion.finish_reason == ("stop" if stop in run else "length")
        assert len(completion.logprobs) == len(completion.token_ids)
    assert sum(stop in run for run in single) >= 2, "the stop token should end at least two samples"


def test_engine_reused_across_calls_gives_the_same_results(world_of_one) -> None:
    # The engine keeps its KV cache and slot state between calls (and, on GPU, its CUDA graphs):
    # nothing of one call may leak into the next.
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    first = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    other = [[1, 2, 3, 4, 5, 6], [7], [8, 9]]
    params = SamplingParams(temperature=0.8, max_new_tokens=6, ignore_eos=True, seed=3)
    before = engine.generate(first, params)
    engine.generate(other, SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True))
    again = engine.generate(first, params)
    fresh = _tiny_engine("error").generate(first, params)
    for a, b, c in zip(before, again, fresh, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids and a.logprobs == b.logprobs == c.logprobs


@pytest.mark.parametrize("slots", [4, 12])
def test_samples_sharing_a_prefill_equal_separately_prefilled_ones(world_of_one, slots: int) -> None:
    # n samples of a prompt admitted together share one prefill (the others copy its cache rows):
    # they equal the same prompt repeated n times, each prefilled on its own. With 4 slots a
    # prompt's samples are split over two admissions.
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    engine.cfg.max_batch_size = slots
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [4]]
    params = SamplingParams(temperature=0.8, max_new_tokens=6, ignore_eos=True, seed=5, n=3)
    shared = engine.generate(prompts, params)
    alone = engine.generate([p for p in prompts for _ in range(3)], dataclasses.replace(params, n=1))
    assert [(c.prompt_index, c.sample_index) for c in shared] == [(i, j) for i in range(3) for j in range(3)]
    for a, b in zip(shared, alone, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    assert len({tuple(c.token_ids) for c in shared}) > 3  # the samples of a prompt differ


def test_engine_reports_each_finished_completion(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    counts: list[int] = []
    prompts = [[5, 6, 7], [9], [11, 12], [3, 4], [8]]
    engine.cfg.max_batch_size = 2
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, n=2), counts.append)
    assert counts == list(range(1, 11))


def test_history_keeps_every_step_past_its_initial_capacity() -> None:
    from megatron_rlhf.rollout.native import _History

    history = _History(slots=3)
    steps = 600  # more than the initial 256 rows: the buffer must grow without losing rows
    for step in range(steps):
        produced = torch.tensor([step, -1 if step % 2 else step + 1, -1])  # slot 1 produces every other step
        history.append(produced, produced.float() / 10)
    (tokens, logprobs), odd, none = history.of_slots([0, 1, 2], since=[0, 500, 0])
    assert tokens == list(range(steps)) and logprobs == (torch.arange(steps).float() / 10).tolist()
    assert odd[0] == [s + 1 for s in range(500, steps, 2)]
    assert odd[1] == (torch.arange(501, steps, 2).float() / 10).tolist()
    assert none == ([], [])
    assert history.of_slots([1], since=[599]) == [([], [])]  # step 599 is odd: nothing from slot 1
