"""Chat prompts with tool schemas and template variables: token for token equal to transformers'
``apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=True, **kwargs)`` on a
template shaped like Qwen2.5's / Qwen3's (a ``# Tools`` system block of ``<tools></tools>`` JSON
lines; an empty think block after the generation prompt when ``enable_thinking`` is false); where the
schemas come from (a verl tools file, a row's column, which wins); and the errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import ConfigError, config_errors, load_config
from megatron_rlhf.data import RAW_PROMPT, DataError, load_prompt_dataset, load_tokenizer
from megatron_rlhf.data.chat_template import load_tool_schemas
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
from tests.helpers import make_chat_tokenizer

# Written here in the shape of Qwen2.5's tool block and Qwen3's enable_thinking switch.
QWEN3_STYLE_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# verl's tool_config_path format (examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml).
TOOLS_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "Reward of a GSM8K answer (1.0 if it is right, 0.0 if not): é"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer, digits only"
          required: ["answer"]
  - class_name: "my.tools.Search"
    config: {}
    tool_schema:
      type: "function"
      function:
        name: "search"
        description: "Look a word up"
        parameters: {type: "object", properties: {query: {type: "string"}}, required: ["query"]}
"""

ROW_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'here'",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
USER = [{"role": "user", "content": "What is 2 + 3?"}]
SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = make_chat_tokenizer("qwen2", tmp_path_factory.mktemp("qwen3_style"))
    (d / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE, encoding="utf-8")
    return d


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tool_config.yaml"
    path.write_text(TOOLS_YAML, encoding="utf-8")
    return path


def reference_ids(model_dir: Path, messages: list[dict], tools: list[dict] | None, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(model_dir))
    out = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"])


def load_ids(model_dir: Path, tmp_path: Path, rows: list[dict], **kwargs) -> list[list[int]]:
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    ds, report = load_prompt_dataset(f, load_tokenizer(model_dir), max_length=4096, **kwargs)
    assert report.kept == len(rows)
    return [ex.prompt_ids.tolist() for ex in ds]


def test_tools_file_holds_the_schemas_in_order(tools_file: Path) -> None:
    schemas = load_tool_schemas(tools_file)
    assert [s["function"]["name"] for s in schemas] == ["calc_gsm8k_reward", "search"]
    assert schemas[1] == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("messages", [USER, SYSTEM_USER])
def test_ids_equal_transformers_with_tools_and_kwargs(kwargs, messages, model_dir, tools_file, tmp_path) -> None:
    schemas = load_tool_schemas(tools_file)
    rows = [
        {"prompt": messages},
        {"prompt": messages, "tools": ROW_TOOLS},
        {"prompt": messages, "tools": json.dumps(ROW_TOOLS)},
        {"prompt": messages, "tools": None},
    ]
    ours = load_ids(model_dir, tmp_path, rows, tools=schemas, chat_template_kwargs=kwargs)
    expected_tools = [schemas, ROW_TOOLS, ROW_TOOLS, schemas]  # a row's own schemas replace the file's
    assert ours == [reference_ids(model_dir, messages, t, **kwargs) for t in expected_tools]
    # The template's branches were taken: the tool block, and the think block only when asked.
    tok = load_tokenizer(model_dir)
    text, row_text = tok.decode(ours[0]), tok.decode(ours[1])
    assert '<tools>\n{"type": "function", "function": {"name": "calc_gsm8k_reward", ' in text and "é" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (kwargs == {"enable_thinking": False})
    assert "get_weather" in row_text and "calc_gsm8k_reward" not in row_text


def test_without_tools_the_template_takes_its_plain_branch(model_dir, tools_file, tmp_path) -> None:
    rows = [{"prompt": SYSTEM_USER}, {"prompt": SYSTEM_USER, "tools": ROW_TOOLS}]
    ours = load_ids(model_dir, tmp_path, rows, tools_key="")  # "": the column is not read
    assert ours == [reference_ids(model_dir, SYSTEM_USER, None)] * 2
    assert "<tools>" not in load_tokenizer(model_dir).decode(ours[1])
    # A row's own empty list replaces the file's schemas too: no tools for that row.
    (empty,) = load_ids(model_dir, tmp_path, [{"prompt": USER, "tools": []}], tools=load_tool_schemas(tools_file))
    assert empty == reference_ids(model_dir, USER, [])


def test_custom_tools_column(model_dir, tmp_path) -> None:
    (ids,) = load_ids(
        model_dir, tmp_path, [{"prompt": USER, "functions": ROW_TOOLS, "tools": "ignored"}], tools_key="functions"
    )
    assert ids == reference_ids(model_dir, USER, ROW_TOOLS)


def test_tools_a_row_offers_of_its_own_that_the_agent_does_not_run_are_warned_of(model_dir, tools_file, tmp_path):
    """A row's own tools column replaces the tools file's for its prompt. Where it names a tool the
    agent does not run, every call of it was answered as an unknown tool with no word at start-up
    (the same mismatch through data.tools_file is refused up front)."""
    from megatron_rlhf.agent.builtin_tools import Calculator
    from megatron_rlhf.agent.loop import AgentParts

    rows = [{"prompt": USER, "tools": ROW_TOOLS}, {"prompt": USER, "tools": json.dumps(ROW_TOOLS)}, {"prompt": USER}]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    _, report = load_prompt_dataset(f, load_tokenizer(model_dir), max_length=4096, tools=load_tool_schemas(tools_file))
    assert report.own_tools == {"get_weather": 2} and report.chat_prompts == 3
    schema = load_tool_schemas(tools_file)[0]
    parts = AgentParts({schema["function"]["name"]: Calculator({}, schema)}, {})
    warning = parts.foreign_tools_warning(report.own_tools)
    assert warning is not None and "that the agent does not run: get_weather (2 prompts)" in warning
    assert parts.foreign_tools_warning({schema["function"]["name"]: 3}) is None


@pytest.mark.parametrize(
    "value, detail",
    [
        ({"type": "function"}, "must be a list of tool schemas (or a JSON string of one), got dict"),
        ("[{", "is a string but not JSON: Expecting property name enclosed in double quotes (column 3)"),
        (
            ["get_weather"],
            "[0]: expected an OpenAI function schema {type: function, function: {name, description, "
            "parameters}}, got str 'get_weather'",
        ),
        (
            [ROW_TOOLS[0], {"type": "function", "name": "f"}],
            "[1].function: expected an object {name, description, parameters}, got None",
        ),
        (
            json.dumps([{"function": {"description": "no name"}}]),
            "[0].function.name: expected the function's name (a non-empty string), got None",
        ),
    ],
)
def test_bad_row_tools_error_or_skip(value, detail, model_dir, tmp_path) -> None:
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": USER}) + "\n" + json.dumps({"prompt": USER, "tools": value}) + "\n")
    tok = load_tokenizer(model_dir)
    with pytest.raises(DataError, match=re.escape(f"{f}: line 2: column 'tools' {detail} (set data.on_invalid=skip")):
        load_prompt_dataset(f, tok, max_length=4096)
    ds, report = load_prompt_dataset(f, tok, max_length=4096, on_invalid="skip")
    assert len(ds) == 1 and report.skipped == {"wrong_type": 1} and report.samples["wrong_type"][0].detail == detail


def test_text_prompts_ignore_tools(model_dir, tmp_path) -> None:
    (ids,) = load_ids(
        model_dir,
        tmp_path,
        [{"prompt": "plain text", "tools": "not read"}],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert ids == load_tokenizer(model_dir).encode("plain text")


def test_conversations_are_kept_for_interactions_only_when_asked(model_dir, tmp_path) -> None:
    """``keep_raw_prompt`` (multi-turn runs with interactions): a conversation prompt's messages join
    its extras as verl's raw_prompt, {role, content} only; a text prompt has none to keep."""
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 * 7?", "name": "asker"},
    ]
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": conversation}) + "\n" + json.dumps({"prompt": "plain text"}) + "\n")
    tok = load_tokenizer(model_dir)
    kept, _ = load_prompt_dataset(f, tok, max_length=4096, keep_raw_prompt=True)
    assert kept[0].extras[RAW_PROMPT] == [{"role": m["role"], "content": m["content"]} for m in conversation]
    assert RAW_PROMPT not in kept[1].extras
    default, _ = load_prompt_dataset(f, tok, max_length=4096)
    assert all(RAW_PROMPT not in example.extras for example in default)
    assert [e.prompt_ids.tolist() for e in default] == [e.prompt_ids.tolist() for e in kept]
    ids_only = tmp_path / "ids.jsonl"
    ids_only.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    with pytest.raises(
        DataError, match=rf"{ids_only}: line 1: column 'prompt' is missing .*the interactions read each row's prompt"
    ):
        load_prompt_dataset(ids_only, tok, max_length=4096, keep_raw_prompt=True)  # was a bare KeyError


def test_loader_argument_checks(model_dir, tmp_path) -> None:
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"prompt": USER}) + "\n")
    tok = load_tokenizer(model_dir)
    with pytest.raises(
        ValueError,
        match=r"chat_template_kwargs: key 'add_generation_prompt' is not a template "
        r"variable of its own: the renderer sets it",
    ):
        load_prompt_dataset(f, tok, max_length=4096, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match=re.escape("tools[1].function.name: expected the function's name")):
        load_prompt_dataset(f, tok, max_length=4096, tools=[ROW_TOOLS[0], {"function": {"name": ""}}])


BAD_FILES = {
    "not YAML": ("tools: [\n  - {a: 1", "not valid YAML: "),
    "no tools list": (
        "tool: []\n",
        "tools: expected a top-level 'tools' list of {class_name, config, tool_schema} "
        "(verl's tool_config_path format), got None",
    ),
    "no schema": (
        "tools:\n  - class_name: x\n    mcp: {mcp_servers_config_path: s.json}\n",
        "tools[0].tool_schema: missing (MCP tools, whose schemas come from their server, are not supported)",
    ),
    "no name": (
        TOOLS_YAML.replace('name: "search"', 'title: "search"'),
        "tools[1].tool_schema.function.name: expected the function's name (a non-empty string), got None",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_tools_files_name_the_file_and_field(case, tmp_path) -> None:
    text, message = BAD_FILES[case]
    path = tmp_path / "tools.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        load_tool_schemas(path)


def test_ppo_checks_the_settings_up_front(tools_file, tmp_path) -> None:
    def check(*overrides: str) -> None:
        check_ppo_config(load_config("ppo-tiny", [f"output_dir={tmp_path / 'run'}", *overrides], schema=PPOConfig), 1)

    check(f"data.tools_file={tools_file}", "data.chat_template_kwargs={enable_thinking: false}")
    missing = tmp_path / "nope.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_FILES["no name"][0], encoding="utf-8")
    for path, message in ((missing, "the tools file does not exist"), (bad, BAD_FILES["no name"][1])):
        with pytest.raises(ConfigError, match=re.escape(f"data.tools_file: {path}: {message}")):
            check(f"data.tools_file={path}")
    cfg = load_config("ppo-tiny", ["data.chat_template_kwargs={tools: [], enable_thinking: false}"], schema=PPOConfig)
    assert config_errors(cfg) == [
        "data.chat_template_kwargs: key 'tools' is not a template variable of its own: "
        "the renderer sets it (tool schemas go in data.tools_file or a row's tools column)"
    ]
    assert not (tmp_path / "run").exists()
