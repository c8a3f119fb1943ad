"""Multi-turn rollouts as the trainer reports and scores them: the ``multi_turn/`` metrics and the
samples.jsonl turns against hand-counted values, and a verl reward file given the whole trajectory
with verl's ``num_turns`` and ``rollout_reward_scores``, on hand-built completions (ids stand for
tokens; 2 is the stop token, and the only special one)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_rlhf.rewards import CustomRewardFunction, load_custom_function
from megatron_rlhf.rewards.config import ScoringConfig
from megatron_rlhf.rewards.scoring import Scorer
from megatron_rlhf.rollout.engine import Completion, TrajectoryRecord
from megatron_rlhf.trainer.ppo import sample_rows
from megatron_rlhf.trainer.trajectories import trajectory_fields, trajectory_metrics, turn_spans
from tests.distributed.test_ppo import _check_keys

STOP = 2


def _record(num_turns: int, tool_calls: int, errors: dict, seconds: float, rewards: dict) -> TrajectoryRecord:
    """A tool-calling trajectory's record: ``num_turns`` alternate policy and tool turns."""
    roles = ["assistant", "tool"] * (num_turns // 2)
    return TrajectoryRecord(
        num_turns=num_turns,
        policy_turns=num_turns // 2,
        user_turns=0,
        turn_scores=[],
        interaction_errors=0,
        interaction_failure="",
        tool_calls=tool_calls,
        tool_errors=errors,
        tool_seconds=seconds,
        tool_rewards=rewards,
        tool_call_rewards=[],
        messages=[{"role": role, "content": ""} for role in roles[:-1]],
    )


def _completion(prompt_index: int, ids: list[int], mask: str | None, finish: str, record=None) -> Completion:
    """``mask``: one letter per token, p for the policy's, e for the environment's."""
    return Completion(
        prompt_index=prompt_index,
        sample_index=0,
        prompt_ids=[5 + prompt_index],
        token_ids=ids,
        logprobs=[0.0] * len(ids),
        finish_reason=finish,
        policy_mask=None if mask is None else [m == "p" for m in mask],
        trajectory=record,
    )


# One tool call, the tool's reward 1.0: policy 10 11 STOP, tool 20 21 22, policy 12 STOP.
ONE_CALL = _completion(
    0, [10, 11, STOP, 20, 21, 22, 12, STOP], "pppeeepp", "stop", _record(4, 1, {}, 0.25, {"calc": 1.0})
)
# Three calls (a malformed one, a timeout), cut at the length limit: policy 10 STOP, tool 20 21,
# policy 13 STOP, tool 23, policy 14 14.
THREE_CALLS = _completion(
    1,
    [10, STOP, 20, 21, 13, STOP, 23, 14, 14],
    "ppeeppepp",
    "length",
    _record(6, 3, {"malformed_json": 1, "timeout": 1, "truncated": 0}, 2.0, {}),
)
SINGLE_TURN = _completion(0, [10, STOP, 11], None, "length")


def _joined(rows: list[list[int]]) -> list[str]:
    return [",".join(map(str, ids)) for ids in rows]


def _joined_without_stop(rows: list[list[int]]) -> list[str]:
    """A decode that skips special tokens (the stop token), as the reward functions' texts are."""
    return _joined([[i for i in ids if i != STOP] for ids in rows])


def _scorer(function: CustomRewardFunction | None) -> Scorer:
    return Scorer(
        ScoringConfig(use_reward_model=False),
        {},
        function,
        None,
        stop_ids=(STOP,),
        max_new_tokens=16,
        max_tokens_per_micro_batch=64,
    )


def test_turn_spans_are_the_runs_of_the_policy_mask() -> None:
    assert turn_spans([True, True, False, True]) == [(True, slice(0, 2)), (False, slice(2, 3)), (True, slice(3, 4))]
    assert turn_spans([False]) == [(False, slice(0, 1))] and turn_spans([]) == []


def test_metrics_hand_counted_over_the_trajectories_only() -> None:
    metrics = trajectory_metrics([ONE_CALL, SINGLE_TURN, THREE_CALLS])
    # policy tokens 5 and 6, the environment's 3 and 3, of 8 + 9 response tokens
    assert metrics == {
        "multi_turn/num_turns/mean": 5.0,
        "multi_turn/num_turns/max": 6.0,
        "multi_turn/tool_calls/mean": 2.0,
        "multi_turn/tool_calls/max": 3.0,
        "multi_turn/tool_errors/malformed_json": 0.5,
        "multi_turn/tool_errors/unknown_tool": 0.0,
        "multi_turn/tool_errors/bad_arguments": 0.0,
        "multi_turn/tool_errors/timeout": 0.5,
        "multi_turn/tool_errors/exception": 0.0,
        "multi_turn/tool_errors/truncated": 0.0,
        "multi_turn/tool_errors/over_limit": 0.0,
        "multi_turn/tool_seconds/mean": 1.125,
        "multi_turn/tool_seconds/max": 2.0,
        "multi_turn/policy_tokens/mean": 5.5,
        "multi_turn/tool_tokens/mean": 3.0,
        "multi_turn/tool_token_fraction": pytest.approx(6 / 17),
    }
    assert trajectory_metrics([SINGLE_TURN]) == {}
    _check_keys([metrics])  # named by the scheme and listed in docs/metrics.md


def test_sample_rows_show_each_trajectory_turn_by_turn() -> None:
    """A multi-turn row: the whole trajectory as ``response`` (what the reward read), its turns with
    special tokens (no final stop token), its record's counts and the errors that happened; a
    single-turn row as before, with ``raw_response`` where skipping changed its text."""
    decoded: list[list[list[int]]] = []

    def decode_batch(rows: list[list[int]]) -> list[str]:
        decoded.append(rows)
        return _joined(rows)

    run = types.SimpleNamespace(
        scorer=_scorer(None),
        texts=_joined_without_stop,
        tokenizer=types.SimpleNamespace(stop_ids=[STOP], decode_batch=decode_batch),
        cfg=types.SimpleNamespace(samples_token_ids=False),
    )
    rows = sample_rows(run, [ONE_CALL, THREE_CALLS, SINGLE_TURN], torch.tensor([1.0, 0.0, 0.5]))
    assert rows[0] == {
        "group": 0,
        "prompt": "5",
        "response": "10,11,20,21,22,12",
        "finish_reason": "stop",
        "reward": 1.0,
        "turns": [
            {"role": "assistant", "text": "10,11,2"},
            {"role": "tool", "text": "20,21,22"},
            {"role": "assistant", "text": "12"},
        ],
        "num_turns": 4,
        "tool_calls": 1,
        "tool_errors": {},
        "tool_rewards": {"calc": 1.0},
    }
    assert [t["text"] for t in rows[1]["turns"]] == ["10,2", "20,21", "13,2", "23", "14,14"]
    assert rows[1]["tool_errors"] == {"malformed_json": 1, "timeout": 1}
    assert rows[2] == {
        "group": 0,
        "prompt": "5",
        "response": "10,11",
        "raw_response": "10,2,11",
        "finish_reason": "length",
        "reward": 0.5,
    }
    assert len(decoded) == 3  # the raw responses, the raw prompts, then every turn of every row in one call
    assert trajectory_fields([SINGLE_TURN], decode_batch, [STOP]) == [{}]


VERL_MULTI_TURN_FILE = """
SEEN = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    SEEN.append((solution_str, dict(extra_info)))
    if extra_info.get("num_turns") is None:
        return -1.0
    return extra_info["num_turns"] + sum(extra_info["rollout_reward_scores"].values())
"""


def test_a_verl_reward_file_gets_the_whole_trajectory_num_turns_and_tool_rewards(tmp_path: Path) -> None:
    path = tmp_path / "reward.py"
    path.write_text(VERL_MULTI_TURN_FILE, encoding="utf-8")
    function = load_custom_function(path)
    scorer = _scorer(function)
    extras = [
        {"data_source": "openai/gsm8k", "ground_truth": "7", "extra_info": {"index": 0}},
        {"data_source": "openai/gsm8k", "ground_truth": "9", "extra_info": {"index": 1}},
    ]
    samples = scorer.samples([ONE_CALL, THREE_CALLS, SINGLE_TURN], _joined_without_stop, extras)
    assert function.score(samples).scores == [4 + 1.0, 6.0, -1.0]
    seen = sys.modules[function.function.__module__].SEEN
    assert seen == [
        ("10,11,20,21,22,12", {"index": 0, "num_turns": 4, "rollout_reward_scores": {"calc": 1.0}, "turn_scores": []}),
        ("10,20,21,13,23,14,14", {"index": 1, "num_turns": 6, "rollout_reward_scores": {}, "turn_scores": []}),
        ("10,11", {"index": 0}),  # a single turn's extra_info is the row's
    ]
    assert extras[0]["extra_info"] == {"index": 0}
