"""The built-in tool task: the trajectory format written out by hand, the teacher's text against
its conversation rendered by the chat template (ours and transformers'), the tokenizer (one token
per fixed string; our ids == transformers' ids), the judge on whole trajectories, and the
built-in data sets and model that carry the task."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.data import load_prompt_dataset, load_sft_dataset, load_tokenizer
from megatron_rlhf.data.chat_template import ChatTemplateError
from megatron_rlhf.data.tokenizer import HFTokenizer
from megatron_rlhf.tasks import arithmetic_tool as tool
from megatron_rlhf.tasks.arithmetic import Problem, judge

CALL_TEXT = (
    ' <tool_call>{"name": "calculator", "arguments": {"expression": "347*128"}}</tool_call></s>'
    "<tool_response>44416</tool_response> #### 44416"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool.write_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"), model_max_length=256)


def test_the_teacher_writes_the_documented_trajectories() -> None:
    problem = Problem(347, "*", 128)
    user = {"role": "user", "content": "347*128"}
    direct = [user, {"role": "assistant", "content": "347*128 #### 44416"}]
    assert tool.sft_rows([problem], tool_rate=0.0, seed=0) == [{"messages": direct}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347*128"}}}
    assert tool.teacher_messages(problem, tool_rate=1.0, seed=0) == [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "44416"},
        {"role": "assistant", "content": "#### 44416"},
    ]
    assert tool.prompt_rows([problem]) == [{"prompt": [{"role": "user", "content": "347*128"}], "answer": "44416"}]
    with pytest.raises(ValueError, match=r"tool_rate=1.5: expected a probability in \[0, 1\]"):
        tool.calls_tool(problem, 1.5, seed=0)


def test_the_teacher_calls_the_tool_on_its_share_of_problems() -> None:
    problems = tool.problems("train", 2000)
    calls = [tool.calls_tool(p, 0.3, seed=0) for p in problems]
    assert calls == [tool.calls_tool(p, 0.3, seed=0) for p in problems]  # a function of (seed, problem)
    assert 0.27 < sum(calls) / len(calls) < 0.33
    assert calls != [tool.calls_tool(p, 0.3, seed=1) for p in problems]


def test_the_chat_template_renders_the_teachers_text(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert isinstance(ours, HFTokenizer) and ours.chat_template is not None
    texts = {
        True: "Q: 347*128=? A:" + CALL_TEXT + "</s>",
        False: "Q: 347*128=? A: 347*128 #### 44416</s>",
    }
    for tool_rate in (1.0, 0.0):
        messages = tool.teacher_messages(Problem(347, "*", 128), tool_rate, seed=0)
        assert ours.chat_template.render(messages, None, {}) == texts[tool_rate == 1.0]
        assert theirs.apply_chat_template(messages, tokenize=False) == texts[tool_rate == 1.0]
    for problem in tool.problems("validation", 40):
        messages = tool.teacher_messages(problem, 0.5, seed=0)
        assert ours.chat_template.render(messages, None, {}) == theirs.apply_chat_template(messages, tokenize=False)
    # A tool message alone: exactly what the engine appends after a call (no BOS, no generation prompt).
    assert ours.chat_template.render([{"role": "tool", "content": "7"}], None, {}) == "<tool_response>7</tool_response>"
    with pytest.raises(ChatTemplateError, match="user, assistant and tool messages, not system"):
        ours.chat_template.render([{"role": "system", "content": "hi"}], None, {})


def test_the_tokenizer_spells_each_fixed_string_as_one_token(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert ours.vocab_size == tool.TOKENIZER_VOCAB_SIZE == 108
    assert (ours.pad_id, ours.bos_id, ours.eos_id, ours.stop_ids) == (0, 1, 2, (2,))
    ids = ours.encode("Q: 347*128=? A:" + CALL_TEXT)
    # Q: 3 4 7 * 1 2 8 =?A: | ' ' <tool_call> prefix 3 4 7 * 1 2 8 suffix </tool_call> </s> |
    # <tool_response> 4 4 4 1 6 </tool_response> | ' #### ' 4 4 4 1 6
    assert len(ids) == 9 + 13 + 7 + 6
    assert [ours.decode([i]) for i in ids[8:12]] == ["=? A:", " ", "<tool_call>", tool.CALL_PREFIX]
    assert ids == theirs("Q: 347*128=? A:" + CALL_TEXT, add_special_tokens=False).input_ids
    assert ours.decode(ids) == "Q: 347*128=? A:" + CALL_TEXT
    assert ours.encode("é") == [3]  # unknown characters are <unk>, not an error


def test_the_judge_reads_whole_trajectories(tokenizer_dir: Path) -> None:
    """The response's text as the trainers decode it (special tokens skipped) is well formed for
    ``arithmetic.judge``: the rule reward scores the task unchanged."""
    tok = load_tokenizer(tokenizer_dir)

    def text(response: str) -> str:
        return tok.decode(tok.encode(response), skip_special_tokens=True)

    assert judge(text(CALL_TEXT), 44416) == "right"
    assert judge(text(CALL_TEXT.replace("#### 44416", "#### 44461")), 44416) == "wrong"
    assert judge(text(CALL_TEXT.replace(" #### ", " ")), 44416) == "malformed"
    assert judge(text(" 347*128 #### 44416"), 44416) == "right"
    assert judge(text(CALL_TEXT.split("</s>")[0]), 44416) == "malformed"  # a call alone answers nothing


def test_builtin_tool_sets_and_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.checkpoint.sources import architecture_of
    from megatron_rlhf.data.builtin import resolve_data_paths
    from megatron_rlhf.data.records import read_records
    from megatron_rlhf.data.tokenizer import resolve_tokenizer
    from megatron_rlhf.models.builtin import builtin_checkpoint

    monkeypatch.setenv("MEGATRON_RLHF_CACHE", str(tmp_path))
    name = "builtin:arith-tool-llama"
    arch = architecture_of(name)
    tok = resolve_tokenizer(builtin_checkpoint(name), arch, name)
    assert tok.vocab_size == arch.vocab_size == tool.TOKENIZER_VOCAB_SIZE
    names = ["arithmetic-tool-sft", "arithmetic-tool-prompts", "arithmetic-tool-validation", "arithmetic-tool-test"]
    paths = resolve_data_paths([f"builtin:{n}" for n in names])
    rows = {n: [r.data for r in read_records(p)] for n, p in zip(names, paths, strict=True)}
    test = {r["prompt"][0]["content"] for r in rows["arithmetic-tool-test"]}
    assert len(test) == 500 and not test & {r["prompt"][0]["content"] for r in rows["arithmetic-tool-prompts"]}
    sft_rows = rows["arithmetic-tool-sft"]
    calls = sum(len(r["messages"]) == 4 for r in sft_rows) / len(sft_rows)
    assert 0.28 < calls < 0.32
    # A chat prompt, rendered by the template, is the SFT row's prompt: the policy sees in RL what it saw in SFT.
    prompts, _ = load_prompt_dataset([paths[1]], tok, max_length=16)
    sft, _ = load_sft_dataset([paths[0]], tok, max_length=48)
    example = sft[0]
    prompt_len = int(example.loss_mask.int().argmax())  # the first trained token
    assert prompts[0].prompt_ids.tolist() == example.input_ids[:prompt_len].tolist()
