"""Chat prompts: conversations rendered with the model's chat template and tokenized, token for token
equal to transformers' ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``
on tokenizers built here with a Qwen2-style and a Llama-3-style template; and the errors."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from megatron_rlhf.data import ByteTokenizer, DataError, load_prompt_dataset, load_tokenizer
from tests.helpers import make_chat_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}],
    [
        {"role": "system", "content": "Answer in French. "},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  How are you?\n"},
        {"role": "assistant", "content": "Très bien, merci."},
        {"role": "user", "content": "And in one word? 日本語 🙂"},
    ],
    [
        {"role": "user", "content": "a <b> & 'c'", "name": None},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return make_chat_tokenizer("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    return make_chat_tokenizer("llama3", tmp_path_factory.mktemp("llama3"))


def reference_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(model_dir))
    return list(ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def prompt_ids(model_dir: Path, tmp_path: Path, conversations: list[list[dict]], **kwargs) -> list[list[int]]:
    f = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": c} for c in conversations])
    ds, report = load_prompt_dataset(f, load_tokenizer(model_dir), max_length=4096, **kwargs)
    assert report.kept == len(conversations)
    return [ex.prompt_ids.tolist() for ex in ds]


def test_a_conversation_stored_as_json_text_is_read_as_its_messages(qwen2_dir, tmp_path):
    """A conversation written with json.dumps into the prompt column was tokenized as its literal
    JSON, chat template unapplied, with no word. Text that is not a message list stays text."""
    texts = ['[{"role": "user", "content": "x"}', "[1, 2]", '[{"content": "no role"}]', "[{not json}]"]
    rows = [{"prompt": json.dumps(c)} for c in CONVERSATIONS] + [{"prompt": t} for t in texts]
    ds, report = load_prompt_dataset(
        write_jsonl(tmp_path / "p.jsonl", rows), load_tokenizer(qwen2_dir), max_length=4096
    )
    ids = [ex.prompt_ids.tolist() for ex in ds]
    assert ids[: len(CONVERSATIONS)] == [reference_ids(qwen2_dir, c) for c in CONVERSATIONS]
    assert ids[len(CONVERSATIONS) :] == [load_tokenizer(qwen2_dir).encode(t) for t in texts]
    assert report.json_conversations == len(CONVERSATIONS)
    assert f"{len(CONVERSATIONS)} prompt(s) were JSON text of a message list, read as conversations" in report.summary()
    # Plain text is tokenized as written; with a chat template there to apply, the report says so.
    assert report.text_prompts == len(texts)
    assert f"{len(texts)} prompt(s) were plain text, tokenized as written without the tokenizer's chat" in (
        report.summary()
    )
    text_only = write_jsonl(tmp_path / "text.jsonl", [{"prompt": t} for t in texts])
    _, untemplated = load_prompt_dataset(
        text_only, load_tokenizer(qwen2_dir), max_length=4096, apply_chat_template=False
    )
    assert untemplated.text_prompts == 0 and "plain text" not in untemplated.summary()


@pytest.mark.parametrize("style", ["qwen2", "llama3"])
def test_ids_equal_transformers_apply_chat_template(style, qwen2_dir, llama3_dir, tmp_path):
    model_dir = {"qwen2": qwen2_dir, "llama3": llama3_dir}[style]
    assert (model_dir / "chat_template.jinja").is_file()  # where transformers 5 saves it
    ours = prompt_ids(model_dir, tmp_path, CONVERSATIONS)
    for conversation, ids in zip(CONVERSATIONS, ours, strict=True):
        assert ids == reference_ids(model_dir, conversation)
    tok = load_tokenizer(model_dir)
    start = tok.encode("<|im_start|>" if style == "qwen2" else "<|begin_of_text|>")
    assert len(start) == 1 and ours[0][0] == start[0]  # special tokens are single ids, not spelled out
    text = tok.decode(ours[1])
    if style == "qwen2":
        assert text.endswith("Name a prime number.<|im_end|>\n<|im_start|>assistant\n")
    else:
        assert "Today Date: " in text and text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tojson_content_matches_transformers(llama3_dir, tmp_path):
    """Non-text content goes through the template's tojson: no HTML or ASCII escaping, as in transformers."""
    conversation = [{"role": "user", "content": [{"type": "text", "text": "é <b> & 'q'"}, {"n": 1}]}]
    (ids,) = prompt_ids(llama3_dir, tmp_path, [conversation])
    assert ids == reference_ids(llama3_dir, conversation)
    assert '[{"type": "text", "text": "é <b> & \'q\'"}, {"n": 1}]' in load_tokenizer(llama3_dir).decode(ids)


@pytest.mark.parametrize("form", ["string", "named list"])
def test_template_from_tokenizer_config(form, qwen2_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in qwen2_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = (
        template
        if form == "string"
        else [{"name": "tool_use", "template": "{{ nope }}"}, {"name": "default", "template": template}]
    )
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert re.search(r"tokenizer_config\.json \(chat_template\)", repr(load_tokenizer(d).chat_template))
    ours = prompt_ids(d, tmp_path, CONVERSATIONS)
    assert ours == [reference_ids(d, c) for c in CONVERSATIONS]


def test_plain_text_and_pretokenized_prompts_are_not_templated(qwen2_dir, tmp_path):
    tok = load_tokenizer(qwen2_dir)
    f = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "What is 2 + 3?"}, {"prompt": CONVERSATIONS[0]}])
    g = write_jsonl(tmp_path / "ids.jsonl", [{"prompt_ids": [7, 8, 9]}])
    ds, _ = load_prompt_dataset([f, g], tok, max_length=4096)
    assert ds[0].prompt_ids.tolist() == tok.encode("What is 2 + 3?")
    assert ds[1].prompt_ids.tolist() == reference_ids(qwen2_dir, CONVERSATIONS[0])
    assert ds[2].prompt_ids.tolist() == [7, 8, 9]


def test_add_bos_does_not_double_a_template_bos(llama3_dir, tmp_path):
    tok = load_tokenizer(llama3_dir)
    (ids,) = prompt_ids(llama3_dir, tmp_path, [CONVERSATIONS[0]], add_bos=True)
    assert ids == reference_ids(llama3_dir, CONVERSATIONS[0]) and ids[0] == tok.bos_id and ids[1] != tok.bos_id


def test_message_rows_need_the_setting_and_a_template(qwen2_dir, tmp_path):
    f = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "text"}, {"prompt": CONVERSATIONS[0]}])
    with pytest.raises(
        DataError,
        match=re.escape(f"{f}: line 2: column 'prompt' holds chat messages but data.apply_chat_template is false"),
    ):
        load_prompt_dataset(f, load_tokenizer(qwen2_dir), max_length=4096, apply_chat_template=False)
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{f}: line 2: column 'prompt' holds chat messages but "
            "ByteTokenizer(vocab_size=300) has no chat template (looked for "
            "chat_template.jinja, or 'chat_template' in tokenizer_config.json"
        ),
    ):
        load_prompt_dataset(f, ByteTokenizer(300), max_length=4096, on_invalid="skip")  # never skipped
    with pytest.raises(DataError, match=r"data\.apply_chat_template renders message rows"):
        load_prompt_dataset(f, ByteTokenizer(300), max_length=4096)


def test_bad_conversations_error_or_skip(llama3_dir, tmp_path):
    rows = [
        {"prompt": CONVERSATIONS[0]},
        {"prompt": [{"role": "tool", "content": "x"}]},
        {"prompt": []},
        {"prompt": ["hi"]},
        {"prompt": [{"content": "no role"}]},
    ]
    f = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = load_tokenizer(llama3_dir)
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{f}: line 2: column 'prompt' the chat template ({llama3_dir / 'chat_template.jinja'}) failed: "
            "TemplateError: Unknown role 'tool': expected system, user or assistant (set data.on_invalid=skip"
        ),
    ):
        load_prompt_dataset(f, tok, max_length=4096)
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(llama3_dir))
    with pytest.raises(TemplateError, match="Unknown role 'tool'"):  # transformers rejects it too
        ref.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True)
    ds, report = load_prompt_dataset(f, tok, max_length=4096, on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"chat_template_failed": 1, "empty": 1, "wrong_type": 2}
    assert [s.detail for s in report.samples["wrong_type"]] == [
        "message 0 must be an object with a string 'role' and 'content', got 'hi'",
        "message 0 must be an object with a string 'role' and 'content', got {'content': 'no role'}",
    ]
    assert report.samples["empty"][0].detail == "is an empty list of messages"


def test_template_file_errors(qwen2_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in qwen2_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{d / 'chat_template.jinja'}: the chat template does not compile")):
        load_tokenizer(d)
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "tool_use", "template": "x"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=r"tokenizer_config\.json: chat_template lists templates named \['tool_use'\] "
        "but none named 'default'",
    ):
        load_tokenizer(d)
    config.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert load_tokenizer(d).chat_template is None


def test_template_pickles_as_its_text(llama3_dir):
    """A worker process gets the tokenizer pickled; its chat template is compiled again there."""
    tok = load_tokenizer(llama3_dir)
    copy = pickle.loads(pickle.dumps(tok))
    assert copy.chat_template is not tok.chat_template and copy.chat_template.source == tok.chat_template.source
    assert [copy.chat_template.render(c) for c in CONVERSATIONS] == [tok.chat_template.render(c) for c in CONVERSATIONS]


def test_messages_a_template_would_render_empty_or_leave_out_are_invalid(tmp_path):
    """Qwen2-style templates leave out roles they do not know (ShareGPT's human) and render a message
    without 'content' as empty: the row trained on without its text."""
    model_dir = make_chat_tokenizer("qwen25_tools", tmp_path / "qwen")
    call = {"type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}]},
        {"prompt": [{"role": "human", "content": "What is 2+2?"}]},
        {"prompt": [{"role": "user", "text": "What is 2+2?"}]},
        {"prompt": [{"role": "user", "content": ""}]},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]},
    ]
    f = write_jsonl(tmp_path / "chat.jsonl", rows)
    tok = load_tokenizer(model_dir)
    with pytest.raises(
        DataError, match=re.escape("line 2: column 'prompt' message 0 has role 'human', which the chat")
    ):
        load_prompt_dataset(f, tok, max_length=4096)
    ds, report = load_prompt_dataset(f, tok, max_length=4096, on_invalid="skip")
    assert len(ds) == 2 and report.skipped == {"chat_template_failed": 1, "wrong_type": 1, "empty": 1}
    assert [s.detail for s in report.samples["wrong_type"]] == [
        "message 0 (user) must have a string 'content' (its text is under 'text': name it 'content'), got none"
    ]
