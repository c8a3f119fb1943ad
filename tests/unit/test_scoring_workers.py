"""Rules and a reward function in worker processes (``scoring.workers``): the same scores, parts
and metrics as on the scorer's thread (the reference), the same error messages, and a worker that
overruns the timeout, hangs past a stop request, dies or gets a Ctrl-C meant for the trainer."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_rlhf.rewards import RewardFunctionError, ScoringInterrupted

RULES = """
import os
import time


def vowels(sample):
    text = sample.response_text
    return sum(c in "aeiou" for c in text) / max(len(text), 1)


def fails(sample):
    if sample.response_text.startswith("b"):
        raise ValueError("no answer in the response")
    return 1.0


def hangs(sample):
    if sample.response_text.startswith("b"):
        time.sleep(60)
    return 1.0


def exits(sample):
    if sample.response_text.startswith("b"):
        os._exit(3)
    return 1.0


def slow(sample):
    time.sleep(0.2)
    return float(len(sample.response_text))
"""

FUNCTION = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = ground_truth in solution_str
    turns = extra_info.get("num_turns", 0) + sum(extra_info.get("rollout_reward_scores", {}).values())
    return {"score": 1.0 if hit else 0.0, "length": len(solution_str), "index": extra_info["index"], "turns": turns}
"""

RESPONSES = ["apple pie", "banana", "cherry tart", "damson", "elderberry wine", "fig", "grape"]


@pytest.fixture
def reward_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``worker_rules`` importable (a spawned worker gets the trainer's sys.path), and a function file."""
    (tmp_path / "worker_rules.py").write_text(RULES)
    (tmp_path / "reward_fn.py").write_text(FUNCTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "worker_rules", raising=False)  # this test's copy, on the thread too
    return tmp_path / "reward_fn.py"


def _trajectory(i: int) -> dict:
    """A multi-turn record (``TrajectoryRecord``) whose turns and tool reward the function reads."""
    return {
        "num_turns": 2 + i,
        "policy_turns": 1,
        "user_turns": 0,
        "turn_scores": [],
        "interaction_errors": 0,
        "interaction_failure": "",
        "tool_calls": 1,
        "tool_errors": {},
        "tool_seconds": 0.0,
        "tool_rewards": {"calculator": 0.5 * i},
        "tool_call_rewards": [],
        "messages": [],
    }


def _rollout():
    from megatron_rlhf.data.tokenizer import ByteTokenizer
    from megatron_rlhf.rollout.engine import Completion

    tokenizer = ByteTokenizer(300)
    completions = [
        Completion(
            prompt_index=i // 2,
            sample_index=i % 2,
            prompt_ids=tokenizer.encode(f"fruit {i // 2}?"),
            token_ids=[*tokenizer.encode(text), tokenizer.EOS],
            logprobs=[0.0] * (len(text) + 1),
            finish_reason="stop",
            trajectory=_trajectory(i) if i % 2 else None,  # multi-turn records travel to the workers too
        )
        for i, text in enumerate(RESPONSES)
    ]
    extras = [
        {"data_source": "fruit", "ground_truth": "e", "extra_info": {"index": prompt}}
        for prompt in range(len(RESPONSES) // 2 + 1)
    ]
    return tokenizer, completions, extras


def _scorer(workers: int, rules: list[str], function: Path | None = None, timeout_s: float = 60.0, interrupted=None):
    from megatron_rlhf.rewards.config import CustomFunctionConfig, ScoringConfig, scoring_errors
    from megatron_rlhf.rewards.samples import reward_texts
    from megatron_rlhf.rewards.scoring import Scorer

    tokenizer, _, _ = _rollout()
    custom = CustomFunctionConfig(path=str(function) if function else "")
    cfg = ScoringConfig(rules=rules, custom_function=custom, timeout_s=timeout_s, workers=workers)
    errors, loaded, loaded_function = scoring_errors(cfg)
    assert not errors
    return Scorer(
        cfg,
        loaded,
        loaded_function,
        None,
        stop_ids=tokenizer.stop_ids,
        max_new_tokens=32,
        max_tokens_per_micro_batch=256,
        interrupted=interrupted,
        texts=reward_texts(tokenizer),
    )


def _start(scorer):
    from megatron_rlhf.rewards.samples import reward_texts
    from megatron_rlhf.trainer.ppo import rollout_batch

    tokenizer, completions, extras = _rollout()
    return scorer.start(rollout_batch(completions, tokenizer.pad_id), completions, extras, reward_texts(tokenizer))


def _error_of(scorer) -> str:
    try:
        with pytest.raises(RewardFunctionError) as info:
            _start(scorer).result()
        return str(info.value)
    finally:
        scorer.close()


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_score_every_part_and_metric_as_the_thread_does(world_of_one, reward_code: Path, workers: int) -> None:
    rules = ["lowercase_fraction", "worker_rules:vowels"]
    on_thread = _start(_scorer(0, rules, reward_code)).result()
    scorer = _scorer(workers, rules, reward_code)
    try:
        assert scorer.workers is not None
        in_workers = _start(scorer).result()
    finally:
        scorer.close()
    assert set(in_workers.parts) == {*rules, "custom_function"}
    for name, column in on_thread.parts.items():
        assert in_workers.parts[name].tolist() == column.tolist(), name
    assert in_workers.raw.tolist() == on_thread.raw.tolist()
    assert in_workers.custom_metrics == on_thread.custom_metrics
    # hand-derived: "apple pie" has 4 vowels of 9 characters; 4 of the 7 responses contain an "e"
    assert in_workers.parts["worker_rules:vowels"][0].item() == pytest.approx(4 / 9)
    assert in_workers.parts["custom_function"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    # rows 1, 3, 5 carry a trajectory: turns 2 + i plus the tool's reward 0.5 i; the others 0
    assert in_workers.custom_metrics["turns"] == pytest.approx((3.5 + 6.5 + 9.5) / 7)


def test_a_rule_that_raises_in_a_worker_fails_with_the_threads_message(world_of_one, reward_code: Path) -> None:
    on_thread, in_worker = (_error_of(_scorer(workers, ["worker_rules:fails"])) for workers in (0, 2))
    assert in_worker == on_thread
    assert in_worker.startswith(
        f"reward rule 'worker_rules:fails' ({reward_code.parent / 'worker_rules.py'}) on sample 1"
    )
    assert in_worker.rstrip().endswith("ValueError: no answer in the response")


def test_a_call_past_the_timeout_in_a_worker_names_the_line_it_is_at(world_of_one, reward_code: Path) -> None:
    start = time.monotonic()
    message = _error_of(_scorer(2, ["worker_rules:hangs"], timeout_s=0.5))
    assert time.monotonic() - start < 30  # the worker's start-up (imports) and the 0.5 s
    assert re.search(
        r"on sample 1 \(data_source 'fruit', response 'banana'\) has run 0\.\d s, longer than scoring.timeout_s=0.5",
        message,
    )
    assert ", in hangs\n    time.sleep(60)\n" in message


def test_a_stop_request_ends_the_wait_on_a_hung_worker_and_the_workers(world_of_one, reward_code: Path) -> None:
    stop = threading.Event()
    scorer = _scorer(2, ["worker_rules:hangs"], timeout_s=0.0, interrupted=stop.is_set)
    pending = _start(scorer)
    threading.Timer(0.5, stop.set).start()
    start = time.monotonic()
    with pytest.raises(ScoringInterrupted, match=r"a stop was requested while reward code ran on rank\(s\) \[0\]"):
        pending.result()
    assert time.monotonic() - start < 10
    assert scorer.workers is not None and not any(p.is_alive() for p in scorer.workers.processes)
    with pytest.raises(
        RuntimeError, match=r"the scoring workers were stopped \(scoring ended with ScoringInterrupted\)"
    ):
        _start(scorer)


def test_a_worker_that_dies_is_an_error_naming_it_and_its_rows(world_of_one, reward_code: Path) -> None:
    message = _error_of(_scorer(2, ["worker_rules:exits"]))  # 7 samples: rows 0-2 to worker 0, 3-6 to 1
    assert re.fullmatch(
        r"scoring worker scoring-0 \(pid \d+\) ended with exit code 3 while scoring rows 0\.\.2 of the rollout "
        r"\(reward code that ends its process, or a crash in a library it calls\)",
        message,
    )


def test_a_ctrl_c_meant_for_the_trainer_does_not_reach_reward_code_in_a_worker(world_of_one, reward_code: Path) -> None:
    """The terminal's SIGINT goes to every process of the job: the workers ignore it from their
    start (the trainer's own handler decides what a stop is), so a rule runs on and its scores arrive.
    Twice: first while the workers may still be importing, then while the rule runs."""
    scorer = _scorer(2, ["worker_rules:slow"])
    expected = [float(len(text)) for text in RESPONSES]
    try:
        assert scorer.workers is not None
        for wait_s in (0.0, 0.3):
            pending = _start(scorer)
            time.sleep(wait_s)
            for process in scorer.workers.processes:
                assert process.pid is not None
                os.kill(process.pid, signal.SIGINT)
            assert pending.result().parts["worker_rules:slow"].tolist() == expected
    finally:
        scorer.close()


def test_reward_code_that_does_not_load_in_a_worker_fails_before_the_first_step(
    world_of_one, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule module made in the trainer's memory loads there but not in a fresh process: the
    workers say so when the run waits for them at set-up, naming the setting."""
    import types

    module = types.ModuleType("made_in_memory")
    module.rule = lambda sample: 1.0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "made_in_memory", module)
    scorer = _scorer(2, ["made_in_memory:rule"])
    assert scorer.workers is not None
    with pytest.raises(RewardFunctionError, match=r"^a scoring worker could not load the reward code: scoring.rules: "):
        scorer.workers.wait_ready()
    assert not any(p.is_alive() for p in scorer.workers.processes)


def test_workers_must_be_zero_or_more() -> None:
    from megatron_rlhf.rewards.config import ScoringConfig

    assert ScoringConfig(workers=-1).errors() == ["workers=-1 must be >= 0"]
    assert ScoringConfig().workers == 0
