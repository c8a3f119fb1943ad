"""The agent's pieces that run no trajectory: the hermes tool-call parser (well-formed and every malformed
case), argument checking against a tool's schema, the calculator against hand-derived values, and the
tools file's up-front checks (each refusal naming the file, the field and what was expected)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.agent.builtin_tools import Calculator, CalculatorError, evaluate
from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.agent.parsers import PARSERS, CallError, ToolCall
from megatron_rlhf.agent.tools import argument_problems, load_tools
from megatron_rlhf.config.fields import building_tree

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "digits": {"type": ["integer", "null"]}},
            "required": ["expression"],
        },
    },
}

TOOLS_YAML = """\
tools:
  - class_name: {class_name}
    config: {{}}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluates arithmetic.
        parameters:
          type: object
          properties:
            expression: {{type: string}}
          required: [expression]
"""


def config_errors(**settings: object) -> list[str]:
    """A config's problems as the loader collects them (built in code, it raises them at once)."""
    with building_tree():
        config = MultiTurnConfig(**settings)  # type: ignore[arg-type]
    return config.errors()


def parse(text: str) -> list:
    return PARSERS.get("hermes")(text)


def test_hermes_reads_one_call_and_several_in_order() -> None:
    one = 'I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert parse(one) == [ToolCall("calculator", {"expression": "2+3"})]
    two = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    assert parse(two) == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parse("The answer is 5.") == []


@pytest.mark.parametrize(
    ("payload", "kind", "says"),
    [
        ('{"name": "calculator", "arguments": {"expression": "2+3"}', "malformed_json", "not valid JSON"),
        ('["calculator"]', "malformed_json", "must be a JSON object"),
        ('{"arguments": {"expression": "1"}}', "malformed_json", 'no "name"'),
        ('{"name": "", "arguments": {}}', "malformed_json", 'no "name"'),
        ('{"name": "calculator", "arguments": "2+3"}', "bad_arguments", "must be a JSON object"),
    ],
)
def test_hermes_turns_each_malformed_call_into_an_error_in_its_place(payload: str, kind: str, says: str) -> None:
    good = '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
    calls = parse(f"{good}\n<tool_call>\n{payload}\n</tool_call>")
    assert calls[0] == ToolCall("ok", {})
    assert isinstance(calls[1], CallError) and calls[1].kind == kind and says in calls[1].message, calls


def test_hermes_reports_a_call_left_open() -> None:
    (call,) = parse('<tool_call>\n{"name": "calculator", "arguments": {}}')
    assert call == CallError("malformed_json", "the tool call is not closed with </tool_call>")


@pytest.mark.parametrize(
    ("arguments", "problems"),
    [
        ({"expression": "1+1"}, []),
        ({"expression": "1+1", "digits": 3}, []),
        ({"expression": "1+1", "digits": None}, []),
        ({}, ["missing required argument 'expression'"]),
        ({"expression": 12}, ["argument 'expression' must be of type string, got integer"]),
        ({"expression": "1", "digits": True}, ["argument 'digits' must be of type integer or null, got boolean"]),
        ({"expression": "1", "base": 10}, ["unknown argument 'base' (the function takes ['digits', 'expression'])"]),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments: dict, problems: list[str]) -> None:
    assert argument_problems(CALCULATOR_SCHEMA, arguments) == problems


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12 * (3 + 4)", 84),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),  # floor, not truncation
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ** -2", 0.25),
        ("-3 ** 2", -9),  # ** binds tighter than unary minus
        ("1.5 * 4", 6.0),
        ("123 * 4567", 561741),
        ("(1 + 2) * (3 - 5) ** 3", -24),
    ],
)
def test_calculator_matches_hand_derived_values(expression: str, value: float) -> None:
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("9 ** 9 ** 9", "more than 4096 bits"),
        ("2 ** 5000", "more than 4096 bits"),
        ("1 / 0", "division by zero"),
        ("abs(-1)", "not arithmetic"),
        ("__import__('os')", "not arithmetic"),
        ("True + 1", "not arithmetic"),
        ("'a' * 3", "not arithmetic"),
        ("(-8) ** 0.5", "not a real number"),
        ("10.0 ** 400", "overflow"),
        ("1 +", "not an expression"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, says: str) -> None:
    with pytest.raises(CalculatorError, match=says):
        evaluate(expression)
    response, reward, _ = Calculator({}, CALCULATOR_SCHEMA).execute("id", {"expression": expression})
    assert response.text.startswith("Error: ") and says in response.text and reward == 0.0


def test_the_tools_file_builds_its_tools(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML.format(class_name="megatron_rlhf.agent.builtin_tools.Calculator"))
    tools = load_tools(str(path))
    assert list(tools) == ["calculator"] and isinstance(tools["calculator"], Calculator)
    assert MultiTurnConfig(enable=True, tool_config_path=str(path)).errors() == []


def test_the_builtin_tools_files_build_their_tools_and_an_unknown_one_is_named() -> None:
    calculator, python = load_tools("builtin:calculator"), load_tools("builtin:python")
    assert calculator["calculator"].execute("i", {"expression": "347*128"})[0].text == "44416"
    assert argument_problems(python["python"].tool_schema, {"code": "print(1)"}) == []
    with pytest.raises(ValueError, match=r"builtin:search: no such built-in tools file; .*\['calculator', 'python'\]"):
        load_tools("builtin:search")


@pytest.mark.parametrize(
    ("class_name", "says"),
    [
        ("Calculator", "tools[0].class_name: expected a dotted class path"),
        ("no_such_module.Calculator", "tools[0].class_name: cannot import module 'no_such_module'"),
        ("verl.tools.gsm8k_tool.Gsm8kTool", "verl's own classes import verl, which is not installed here"),
        ("megatron_rlhf.agent.builtin_tools.Abacus", "has no class 'Abacus'"),
        ("megatron_rlhf.agent.builtin_tools.Calculater", "has no class 'Calculater'; did you mean 'Calculator'?"),
        ("megatron_rlhf.agent.tools.ToolResponse", "lacks the methods"),
    ],
)
def test_a_bad_class_path_is_named_up_front(tmp_path: Path, class_name: str, says: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML.format(class_name=class_name))
    (error,) = config_errors(enable=True, tool_config_path=str(path))
    assert error.startswith(f"tool_config_path: {path}: ") and says in error, error


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (("type: function", "type: functon"), "tool_schema.type: expected 'function' (or no type), got 'functon'"),
        (
            ("required: [expression]", "required: [expresion]"),
            "parameters.required: ['expresion'] are not among its properties ['expression']",
        ),
        (
            ("expression: {type: string}", "expression: {type: str}"),
            "parameters.properties.expression: expected a schema whose type is one of",
        ),
    ],
)
def test_a_tool_schema_that_would_refuse_every_call_is_named_up_front(
    tmp_path: Path, edit: tuple[str, str], says: str
) -> None:
    """Before: accepted, and mid-run every correct call was refused against the slip."""
    path = tmp_path / "tools.yaml"
    text = TOOLS_YAML.format(class_name="megatron_rlhf.agent.builtin_tools.Calculator")
    assert edit[0] in text
    path.write_text(text.replace(*edit))
    (error,) = config_errors(enable=True, tool_config_path=str(path))
    assert error.startswith(f"tool_config_path: {path}: ") and says in error, error


def test_a_misspelled_field_of_a_tools_file_is_named(tmp_path: Path) -> None:
    """Before: dropped, and the tool was built without its config."""
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML.format(class_name="x.Y").replace("config: {}", "confg: {}"))
    (error,) = config_errors(enable=True, tool_config_path=str(path))
    assert error == (
        f"tool_config_path: {path}: tools[0]: unknown field(s) ['confg'], expected {{class_name, config, "
        "tool_schema}; did you mean 'config'?"
    )


def test_a_bad_schema_and_bad_settings_are_named_up_front(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML.format(class_name="x.Y").replace("name: calculator", "name: 7"))
    errors = config_errors(enable=True, tool_config_path=str(path), format="json", max_parallel_calls=0)
    assert errors[0] == "max_parallel_calls=0 must be >= 1"
    assert errors[1].startswith("format='json' must be one of ['hermes']")
    assert errors[2] == (
        f"tool_config_path: {path}: tools[0].tool_schema.function.name: expected the function's name "
        "(a non-empty string), got 7"
    )
    assert MultiTurnConfig(enable=False).errors() == []
    (ignored,) = config_errors(tool_config_path="builtin:calculator")  # before: accepted, and never used
    assert ignored == "tool_config_path given, but enable=false: rollouts are single-turn; set enable=true"
    with pytest.raises(ValueError, match="tool_config_path: multi-turn rollouts"):
        MultiTurnConfig(enable=True)


def test_ppo_refuses_prompts_offered_other_tools_than_the_agent_runs(tmp_path: Path, capsys) -> None:
    from megatron_rlhf.cli import main

    runs, offered = tmp_path / "runs.yaml", tmp_path / "offered.yaml"
    runs.write_text(TOOLS_YAML.format(class_name="megatron_rlhf.agent.builtin_tools.Calculator"))
    offered.write_text(runs.read_text())
    settings = [
        "ppo",
        "--config",
        "ppo-tiny",
        "rollout.multi_turn.enable=true",
        f"rollout.multi_turn.tool_config_path={runs}",
    ]
    assert main([*settings, f"data.tools_file={runs}", "--print-config"]) == 0
    assert "tool_config_path" in capsys.readouterr().out
    assert main([*settings, f"data.tools_file={offered}", "--print-config"]) == 2
    assert f"data.tools_file='{offered}' offers the prompts other tools than the agent runs" in capsys.readouterr().err


def test_a_tools_file_without_tools_is_named(tmp_path: Path) -> None:
    """Before: accepted, and the rollouts were single-turn with no word."""
    path = tmp_path / "tools.yaml"
    path.write_text("tools: []\n")
    (error,) = config_errors(enable=True, tool_config_path=str(path))
    assert error == f"tool_config_path: {path}: tools is empty: a tools file offers the model at least one tool"
