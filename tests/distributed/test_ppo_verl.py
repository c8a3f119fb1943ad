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
    run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={out}",
        f"actor.path={model}",
        f"reference.path={model}",
        f"data.train=[{tmp_path / 'train.parquet'}]",
        "data.max_prompt_length=64",
        "max_steps=3",
        "prompts_per_step=4",
        "mini_batch_size=16",
        "samples_per_step=16",
        "scoring.use_reward_model=false",
        "scoring.rules=[]",
        f"scoring.custom_function.path={tmp_path / 'my_reward.py'}",
        "rollout.sampling.max_new_tokens=12",
    )
    metrics, samples = _records(out / "metrics.jsonl"), _records(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # The random policy samples special tokens mid-response: the rows show them in raw_response
    # only, and the function read the response without them (the bytes on either side of a special
    # token may join into one character once it is gone: U+FFFD left out of the comparison).
    raw = [s for s in samples if "raw_response" in s]
    text = lambda t: t.replace("<|im_start|>", "").replace("<|endoftext|>", "").replace("\ufffd", "")  # noqa: E731
    assert raw and all(text(s["raw_response"]) == text(s["response"]) for s in raw)
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
