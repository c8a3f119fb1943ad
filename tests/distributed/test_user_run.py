"""A user's own run, as the issue that found the demo preset in it ran it: verl's parquet, a verl-style
reward function, a chat model, no --config. Its reward is the user's function and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_ppo_verl import _records, _verl_parquet
from tests.helpers import make_chat_tokenizer, make_tiny_hf_model
from tests.launch import run_cli

# verl's default_compute_score shape: data_source first, extra_info and more optional.
DEFAULT_COMPUTE_SCORE = """
def default_compute_score(data_source, solution_str, ground_truth, extra_info=None, sandbox_fusion_url=None,
                          concurrent_semaphore=None, memory_limit_mb=None, **kwargs):
    return sum(ch in solution_str for ch in ground_truth) / len(ground_truth)
"""


@pytest.mark.distributed
def test_a_run_without_config_scores_with_the_users_function_only(tmp_path: Path) -> None:
    model = tmp_path / "model"
    tokenizer_dir = make_chat_tokenizer("qwen2", model)
    from transformers import AutoTokenizer

    # The embedding padded past the tokenizer, as Qwen's (151,936 rows for 151,665 tokens): a random
    # model samples the padded rows' ids, which decode to nothing, and the run counts them.
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    make_tiny_hf_model("qwen2", False, model, vocab_size=vocab + 64, pad_token_id=None)
    _verl_parquet(tmp_path / "train.parquet", 8)
    (tmp_path / "reward.py").write_text(DEFAULT_COMPUTE_SCORE)
    out = tmp_path / "run"
    given = [
        f"actor.path={model}",
        f"data.train=[{tmp_path / 'train.parquet'}]",
        f"scoring.custom_function.path={tmp_path / 'reward.py'}",
        "scoring.custom_function.name=default_compute_score",
        f"output_dir={out}",
        "max_steps=2",
        "prompts_per_step=8",
        "samples_per_step=8",
        "data.max_prompt_length=64",
        "rollout.sampling.max_new_tokens=12",
        "samples_token_ids=true",
    ]
    proc = run_cli("ppo", *given)
    report = proc.stdout.split("settings: library defaults (no --config); ", 1)[1].split("\n\n")[0]
    for item in given:
        assert f"  {item.split('=')[0]} " in report and "command line" in report
    assert "preset" not in report and "lowercase" not in proc.stdout

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    namespace: dict = {}
    exec(DEFAULT_COMPUTE_SCORE, namespace)
    metrics, samples = _records(out / "metrics.jsonl"), _records(out / "samples.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert not [key for key in m if key.startswith("reward/rule")]
        rows = [s for s in samples if s["step"] == m["step"]]
        expected = [namespace["default_compute_score"]("openai/gsm8k", s["response"], "abcde") for s in rows]
        assert len(rows) == 8 and [s["reward"] for s in rows] == pytest.approx(expected, abs=1e-6)
        # The text the function read is transformers' decode of the ids, special tokens skipped (as verl's).
        assert [s["response"] for s in rows] == [
            tokenizer.decode(s["response_ids"], skip_special_tokens=True) for s in rows
        ]
        assert m["reward/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)
        assert m["rollout/tokens_past_vocab"] == sum(i >= vocab for s in rows for i in s["response_ids"])
        assert m["actor/lr"] == pytest.approx(1e-6)  # the library default, not a demo's
    first = next(m for m in metrics if m["rollout/tokens_past_vocab"] > 0)  # 64 of the rows: some are drawn
    assert proc.stdout.count("sampled tokens have ids past the tokenizer's") == 1
    assert f"step {first['step']}: {int(first['rollout/tokens_past_vocab'])} sampled tokens" in proc.stdout

    # generate on the same model says how many of its tokens have no text.
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hello"}\n{"prompt": "world"}\n')
    made = run_cli(
        "generate", f"model={model}", f"input={tmp_path / 'prompts.jsonl'}", f"output={tmp_path / 'out.jsonl'}",
        "rollout.sampling.n=4", "rollout.sampling.max_new_tokens=16", "rollout.sampling.ignore_eos=true",
    )  # fmt: skip
    generated = _records(tmp_path / "out.jsonl")
    past = sum(i >= vocab for row in generated for i in row["token_ids"])
    assert past > 0 and f"; {past} sampled tokens have ids past the tokenizer's {vocab} " in made.stdout
    assert [row["text"] for row in generated] == [
        tokenizer.decode(row["token_ids"], skip_special_tokens=True) for row in generated
    ]


@pytest.mark.distributed
def test_a_base_models_eos_beside_the_templates_turn_end_is_warned_of_and_the_turn_end_can_stop(
    tmp_path: Path,
) -> None:
    """A Qwen2.5 base model: EOS <|endoftext|>, a ChatML template whose turns end with <|im_end|>. A
    prompt rendered with the template was answered past <|im_end|> (into a made-up next turn) without
    a word; now the run says so and which setting ends responses there."""
    import json

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    make_chat_tokenizer("qwen2", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    tokenizer = AutoTokenizer.from_pretrained(model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    make_tiny_hf_model("qwen2", False, model, vocab_size=len(tokenizer), pad_token_id=None)
    (tmp_path / "p.jsonl").write_text('{"prompt": [{"role": "user", "content": "Hello"}]}\n')
    common = [f"model={model}", f"input={tmp_path / 'p.jsonl'}", "rollout.sampling.max_new_tokens=4"]
    warned = run_cli("generate", *common, f"output={tmp_path / 'a.jsonl'}")
    assert f"ends an assistant turn with '<|im_end|>' (id {im_end}), which is not a stop token" in warned.stdout
    assert f"add rollout.sampling.stop_token_ids=[{im_end}] to end responses there" in warned.stdout
    fixed = run_cli(
        "generate", *common, f"output={tmp_path / 'b.jsonl'}", f"rollout.sampling.stop_token_ids=[{im_end}]"
    )
    assert "ends an assistant turn" not in fixed.stdout

    # SFT on conversations teaches it to end turns with <|im_end|>: the export stops there, as
    # Qwen's instruct releases do (generation_config.json's eos_token_id lists both), so the next
    # stage's rollouts and transformers' generate end a reply where the turn ends.
    from transformers import GenerationConfig

    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Bonjour"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    out = tmp_path / "sft"
    trained = run_cli(
        "sft", f"model.path={model}", f"data.train=[{tmp_path / 'chat.jsonl'}]", f"output_dir={out}",
        "global_batch_size=1", "max_steps=1", "save_final=false",
    )  # fmt: skip
    assert f"eos_token_id now also names '<|im_end|>' (id {im_end})" in trained.stdout
    assert set(GenerationConfig.from_pretrained(out / "hf").eos_token_id) == {tokenizer.eos_token_id, im_end}
    after = run_cli("generate", f"model={out / 'hf'}", *common[1:], f"output={tmp_path / 'c.jsonl'}")
    assert "ends an assistant turn" not in after.stdout
