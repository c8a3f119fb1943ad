"""SFT and preference data on conversations. An SFT conversation (``data.messages_key``) is the sequence
a multi-turn rollout of it builds (``ToolAgent``, driven by hand as the engine drives it), its text is
transformers' ``apply_chat_template`` of it, and the loss covers exactly the tokens the policy sampled
there. Hand-written masks for the built-in tool task's template and for a template with no stop token;
conversational preference pairs end where the reward model scores a rollout; every bad row names its
file, row and column."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from megatron_rlhf.agent.builtin_tools import Calculator
from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.agent.loop import ToolAgent
from megatron_rlhf.data import DataError, load_preference_dataset, load_sft_dataset, load_tokenizer
from megatron_rlhf.data.tokenizer import HFTokenizer
from megatron_rlhf.tasks import arithmetic_tool as tool
from megatron_rlhf.tasks.arithmetic import Problem

CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}},
}
USER = {"role": "user", "content": "What is 123 * 4567?"}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 4567"}}\n</tool_call>'
ANSWER = "123 * 4567 = 561741."
CONVERSATION = [
    USER,
    {"role": "assistant", "content": "Let me compute.\n" + CALL},
    {"role": "tool", "content": "561741"},
    {"role": "assistant", "content": ANSWER},
]


@pytest.fixture
def model_dir(tool_chat_dir: Path) -> Path:
    return tool_chat_dir


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def with_template(model_dir: Path, out: Path, template: str) -> Path:
    """A copy of ``model_dir``'s tokenizer in ``out`` with the chat template ``template``."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


def load(path: Path, model_dir: Path, **kwargs: Any) -> list[tuple[list[int], list[int]]]:
    dataset, report = load_sft_dataset(path, load_tokenizer(model_dir), max_length=4096, **kwargs)
    assert report.kept == len(dataset)
    return [(ex.input_ids.tolist(), ex.loss_mask.int().tolist()) for ex in dataset]


def test_a_conversation_is_the_rollout_of_it_and_trains_on_the_policy_tokens(model_dir, tmp_path) -> None:
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(model_dir)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.chat_template is not None
    # The rollout: the prompt, a policy turn that calls the calculator, the environment's tokens, a final turn.
    agent_cfg = MultiTurnConfig(max_assistant_turns=3)
    with ToolAgent(agent_cfg, tokenizer, {"calculator": Calculator({}, CALCULATOR)}, [{}]) as agent:
        episode = agent.episode(0, 1)
        first, second = (tokenizer.encode(m["content"] + "<|im_end|>") for m in CONVERSATION[1::2])
        future = episode.after_turn(first)
        assert future is not None
        environment = future.result(timeout=10).token_ids
        assert episode.after_turn(second) is None
        episode.close()
    prompt = tokenizer.encode(tokenizer.chat_template.render([USER], tools=[CALCULATOR]))
    after_stop = tokenizer.encode("\n")  # the template's newline after the last <|im_end|>

    rows = [{"messages": CONVERSATION, "tools": [CALCULATOR]}]
    [(ids, mask)] = load(write_jsonl(tmp_path / "chat.jsonl", rows), model_dir)
    assert ids == prompt + first + environment + second + after_stop
    assert mask == [0] * len(prompt) + [1] * len(first) + [0] * len(environment) + [1] * len(second) + [0]
    reference = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        CONVERSATION, tools=[CALCULATOR], tokenize=False
    )
    assert tokenizer.decode(ids) == reference
    # The tools may come from the loader (a tools file) instead of the row.
    [(from_file, _)] = load(
        write_jsonl(tmp_path / "plain.jsonl", [{"messages": CONVERSATION}]), model_dir, tools=[CALCULATOR]
    )
    assert from_file == ids


def test_the_tool_tasks_teacher_is_trained_on_its_own_turns_only(tmp_path) -> None:
    model_dir = tool.write_tokenizer(tmp_path / "tok", model_max_length=256)
    tokenizer = load_tokenizer(model_dir)
    problem = Problem(347, "*", 128)
    rows = [{"messages": tool.teacher_messages(problem, tool_rate, seed=0)} for tool_rate in (1.0, 0.0)]
    (call_ids, call_mask), (direct_ids, direct_mask) = load(write_jsonl(tmp_path / "t.jsonl", rows), model_dir)

    def trained(ids: list[int], mask: list[int]) -> list[str]:
        """The trained spans' texts, in order."""
        spans, current = [], []
        for token, keep in zip(ids, mask, strict=True):
            if keep:
                current.append(token)
            elif current:
                spans, current = [*spans, tokenizer.decode(current)], []
        return spans + ([tokenizer.decode(current)] if current else [])

    assert tokenizer.decode(call_ids) == (
        'Q: 347*128=? A: <tool_call>{"name": "calculator", "arguments": {"expression": "347*128"}}</tool_call></s>'
        "<tool_response>44416</tool_response> #### 44416</s>"
    )
    assert trained(call_ids, call_mask) == [
        ' <tool_call>{"name": "calculator", "arguments": {"expression": "347*128"}}</tool_call></s>',
        " #### 44416</s>",
    ]
    assert tokenizer.decode([t for t, m in zip(call_ids, call_mask, strict=True) if not m]) == (
        "Q: 347*128=? A:<tool_response>44416</tool_response>"
    )
    assert trained(direct_ids, direct_mask) == [" 347*128 #### 44416</s>"]


def test_a_template_without_a_stop_token_ends_the_last_message_with_eos(model_dir, tmp_path) -> None:
    plain = with_template(
        model_dir,
        tmp_path / "plain",
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}",
    )
    tokenizer = load_tokenizer(plain)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    [(ids, mask)] = load(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), plain)
    pieces = [("user: hi\nassistant: ", 0), ("hello\n", 1), ("user: bye\nassistant: ", 0), ("ciao\n", 1)]
    expected = [(t, m) for text, m in pieces for t in tokenizer.encode(text)] + [(tokenizer.eos_id, 1)]
    assert list(zip(ids, mask, strict=True)) == expected
    # append_eos=False: no EOS, the last message as the template writes it.
    [(ids, _)] = load(tmp_path / "c.jsonl", plain, append_eos=False)
    assert ids == [t for t, _ in expected[:-1]]


CHATML_WITH_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_base_models_eos_beside_the_templates_turn_end_trains_what_transformers_masks(tmp_path) -> None:
    """A Qwen2.5 base model: EOS <|endoftext|>, a ChatML template ending turns with <|im_end|>. The
    turn's end was looked for among the stop ids only: the markup after each turn was trained, and an
    <|endoftext|> the template never writes was added and trained. Now the loss covers what
    transformers' assistant mask covers (the template's {% generation %} blocks), on its ids."""
    from transformers import AutoTokenizer

    from megatron_rlhf.data.tokenizer import template_turn_end
    from tests.helpers import make_chat_tokenizer

    base = make_chat_tokenizer("qwen2", tmp_path / "base")
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    (base / "chat_template.jinja").write_text(CHATML_WITH_GENERATION)
    tokenizer = load_tokenizer(base)
    reference = AutoTokenizer.from_pretrained(base)
    im_end, endoftext = reference.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.stop_ids == (endoftext,) and template_turn_end(tokenizer) == im_end
    messages = [
        {"role": "user", "content": "What is two plus three?"},
        {"role": "assistant", "content": "It is five."},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "très bien merci"},
    ]
    [(ids, mask)] = load(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), base)
    expected = reference.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == expected["input_ids"] and mask == expected["assistant_masks"]
    assert (
        reference.decode([t for t, m in zip(ids, mask, strict=True) if m])
        == "It is five.<|im_end|>très bien merci<|im_end|>"
    )


def test_sharegpt_roles_under_a_template_that_writes_any_role_are_named(model_dir, tmp_path) -> None:
    """A template that writes every role by its name took ShareGPT's human and gpt messages and
    reported only that there was no assistant message."""
    plain = with_template(
        model_dir, tmp_path / "plain", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    row = {"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}
    with pytest.raises(DataError) as err:
        load_sft_dataset(write_jsonl(tmp_path / "s.jsonl", [row]), load_tokenizer(plain), max_length=64)
    assert "has no assistant message: nothing to train on; its roles are ['gpt', 'human'] (ShareGPT's human and " in (
        str(err.value)
    )


def test_conversation_and_prompt_response_rows_mix(model_dir, tmp_path) -> None:
    tokenizer = load_tokenizer(model_dir)
    rows = [
        {"prompt": "Say hi.", "response": "hi"},
        {"messages": CONVERSATION[:2], "prompt": None},
        {"messages": None, "prompt": [USER], "response": "It is 561741."},
    ]
    (text_ids, text_mask), (chat_ids, chat_mask), (prompt_ids, prompt_mask) = load(
        write_jsonl(tmp_path / "mixed.jsonl", rows), model_dir
    )
    assert text_ids == tokenizer.encode("Say hi.") + tokenizer.encode("hi") + [tokenizer.eos_id]
    assert sum(text_mask) == len(tokenizer.encode("hi")) + 1
    assert tokenizer.decode([t for t, m in zip(chat_ids, chat_mask, strict=True) if m]) == (
        CONVERSATION[1]["content"] + "<|im_end|>"
    )
    rendered = tokenizer.encode(tokenizer.chat_template.render([USER]))
    assert prompt_ids == rendered + tokenizer.encode("It is 561741.") + [tokenizer.eos_id]
    assert prompt_mask == [0] * len(rendered) + [1] * (len(prompt_ids) - len(rendered))
    # messages_key="" reads no conversation column: the row without a prompt is then an error.
    with pytest.raises(DataError, match=r"line 1: column 'prompt' is missing \(nor pre-tokenized 'prompt_ids'\)"):
        load(write_jsonl(tmp_path / "only_chat.jsonl", [{"messages": CONVERSATION}]), model_dir, messages_key="")


HISTORY_REWRITER = (  # writes only the last two messages: earlier turns vanish once more follow
    "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BAD_ROWS = [
    ({"messages": "hello"}, "wrong_type", "must be a list of {role, content} messages, got str"),
    ({"messages": []}, "empty", "is an empty list of messages"),
    ({"messages": [{"content": "x"}]}, "wrong_type", "message 0 must be an object with a string 'role'"),
    ({"messages": [USER]}, "empty", "has no assistant message: nothing to train on"),
    ({"messages": None}, "empty", "is null"),
    (  # before: trained, teaching an empty answer
        {"messages": [USER, {"role": "assistant", "content": "  \n"}]},
        "empty",
        "message 1 is an assistant message with no content and no tool call",
    ),
    (
        {"messages": [{"role": "assistant", "content": "Hello!"}, USER, {"role": "assistant", "content": "7"}]},
        "wrong_type",
        "opens with an assistant message: an answer needs a system or user message before it",
    ),
]


@pytest.mark.parametrize("row,reason,detail", BAD_ROWS)
def test_bad_conversations_error_naming_the_row_or_are_skipped(row, reason, detail, model_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION}, row])
    with pytest.raises(DataError, match=re.escape(f"{path}: line 2: column 'messages'")) as err:
        load_sft_dataset(path, load_tokenizer(model_dir), max_length=4096)
    assert detail in str(err.value) and "data.on_invalid=skip" in str(err.value)
    dataset, report = load_sft_dataset(path, load_tokenizer(model_dir), max_length=4096, on_invalid="skip")
    assert len(dataset) == 1 and report.skipped == {reason: 1}


def test_bad_settings_and_templates_are_named(model_dir, tmp_path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(
        DataError, match=r"column 'messages' holds chat messages but data\.apply_chat_template is false"
    ):
        load_sft_dataset(path, load_tokenizer(model_dir), max_length=4096, apply_chat_template=False)
    with pytest.raises(DataError, match=r"gives \d+ tokens \(a conversation of 4 messages\) > data\.max_length=8"):
        load_sft_dataset(path, load_tokenizer(model_dir), max_length=8)
    rewriter = with_template(model_dir, tmp_path / "rewriter", HISTORY_REWRITER)
    with pytest.raises(
        DataError, match=r"writes the conversation before message 3 \(an assistant message\) differently"
    ):
        load_sft_dataset(path, load_tokenizer(rewriter), max_length=4096)
    with pytest.raises(
        DataError,
        match=r"none\.jsonl: line 1: column 'prompt' is missing .*, nor is there a conversation in 'messages'; "
        r"columns present: \['text",
    ):
        load_sft_dataset(
            write_jsonl(tmp_path / "none.jsonl", [{"text": "x"}]), load_tokenizer(model_dir), max_length=64
        )


def test_worker_processes_read_conversations_alike(model_dir, tmp_path) -> None:
    rows = [{"messages": CONVERSATION, "tools": [CALCULATOR]}, {"prompt": "Say hi.", "response": "hi"}] * 3
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert load(path, model_dir, num_workers=2) == load(path, model_dir)


def load_pairs(path: Path, model_dir: Path, **kwargs: Any) -> list[tuple[tuple[list[int], list[int]], ...]]:
    dataset, report = load_preference_dataset(path, load_tokenizer(model_dir), max_length=4096, **kwargs)
    assert report.kept == len(dataset)
    sides = lambda ex: tuple((s.input_ids.tolist(), s.loss_mask.int().tolist()) for s in (ex.chosen, ex.rejected))  # noqa: E731
    return [sides(ex) for ex in dataset]


def test_preference_conversations_end_where_the_reward_model_scores_a_rollout(model_dir, tmp_path) -> None:
    """TRL's conversational preference rows, with the prompt inside each side or in its own column:
    each side is the prompt as a rollout starts from it, then the assistant's answer through its stop
    token, nothing after it (the reward model scores the last token)."""
    tokenizer = load_tokenizer(model_dir)
    user = [{"role": "user", "content": "Name a prime."}]
    good, bad = {"role": "assistant", "content": "7"}, {"role": "assistant", "content": "8"}
    rows = [
        {"chosen": [*user, good], "rejected": [*user, bad]},
        {"prompt": user, "chosen": [good], "rejected": [bad]},
        {"prompt": user, "chosen": "7", "rejected": "8"},  # text answers to a conversation prompt
    ]
    implicit, explicit, text = load_pairs(write_jsonl(tmp_path / "prefs.jsonl", rows), model_dir)
    prompt = tokenizer.encode(tokenizer.chat_template.render(user))
    for answer, (ids, mask) in zip(("7", "8"), implicit, strict=True):
        said = tokenizer.encode(answer + "<|im_end|>")
        assert ids == prompt + said and mask == [0] * len(prompt) + [1] * len(said)
    assert explicit == implicit
    assert text == implicit  # the text answers get EOS, which is this tokenizer's <|im_end|>
    # UltraFeedback's binarized rows: a text prompt beside sides that open with it. Before: refused.
    ultrafeedback = {"prompt": "Name a prime. ", "chosen": [*user, good], "rejected": [*user, bad]}
    assert load_pairs(write_jsonl(tmp_path / "uf.jsonl", [ultrafeedback]), model_dir) == [implicit]


def test_an_hh_rlhf_row_is_named_with_what_to_do(model_dir, tmp_path) -> None:
    row = {"chosen": "\n\nHuman: Name a prime.\n\nAssistant: 7", "rejected": "\n\nHuman: Name a prime.\n\nAssistant: 8"}
    path = write_jsonl(tmp_path / "hh.jsonl", [row])
    with pytest.raises(
        DataError, match=r"column 'prompt' is missing .*Anthropic HH-RLHF's layout: the prompt is the start"
    ):
        load_preference_dataset(path, load_tokenizer(model_dir), max_length=4096)


def test_bad_preference_conversations_name_the_column(model_dir, tmp_path) -> None:
    user = [{"role": "user", "content": "Name a prime."}]
    cases = [
        (
            {"chosen": [*user, {"role": "assistant", "content": "7"}], "rejected": "8"},
            "rejected",
            "must be a conversation",
        ),
        (
            {"prompt": "Name a prime.", "chosen": [{"role": "assistant", "content": "7"}], "rejected": []},
            "prompt",
            "must be a conversation too",
        ),
        ({"chosen": user, "rejected": user}, "chosen", "has no assistant message"),
        (  # two prompts: accepted as a pair before
            {
                "chosen": [*user, {"role": "assistant", "content": "7"}],
                "rejected": [
                    {"role": "user", "content": "Name an even number."},
                    {"role": "assistant", "content": "8"},
                ],
            },
            "rejected",
            "opens otherwise than 'chosen' (the messages before the first assistant message differ)",
        ),
    ]
    for row, column, detail in cases:
        path = write_jsonl(tmp_path / "bad.jsonl", [row])
        with pytest.raises(DataError, match=re.escape(f"{path}: line 1: column '{column}'")) as err:
            load_preference_dataset(path, load_tokenizer(model_dir), max_length=4096)
        assert detail in str(err.value), err.value
