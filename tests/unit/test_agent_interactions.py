"""Interactions (verl's ``BaseInteraction``): episodes driven by hand, as the engine drives them. A policy
turn that calls no tool gets the interaction's reply as a user message whose tokens equal transformers'
``apply_chat_template`` of the whole conversation, or ends the trajectory; scores, limits and failures
land in the trajectory record; the interactions file and each prompt's choice are checked up front."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest

from megatron_rlhf.agent.builtin_tools import Calculator
from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.agent.interactions import BaseInteraction, load_interactions
from megatron_rlhf.agent.loop import AgentParts, ToolAgent
from megatron_rlhf.config.fields import building_tree
from megatron_rlhf.data.datasets import RAW_PROMPT
from megatron_rlhf.data.tokenizer import HFTokenizer
from megatron_rlhf.rollout.engine import EnvironmentTurn
from megatron_rlhf.trainer.trajectories import trajectory_fields, trajectory_metrics
from tests.helpers import policy_turn

CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}},
}
USER = [{"role": "user", "content": "What is 6 * 7?"}]


class Teacher(BaseInteraction):
    """Says "Try again." to a wrong answer (score 0) and ends the trajectory on the right one (score 1),
    async as verl's interactions are; records what it was given."""

    calls: ClassVar[list[tuple[str, Any]]] = []

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        self.calls.append(("start", kwargs))
        return f"conversation-{instance_id}"

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        self.calls.append(("reply", (instance_id, [(m["role"], m["content"]) for m in messages])))
        right = str(kwargs["ground_truth"]) in messages[-1]["content"]
        return (True, "Correct!", 1.0, {}) if right else (False, "Try again.", 0.0, {})

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self.calls.append(("finalize", instance_id))


class Broken(BaseInteraction):
    def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        raise SystemExit("the grader gave up")


class Slow(BaseInteraction):
    gate = threading.Event()

    def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any):
        self.gate.wait(30)
        return False, "late", None, {}


class ArithmeticInteraction(Teacher):
    """Named after its class in an interactions file entry without a name."""


@pytest.fixture
def tokenizer(tool_chat_tokenizer: HFTokenizer) -> HFTokenizer:
    return tool_chat_tokenizer


def make_agent(tokenizer, interactions, extra_infos=None, tools=None, **settings: Any) -> ToolAgent:
    extras = extra_infos or [{"interaction_kwargs": {"name": "teacher", "ground_truth": 42}}]
    return ToolAgent(MultiTurnConfig(**settings), tokenizer, tools or {}, extras, interactions=interactions)


def test_the_interaction_replies_as_the_user_then_ends_the_trajectory(tool_chat_dir, tokenizer) -> None:
    from transformers import AutoTokenizer

    Teacher.calls = []
    # the prompt's conversation as the loader keeps it for interactions (verl's raw_prompt)
    extras = [{"interaction_kwargs": {"name": "teacher", "ground_truth": 42}, RAW_PROMPT: USER}]
    with make_agent(tokenizer, {"teacher": Teacher({"name": "teacher"})}, extras) as agent:
        episode = agent.episode(0, 0)
        future = episode.after_turn(policy_turn(tokenizer, "It is 41."))
        assert future is not None
        reply = future.result(timeout=10)
        assert not reply.ends
        last = episode.after_turn(policy_turn(tokenizer, "It is 42."))
        assert last is not None and last.result(timeout=10) == EnvironmentTurn([], ends=True)
        record = episode.close().result()

    prompt = tokenizer.encode(tokenizer.chat_template.render(USER))
    conversation = [*USER, {"role": "assistant", "content": "It is 41."}, {"role": "user", "content": "Try again."}]
    reference = AutoTokenizer.from_pretrained(str(tool_chat_dir)).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert prompt + policy_turn(tokenizer, "It is 41.") + reply.token_ids == list(reference)
    assert record["user_turns"] == 1 and record["turn_scores"] == [0.0, 1.0]
    assert record["num_turns"] == 4  # the prompt, two policy turns, one reply
    assert record["interaction_errors"] == 0 and record["tool_calls"] == 0
    assert [m["role"] for m in record["messages"]] == ["assistant", "user", "assistant", "user"]
    # Started once with the prompt's interaction_kwargs, replied twice to the whole conversation (the
    # prompt's messages first, as verl hands them), finalized.
    instance = Teacher.calls[1][1][0]
    question = ("user", "What is 6 * 7?")
    assert Teacher.calls == [
        ("start", {"name": "teacher", "ground_truth": 42}),
        ("reply", (instance, [question, ("assistant", "It is 41.")])),
        (
            "reply",
            (instance, [question, ("assistant", "It is 41."), ("user", "Try again."), ("assistant", "It is 42.")]),
        ),
        ("finalize", instance),
    ]
    assert instance.startswith("conversation-0-0-teacher-")


def test_tools_answer_calls_and_the_interaction_answers_the_rest(tokenizer) -> None:
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    parts = {"teacher": Teacher({"name": "teacher"})}
    tools = {"calculator": Calculator({}, CALCULATOR)}
    with make_agent(tokenizer, parts, tools=tools) as agent:
        episode = agent.episode(0, 0)
        tool_turn = episode.after_turn(policy_turn(tokenizer, call))
        assert tool_turn is not None and "<tool_response>\n42\n</tool_response>" in tokenizer.decode(
            tool_turn.result(timeout=10).token_ids
        )
        end = episode.after_turn(policy_turn(tokenizer, "42"))
        assert end is not None and end.result(timeout=10).ends
        record = episode.close().result()
    assert (record["tool_calls"], record["user_turns"], record["turn_scores"]) == (1, 0, [1.0])
    assert record["num_turns"] == 4  # the prompt, two policy turns, one tool turn


def test_max_user_turns_counts_tool_and_interaction_turns_together(tokenizer) -> None:
    with make_agent(tokenizer, {"teacher": Teacher({"name": "teacher"})}, max_user_turns=2) as agent:
        episode = agent.episode(0, 0)
        for _ in range(2):
            future = episode.after_turn(policy_turn(tokenizer, "It is 41."))
            assert future is not None and not future.result(timeout=10).ends
        assert episode.after_turn(policy_turn(tokenizer, "It is 41.")) is None
        record = episode.close().result()
    assert record["user_turns"] == 2 and record["turn_scores"] == [0.0, 0.0]


def test_a_failing_or_hanging_interaction_ends_the_trajectory_and_is_counted(tokenizer) -> None:
    for interaction, settings in ((Broken({}), {}), (Slow({}), {"tool_timeout_s": 0.2})):
        extras = [{"interaction_kwargs": {}}]  # the file's only interaction: the name may be left out
        with make_agent(tokenizer, {"only": interaction}, extras, **settings) as agent:
            episode = agent.episode(0, 0)
            future = episode.after_turn(policy_turn(tokenizer, "It is 41."))
            assert future is not None and future.result(timeout=10) == EnvironmentTurn([], ends=True)
            record = episode.close().result()
        assert record["interaction_errors"] == 1 and record["user_turns"] == 0, type(interaction)
        assert [m["role"] for m in record["messages"]] == ["assistant"]
        assert (
            record["interaction_failure"]
            == {
                Broken: "only: SystemExit: the grader gave up",
                Slow: "only: no answer within 0.2 s",
            }[type(interaction)]
        )
    Slow.gate.set()  # the timed-out call, still running, returns


def test_prompts_without_an_interaction_end_after_a_turn_without_calls(tokenizer) -> None:
    with ToolAgent(MultiTurnConfig(), tokenizer, {"calculator": Calculator({}, CALCULATOR)}, [{}]) as agent:
        episode = agent.episode(0, 0)
        assert episode.after_turn(policy_turn(tokenizer, "It is 42.")) is None
        assert episode.close().result()["user_turns"] == 0


def test_each_prompts_interaction_is_checked_up_front(tokenizer) -> None:
    two = {"teacher": Teacher({}), "grader": Teacher({})}
    with pytest.raises(ValueError, match=r"prompt 1: extra_info\.interaction_kwargs: names 'tutor'; .*\['grader'"):
        make_agent(
            tokenizer, two, [{"interaction_kwargs": {"name": "teacher"}}, {"interaction_kwargs": {"name": "tutor"}}]
        )
    with pytest.raises(ValueError, match=r"prompt 0: extra_info\.interaction_kwargs: names no interaction"):
        make_agent(tokenizer, two, [{}])


INTERACTIONS_YAML = """\
interaction:
  - name: teacher
    class_name: tests.unit.test_agent_interactions.Teacher
    config: {strict: true}
  - class_name: tests.unit.test_agent_interactions.ArithmeticInteraction
"""


def test_the_interactions_file_in_verls_format(tmp_path: Path) -> None:
    path = tmp_path / "interaction_config.yaml"
    path.write_text(INTERACTIONS_YAML)
    interactions = load_interactions(str(path))
    assert list(interactions) == ["teacher", "arithmetic"]  # an entry without a name: its class's
    assert interactions["teacher"].config == {"strict": True, "name": "teacher"}
    assert type(interactions["arithmetic"]) is ArithmeticInteraction
    assert (
        interactions["arithmetic"].config == {"name": "arithmetic"} and interactions["arithmetic"].name == "arithmetic"
    )


def config_errors(**settings: object) -> list[str]:
    with building_tree():
        config = MultiTurnConfig(**settings)  # type: ignore[arg-type]
    return config.errors()


BAD_FILES = {
    "interaction: 3\n": "interaction: expected a top-level 'interaction' list of {name, class_name, config}",
    "interaction:\n  - name: a\n    class_name: Teacher\n": "interaction[0].class_name: expected a dotted class path",
    "interaction:\n  - class_name: megatron_rlhf.agent.tools.ToolResponse\n": "lacks the methods",
    "interaction:\n  - class_name: tests.unit.test_agent_interactions.Teacher\n    config: [1]\n": (
        "interaction[0].config: expected a mapping"
    ),
    (
        "interaction:\n  - {name: a, class_name: tests.unit.test_agent_interactions.Teacher}\n"
        "  - {name: a, class_name: tests.unit.test_agent_interactions.Broken}\n"
    ): "interaction[1].name: 'a' names an earlier interaction too",
    "interaction: [\n": "not valid YAML",
    # before: a misspelled field was dropped, and the interaction ran without its config
    "interaction:\n  - class_name: tests.unit.test_agent_interactions.Teacher\n    cofig: {strict: true}\n": (
        "interaction[0]: unknown field(s) ['cofig'], expected {name, class_name, config}; did you mean 'config'?"
    ),
}


@pytest.mark.parametrize("text", BAD_FILES)
def test_a_bad_interactions_file_is_named_up_front(tmp_path: Path, text: str) -> None:
    path = tmp_path / "interactions.yaml"
    path.write_text(text)
    (error,) = config_errors(enable=True, interaction_config_path=str(path))
    assert error.startswith(f"interaction_config_path: {path}: ") and BAD_FILES[text] in error, error


def test_an_interaction_alone_is_a_multi_turn_environment(tmp_path: Path) -> None:
    path = tmp_path / "interactions.yaml"
    path.write_text(INTERACTIONS_YAML)
    parts = AgentParts.load(MultiTurnConfig(enable=True, interaction_config_path=str(path)))
    assert parts.tools == {} and list(parts.interactions) == ["teacher", "arithmetic"]
    assert config_errors(enable=True) == [
        "tool_config_path: multi-turn rollouts (enable=true) need the tools file, or an interactions file "
        "(interaction_config_path)"
    ]


def test_the_trainer_reports_the_interaction(tokenizer) -> None:
    """samples.jsonl's turns name the user's replies, and the step's figures count them."""
    from megatron_rlhf.rollout.engine import Completion

    with make_agent(tokenizer, {"teacher": Teacher({"name": "teacher"})}) as agent:
        episode = agent.episode(0, 0)
        first = policy_turn(tokenizer, "It is 41.")
        future = episode.after_turn(first)
        assert future is not None
        reply = future.result(timeout=10).token_ids
        second = policy_turn(tokenizer, "It is 42.")
        last = episode.after_turn(second)
        assert last is not None and last.result(timeout=10).ends
        record = episode.close().result()
    ids = first + reply + second
    mask = [True] * len(first) + [False] * len(reply) + [True] * len(second)
    completion = Completion(0, 0, [1], ids, [0.0] * len(ids), "stop", policy_mask=mask, trajectory=record)
    (row,) = trajectory_fields([completion], tokenizer.decode_batch, tokenizer.stop_ids)
    assert [t["role"] for t in row["turns"]] == ["assistant", "user", "assistant"]
    assert "Try again." in row["turns"][1]["text"]
    assert (row["user_turns"], row["turn_scores"], row["interaction_errors"]) == (1, [0.0, 1.0], 0)
    figures = trajectory_metrics([completion])
    assert figures["multi_turn/user_turns/mean"] == 1.0 and figures["multi_turn/turn_score/mean"] == 0.5
    assert figures["multi_turn/interaction_errors"] == 0.0
    assert json.dumps(row)  # a samples.jsonl row
