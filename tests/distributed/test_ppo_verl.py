"""``megatron-rlhf ppo`` on verl's data and reward code, and DAPO's dynamic sampling (CPU mode,
the CLI as a user runs it, files on disk).

References: verl's parquet shape (examples/data_preprocess/gsm8k.py: data_source, prompt as chat
messages, ability, reward_model{ground_truth, style}, extra_info), a verl ``compute_score`` file
re-run on the responses in samples.jsonl, and each group's rewards read back from samples.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed.test_ppo import _check_keys
from tests.helpers import make_chat_tokenizer, make_tiny_hf_model
from tests.launch import run_cli

COMPUTE_SCORE = '''
import numpy as np


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: the share of the ground-truth's characters found in the response, decoded
    as verl decodes it (no special tokens)."""
    assert data_source == "openai/gsm8k" and isinstance(extra_info, dict) and "index" in extra_info
    assert not any(special in solution_str for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    hits = sum(ch in solution_str for ch in ground_truth) / len(ground_truth)
    return {"score": np.float32(hits), "length": len(solution_str)}
'''


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _verl_parquet(path: Path, rows: int) -> None:
    """Rows shaped as verl's gsm8k preprocessing writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "data_source": ["openai/gsm8k"] * rows,
            "prompt": [
                [{"role": "user", "content": f"What is {i} plus {i + 1}? Let's think step by step."}]
                for i in range(rows)
            ],
            "ability": ["math"] * rows,
            "reward_model": [{"ground_truth": "abcde", "style": "rule"} for _ in range(rows)],
            "extra_info": [
                {"split": "train", "index": i, "answer": str(2 * i + 1), "question": f"{i}+{i + 1}"}
                for i in range(rows)
            ],
        }
    )
    pq.write_table(table, path)


def _verl_run(out: Path, model: Path, train: Path, reward: Path, steps: int) -> list[str]:
    """``megatron-rlhf ppo`` on a tiny model, verl-format prompts and a verl reward file: 4 prompts
    x 4 samples a step (later arguments override these)."""
    return [
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={out}",
        f"actor.path={model}",
        f"reference.path={model}",
        f"data.train=[{train}]",
        "data.max_prompt_length=64",
        f"max_steps={steps}",
        "prompts_per_step=4",
        "mini_batch_size=16",
        "samples_per_step=16",
        "scoring.use_reward_model=false",
        "scoring.rules=[]",
        f"scoring.custom_function.path={reward}",
        "rollout.sampling.max_new_tokens=12",
    ]


@pytest.mark.distributed
def test_verl_parquet_and_compute_score_file_run_unchanged(tmp_path: Path) -> None:
    model = tmp_path / "model"
    tokenizer_dir = make_chat_tokenizer("qwen2", model)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    make_tiny_hf_model("qwen2", False, model, vocab_size=vocab, pad_token_id=None)
    _verl_parquet(tmp_path / "train.parquet", 16)
    (tmp_path / "my_reward.py").write_text(COMPUTE_SCORE)
    out = tmp_path / "run"
    run_cli(*_verl_run(out, model, tmp_path / "train.parquet", tmp_path / "my_reward.py", steps=3))
    metrics, samples = _records(out / "metrics.jsonl"), _records(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The random policy samples special tokens mid-response: the rows show them in raw_response
    # only, and the function read the response without them (the bytes on either side of a special
    # token may join into one character once it is gone: U+FFFD left out of the comparison).
    raw = [s for s in samples if "raw_response" in s]
    text = lambda t: t.replace("<|im_start|>", "").replace("<|endoftext|>", "").replace("\ufffd", "")  # noqa: E731
    assert raw and all(text(s["raw_response"]) == text(s["response"]) for s in raw)
    # The prompt as the model read it: the chat template's tokens, which the reward functions' text drops.
    no_specials = lambda t: text(t).replace("<|im_end|>", "")  # noqa: E731
    assert all(s["raw_prompt"].startswith("<|im_start|>") for s in samples)
    assert all(no_specials(s["raw_prompt"]) == s["prompt"] for s in samples)
    _check_keys(metrics)
    namespace: dict = {}
    exec(COMPUTE_SCORE, namespace)
    for m in metrics:
        rows = [s for s in samples if s["step"] == m["step"]]
        assert len(rows) == 16
        recomputed = [
            float(namespace["compute_score"]("openai/gsm8k", s["response"], "abcde", {"index": 0})["score"])
            for s in rows
        ]
        assert [s["reward"] for s in rows] == pytest.approx(recomputed, abs=1e-6)
        assert m["reward/mean"] == pytest.approx(sum(recomputed) / len(recomputed), abs=1e-6)
        assert m["reward/custom_function"] == pytest.approx(m["reward/mean"], abs=1e-6)
        assert m["reward/custom/length"] == pytest.approx(sum(len(s["response"]) for s in rows) / 16, abs=1e-4)


TURN_SCORES_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(extra_info["turn_scores"])
"""


@pytest.mark.distributed
def test_an_interaction_replies_within_trajectories_and_its_scores_reach_the_reward(tmp_path: Path) -> None:
    """verl's interaction setup run as is: the prompts' extra_info.interaction_kwargs pick the
    interaction of an interaction_config_path file; a reward function reads its turn_scores."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = tmp_path / "model"
    tokenizer_dir = make_chat_tokenizer("qwen25_tools", model)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    make_tiny_hf_model("qwen2", False, model, vocab_size=vocab, pad_token_id=None)
    rows = 8
    pq.write_table(
        pa.table(
            {
                "data_source": ["toy"] * rows,
                "prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(rows)],
                "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(rows)],
                "extra_info": [
                    {"index": i, "interaction_kwargs": {"name": "retry", "question": f"count to {i}"}}
                    for i in range(rows)
                ],
            }
        ),
        tmp_path / "train.parquet",
    )
    (tmp_path / "interaction_config.yaml").write_text(
        "interaction:\n  - name: retry\n    class_name: tests.distributed.interaction_fixtures.RetryOnce\n"
    )
    (tmp_path / "reward.py").write_text(TURN_SCORES_REWARD)
    out = tmp_path / "run"
    stops = ",".join(str(i) for i in range(0, vocab, 4))  # a quarter of the vocabulary ends a turn
    run_cli(
        *_verl_run(out, model, tmp_path / "train.parquet", tmp_path / "reward.py", steps=2),
        "rollout.sampling.max_new_tokens=64",
        "rollout.engine.max_seq_len=160",
        f"rollout.engine.eos_token_ids=[{stops}]",
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.interaction_config_path={tmp_path / 'interaction_config.yaml'}",
    )
    metrics, samples = _records(out / "metrics.jsonl"), _records(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    _check_keys(metrics)
    ended = [s for s in samples if s.get("turn_scores") == [0.0, 0.5]]
    assert ended, [s.get("turn_scores") for s in samples]  # asked again once, then ended
    for s in samples:
        assert s["reward"] == pytest.approx(sum(s.get("turn_scores", [])))
        roles = [t["role"] for t in s["turns"]]
        assert "tool" not in roles and roles.count("user") == s.get("user_turns", 0)
    for s in ended:
        assert s["turns"][1]["role"] == "user" and "Try again: count to" in s["turns"][1]["text"]
    assert all(m["multi_turn/user_turns/mean"] > 0 for m in metrics)


@pytest.mark.distributed
def test_dynamic_sampling_keeps_only_groups_with_signal_and_fills_the_batch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={out}",
        "max_steps=3",
        "samples_per_step=32",
        "rollout.filter_groups=true",
        "rollout.max_sample_batches=0",
        "scoring.rules=[tests.distributed.reward_fixtures:half_uniform]",
    )
    metrics, samples = _records(out / "metrics.jsonl"), _records(out / "samples.jsonl")
    _check_keys(metrics)
    assert all(m["rollout/groups_short"] == 0 for m in metrics)
    assert max(m["rollout/sample_batches"] for m in metrics) >= 2  # about half the groups were dropped
    assert all(0.2 < m["rollout/uniform_group_fraction"] < 0.8 for m in metrics)
    for step in (1, 2, 3):
        rows = [s for s in samples if s["step"] == step]
        groups: dict[int, list[float]] = {}
        for s in rows:
            groups.setdefault(s["group"], []).append(s["reward"])
        assert sorted(groups) == list(range(8)) and all(len(r) == 4 for r in groups.values())  # the batch is full
        assert all(max(r) > min(r) for r in groups.values()), groups  # no zero-variance group
        assert not any(math.isclose(r[0], 0.5) and len(set(r)) == 1 for r in groups.values())
