"""``ToolAgent`` episodes driven by hand, as the engine drives them (a policy turn's ids in, a Future of the
environment's ids out): the tokens equal transformers' ``apply_chat_template`` of the whole conversation
on a Qwen2.5-shaped template (tool messages grouped in one user turn of <tool_response> blocks); every bad
call goes back to the model as a tool message and is counted by kind; the trajectory record."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from megatron_rlhf.agent.builtin_tools import Calculator
from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.agent.executor import CallOutcome, HungCallsError, ToolWorkers, gather_calls
from megatron_rlhf.agent.loop import AgentParts, ToolAgent
from megatron_rlhf.agent.tools import BaseTool, ToolResponse
from megatron_rlhf.data.tokenizer import HFTokenizer, load_tokenizer
from tests.helpers import make_chat_tokenizer, policy_turn


def schema(name: str, **properties: str) -> dict[str, Any]:
    props = {key: {"type": kind} for key, kind in properties.items()}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


CALCULATOR = schema("calculator", expression="string")
USER = [{"role": "user", "content": "What is 123 * 4567?"}]


@pytest.fixture
def tokenizer(tool_chat_tokenizer: HFTokenizer) -> HFTokenizer:
    return tool_chat_tokenizer


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def make_agent(tokenizer: HFTokenizer, tools: dict[str, Any], extra_infos=({},), **settings: Any) -> ToolAgent:
    return ToolAgent(MultiTurnConfig(max_parallel_calls=4, **settings), tokenizer, tools, list(extra_infos))


def test_an_episode_with_the_calculator_equals_the_whole_conversation_rendered(tool_chat_dir, tokenizer) -> None:
    from transformers import AutoTokenizer

    with make_agent(tokenizer, {"calculator": Calculator({}, CALCULATOR)}, max_assistant_turns=3) as agent:
        episode = agent.episode(0, 1)
        calls = [call("calculator", expression="123 * 4567"), call("calculator", expression="2 ** 3")]
        first = "Let me compute.\n" + "\n".join(calls)
        future = episode.after_turn(policy_turn(tokenizer, first))
        assert future is not None
        environment = future.result(timeout=10).token_ids
        second = "123 * 4567 = 561741."
        assert episode.after_turn(policy_turn(tokenizer, second)) is None
        record = episode.close().result()

    prompt = tokenizer.encode(tokenizer.chat_template.render(USER, tools=[CALCULATOR]))
    conversation = [
        *USER,
        {"role": "assistant", "content": first},
        {"role": "tool", "content": "561741"},
        {"role": "tool", "content": "8"},
    ]
    reference = AutoTokenizer.from_pretrained(str(tool_chat_dir)).apply_chat_template(
        conversation, tools=[CALCULATOR], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert prompt + policy_turn(tokenizer, first) + environment == list(reference)
    assert tokenizer.decode(environment) == (
        "\n<|im_start|>user\n<tool_response>\n561741\n</tool_response>\n<tool_response>\n8\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert record["num_turns"] == 4  # verl's count: the prompt, two policy turns, one tool turn
    assert record["tool_calls"] == 2 and set(record["tool_errors"].values()) == {0}
    assert record["messages"] == [
        {"role": "assistant", "content": first},
        {"role": "tool", "content": "561741"},
        {"role": "tool", "content": "8"},
        {"role": "assistant", "content": second},
    ]


class Echo(BaseTool):
    """Answers with its text; keeps per-trajectory state from create_kwargs; async, as verl's tools are."""

    def __init__(self, config: dict, tool_schema: dict) -> None:
        super().__init__(config, tool_schema)
        self.state: dict[str, dict] = {}
        self.released: list[str] = []

    async def create(self, instance_id: str, **kwargs: Any) -> tuple[str, ToolResponse]:  # type: ignore[override]
        self.state[instance_id] = {"calls": 0, **kwargs["create_kwargs"]}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any):  # type: ignore[override]
        await asyncio.sleep(0)
        self.state[instance_id]["calls"] += 1
        return ToolResponse(text=parameters["text"]), 0.5, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:  # type: ignore[override]
        return self.state[instance_id]["calls"] * self.state[instance_id]["bonus"]

    async def release(self, instance_id: str, **kwargs: Any) -> None:  # type: ignore[override]
        self.released.append(instance_id)


class Raises(BaseTool):
    def execute(self, instance_id: str, parameters: dict, **kwargs: Any):
        raise SystemExit("tool gave up")


class Waits(BaseTool):
    """Blocks until the test releases it: a call past its timeout."""

    gate = threading.Event()

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any):
        self.gate.wait(30)
        return "late", 0.0, {}


class CreateHangs(BaseTool):
    """Its create blocks until the test releases it: the call's timeout must still answer."""

    gate = threading.Event()

    def create(self, instance_id: str, **kwargs: Any) -> tuple[str, ToolResponse]:
        self.gate.wait(30)
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any):
        return "ran", 0.0, {}


def test_a_hanging_create_times_out_and_its_late_instance_is_released(tokenizer) -> None:
    tool = CreateHangs({}, schema("hangs"))
    released: list[str] = []
    tool.release = released.append  # type: ignore[method-assign]
    with make_agent(tokenizer, {"hangs": tool}, tool_timeout_s=0.2) as agent:
        episode = agent.episode(0, 0)
        future = episode.after_turn(policy_turn(tokenizer, call("hangs")))
        assert future is not None
        assert "did not finish within 0.2 s" in tokenizer.decode(future.result(timeout=10).token_ids)
        record = episode.close().result()
        CreateHangs.gate.set()
        for thread in threading.enumerate():  # the late create, and its release
            if thread.name.startswith("agent-tool"):
                thread.join(10)
    assert record["tool_errors"]["timeout"] == 1 and record["tool_rewards"] == {}
    assert len(released) == 1  # created after close: released at once, never leaked


def test_every_bad_call_goes_back_as_a_tool_message_and_is_counted(tokenizer) -> None:
    tools = {
        "echo": Echo({}, schema("echo", text="string")),
        "raises": Raises({}, schema("raises")),
        "waits": Waits({}, schema("waits")),
    }
    extra = {"tools_kwargs": {"echo": {"create_kwargs": {"bonus": 2.0}}}, "need_tools_kwargs": True}
    agent = make_agent(tokenizer, tools, [extra], tool_timeout_s=0.3, max_tool_response_length=10)
    try:
        episode = agent.episode(0, 0)
        calls = [
            call("echo", text="short"),
            "<tool_call>\n{not json}\n</tool_call>",
            call("search", query="x"),
            call("echo", text=3),
            call("raises"),
            call("waits"),
            call("echo", text="0123456789abcdefghij"),
        ]
        agent.config.max_parallel_calls = len(calls)
        future = episode.after_turn(policy_turn(tokenizer, "\n".join(calls)))
        assert future is not None
        text = tokenizer.decode(future.result(timeout=10).token_ids)
        record = episode.close().result()
    finally:
        Waits.gate.set()
        agent.shutdown()
    answers = [m["content"] for m in record["messages"][1:]]
    assert answers[0] == "short"
    assert answers[1].startswith("Error: the tool call is not valid JSON")
    assert answers[2] == "Error: unknown tool 'search'; the tools are ['echo', 'raises', 'waits']"
    assert answers[3] == "Error: wrong arguments for echo: argument 'text' must be of type string, got integer"
    assert answers[4] == "Error: raises failed: Syste...(truncated)...ve up"  # the tool's text is capped too
    assert answers[5] == "Error: the call to waits did not finish within 0.3 s"
    assert answers[6] == "01234...(truncated)...fghij"
    assert all(f"<tool_response>\n{answer}\n</tool_response>" in text for answer in answers)
    assert record["tool_errors"] == {
        "malformed_json": 1,
        "unknown_tool": 1,
        "bad_arguments": 1,
        "timeout": 1,
        "exception": 1,
        "truncated": 2,
        "over_limit": 0,
    }
    assert record["tool_calls"] == 7
    # calc_reward of each tool that ran: echo twice, bonus 2 from its create_kwargs
    assert record["tool_rewards"] == {"echo": 4.0, "raises": 0.0, "waits": 0.0}
    assert record["tool_call_rewards"] == [0.5, 0.5]
    assert tools["echo"].released == list(tools["echo"].state)
    assert record["tool_seconds"] >= 0.3


def test_the_turn_limit_and_the_call_limit(tokenizer) -> None:
    with make_agent(tokenizer, {"calculator": Calculator({}, CALCULATOR)}, max_assistant_turns=1) as agent:
        assert agent.episode(0, 0).after_turn(policy_turn(tokenizer, call("calculator", expression="1+1"))) is None
    with make_agent(tokenizer, {"calculator": Calculator({}, CALCULATOR)}) as agent:
        agent.config.max_parallel_calls = 1
        episode = agent.episode(0, 0)
        future = episode.after_turn(policy_turn(tokenizer, call("calculator", expression="1+1") * 2))
        assert future is not None and "<tool_response>\n2\n</tool_response><|im_end|>" in tokenizer.decode(
            future.result(timeout=10).token_ids
        )
        record = episode.close().result()
        assert record["tool_calls"] == 1 and record["tool_errors"]["over_limit"] == 1  # the second: dropped, counted


def test_bad_construction_is_named(tool_chat_dir, tokenizer) -> None:
    tools = {"calculator": Calculator({}, CALCULATOR)}
    with pytest.raises(ValueError, match=r"prompt 1: extra_info: need_tools_kwargs is true but tools_kwargs is empty"):
        make_agent(tokenizer, tools, [{}, {"need_tools_kwargs": True}])
    with pytest.raises(ValueError, match=r"prompt 0: extra_info.tools_kwargs: 'search' is not a tool"):
        make_agent(tokenizer, tools, [{"tools_kwargs": {"search": {}}}])
    parquet_row = {"tools_kwargs": {"calculator": {"create_kwargs": {"x": None}}, "search": None}}
    with make_agent(tokenizer, tools, [parquet_row]) as agent:  # a null entry: another row's tool, absent here
        assert agent.create_kwargs == [{"calculator": {"x": None}}]
    with pytest.raises(ValueError, match=r"tool 'calc': its tool_schema names the function 'calculator'"):
        make_agent(tokenizer, {"calc": Calculator({}, CALCULATOR)})
    without = load_tokenizer(tool_chat_dir)
    without.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        make_agent(without, tools)  # type: ignore[arg-type]


def test_episodes_driven_from_many_threads_keep_their_own_answers(tokenizer) -> None:
    """Engine threads call after_turn while the pool's workers finish other trajectories' calls."""
    problems = {(prompt, sample): f"{prompt + 11} * {sample + 101}" for prompt in range(4) for sample in range(4)}
    results: dict[tuple[int, int], tuple[str, dict]] = {}

    def drive(prompt: int, sample: int) -> None:
        episode = agent.episode(prompt, sample)
        future = episode.after_turn(policy_turn(tokenizer, call("calculator", expression=problems[prompt, sample])))
        assert future is not None
        results[prompt, sample] = tokenizer.decode(future.result(timeout=30).token_ids), episode.close().result()

    tools = {"calculator": Calculator({}, CALCULATOR)}
    with make_agent(tokenizer, tools, [{}] * 4, tool_workers=2) as agent:
        threads = [threading.Thread(target=drive, args=key) for key in problems]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert sorted(results) == sorted(problems)
    for (prompt, sample), (text, record) in results.items():
        assert f"<tool_response>\n{(prompt + 11) * (sample + 101)}\n</tool_response>" in text
        assert record["tool_calls"] == 1 and record["num_turns"] == 3


def test_template_variables_reach_the_next_generation_prompt(tmp_path: Path) -> None:
    """A Qwen3-style template with enable_thinking=false: the environment's text ends with the empty
    think block the template writes after the generation prompt, as the whole conversation does. (The
    whole conversation's earlier assistant turns lack that block, which the policy saw in its prompt:
    only what follows the policy's turn can be compared.)"""
    from transformers import AutoTokenizer

    from tests.unit.test_data_chat_tools import QWEN3_STYLE_TEMPLATE

    model_dir = make_chat_tokenizer("qwen2", tmp_path)
    (model_dir / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE, encoding="utf-8")
    tokenizer = load_tokenizer(model_dir)
    assert isinstance(tokenizer, HFTokenizer)
    first = call("calculator", expression="6 * 7")
    config = MultiTurnConfig()
    tools = {"calculator": Calculator({}, CALCULATOR)}
    with ToolAgent(config, tokenizer, tools, [{}], template_variables={"enable_thinking": False}) as agent:
        future = agent.episode(0, 0).after_turn(policy_turn(tokenizer, first))
        assert future is not None
        environment = future.result(timeout=10).token_ids
    conversation = [*USER, {"role": "assistant", "content": first}, {"role": "tool", "content": "42"}]
    reference = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, enable_thinking=False
    )["input_ids"]
    text = tokenizer.decode(environment)
    assert tokenizer.decode(reference).endswith(f"{first}<|im_end|>{text}")
    assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class RewardFails(BaseTool):
    def execute(self, instance_id: str, parameters: dict, **kwargs: Any):
        return "ok", None, {}

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        raise ValueError("no ground truth")


class RewardHangs(RewardFails):
    gate = threading.Event()

    def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        self.gate.wait(30)
        return 1.0


def test_close_counts_a_failing_or_hanging_reward_and_returns(tokenizer) -> None:
    tools = {"fails": RewardFails({}, schema("fails")), "hangs": RewardHangs({}, schema("hangs"))}
    with make_agent(tokenizer, tools, tool_timeout_s=0.3) as agent:
        episode = agent.episode(0, 0)
        future = episode.after_turn(policy_turn(tokenizer, call("fails") + call("hangs")))
        assert future is not None and future.result(timeout=10)
        record = episode.close().result()
        RewardHangs.gate.set()
    assert record["tool_rewards"] == {"fails": 0.0, "hangs": 0.0}
    assert record["tool_errors"]["exception"] == 1 and record["tool_errors"]["timeout"] == 1
    assert record["tool_call_rewards"] == []  # execute returned no reward


def test_a_turn_ended_by_another_stop_token_gets_the_templates_turn_end_from_the_environment(tokenizer) -> None:
    with make_agent(tokenizer, {"calculator": Calculator({}, CALCULATOR)}) as agent:
        after_im_end = agent.messages.text(["7"], stop_text="<|im_end|>")
        after_eos = agent.messages.text(["7"], stop_text="<|endoftext|>")
    assert after_im_end == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert after_eos == "<|im_end|>" + after_im_end


def test_a_call_past_its_timeout_gives_its_place_to_the_next() -> None:
    """With every worker held by a hung call, the calls queued behind them used to wait, with no timer,
    until one returned: the step stalled. Now the hung call's place goes to the next at its timeout;
    its thread is a daemon, so it holds up no exit either."""
    workers = ToolWorkers(1, "test-tool")
    gate, timed_out = threading.Event(), threading.Event()
    hung = workers.submit(lambda: gate.wait(30) and "late", 0.2, timed_out.set)
    started = time.perf_counter()
    assert workers.submit(lambda: "quick", 0.2).result(timeout=10) == "quick"
    waited = time.perf_counter() - started
    assert timed_out.is_set() and not hung.done() and 0.15 < waited < 5
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-tool"))
    gate.set()
    assert hung.result(timeout=10) == "late"  # it finishes in the background, and is read if wanted
    workers.shutdown()
    with pytest.raises(RuntimeError, match="test-tool: submitted after shutdown"):
        workers.submit(lambda: None, 1.0)


def test_at_most_the_workers_run_at_once() -> None:
    workers = ToolWorkers(2, "test-tool")
    lock, running, most = threading.Lock(), [0], [0]

    def call() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    for future in [workers.submit(call, 10.0) for _ in range(6)]:
        future.result(timeout=10)
    assert most[0] == 2


def test_a_chat_template_that_writes_no_tools_is_warned_of(tmp_path: Path) -> None:
    """A template that writes each message by its role and reads no ``tools`` (as ChatML templates of
    models not tuned for tools do): the model would never be told of them, make no call, and every
    trajectory would end after one turn, with only multi_turn/tool_calls/mean = 0 to show it. A
    warning, not an error: a model trained to call a tool without its schema (the built-in arithmetic
    tool task's) does call it."""
    model_dir = make_chat_tokenizer("qwen2", tmp_path)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tools = {"calculator": Calculator({}, CALCULATOR)}
    warning = AgentParts(tools, {}).unrendered_tools_warning(load_tokenizer(model_dir))
    assert warning is not None and "the chat template writes nothing of the tools' schemas into the prompt" in warning
    assert (
        AgentParts(tools, {}).unrendered_tools_warning(
            load_tokenizer(make_chat_tokenizer("qwen25_tools", tmp_path / "q"))
        )
        is None
    )


def test_a_call_that_raises_is_answered_as_an_exception() -> None:
    """A call's own bug (outside the tool's try) used to leave its slot unanswered, once the timer was
    cancelled, and the turn's Future never resolved: the engine waited forever."""
    workers = ToolWorkers(2, "test-tool")

    def boom() -> CallOutcome:
        raise KeyError("bug")

    turn = gather_calls(
        workers,
        [lambda: CallOutcome("fine"), boom],
        5.0,
        lambda i: CallOutcome("timed out", "timeout"),
        lambda outcomes: [(o.text, o.error) for o in outcomes],
    )
    assert turn.result(timeout=10) == [("fine", None), ("Error: KeyError('bug')", "exception")]


def test_trajectories_that_end_together_close_side_by_side(tokenizer) -> None:
    """Each trajectory's close waits at most tool_timeout_s for its tools' rewards, and the engine's
    TP peers wait on all of them: closed one after another, k trajectories with a hanging reward took
    k timeouts, past the distributed timeout that tool_timeout_s is checked against. Now the engine
    starts every close before it reads any, and each resolves within one timeout of its start, even
    with fewer workers than calls (those still queued are answered as timed out)."""

    class Hangs(RewardHangs):
        gate = threading.Event()

    tools = {"hangs": Hangs({}, schema("hangs"))}
    with make_agent(tokenizer, tools, tool_timeout_s=0.5, tool_workers=2) as agent:
        episodes = [agent.episode(0, sample) for sample in range(6)]
        for episode in episodes:
            future = episode.after_turn(policy_turn(tokenizer, call("hangs")))
            assert future is not None and future.result(timeout=10)
        started = time.perf_counter()
        closing = [episode.close() for episode in episodes]
        records = [record.result(timeout=10) for record in closing]
        waited = time.perf_counter() - started
        Hangs.gate.set()
    assert all(r["tool_rewards"] == {"hangs": 0.0} and r["tool_errors"]["timeout"] == 1 for r in records)
    assert 0.4 < waited < 2.0  # one after another: 6 x 0.5 s


def test_a_deadline_answers_the_calls_still_queued() -> None:
    """With one worker held by a hung call, the call queued behind it starts only at the first's
    timeout (5 s here); the gather's deadline answers both at 0.2 s."""
    workers = ToolWorkers(1, "test-tool")
    gate = threading.Event()
    turn = gather_calls(
        workers,
        [lambda: CallOutcome("late" if gate.wait(30) else ""), lambda: CallOutcome("queued")],
        5.0,
        lambda i: CallOutcome(f"call {i} timed out", "timeout"),
        lambda outcomes: [o.text for o in outcomes],
        deadline_s=0.2,
    )
    assert turn.result(timeout=3) == ["call 0 timed out", "call 1 timed out"]
    gate.set()
    workers.shutdown()


def test_calls_are_refused_while_too_many_hung_ones_still_run(capsys) -> None:
    """Python cannot stop a thread: a tool that always hangs grew one thread per call, without bound.
    Past max_hung such threads a call fails at once (the model is answered with the error, counted
    as an exception), with one warning; once the hung calls return, calls run again."""
    workers = ToolWorkers(1, "test-tool", max_hung=2)
    gate = threading.Event()
    hung = [workers.submit(lambda: gate.wait(30), 0.05) for _ in range(2)]
    refused = [workers.submit(lambda: "ran", 10.0) for _ in range(2)]
    for future in refused:
        with pytest.raises(HungCallsError, match="2 earlier calls still run past their timeout"):
            future.result(timeout=10)
    assert capsys.readouterr().err.count("WARNING: test-tool: call not started") == 1
    gate.set()
    assert all(future.result(timeout=10) for future in hung)
    assert workers.submit(lambda: "ran", 10.0).result(timeout=10) == "ran"
    workers.shutdown()
