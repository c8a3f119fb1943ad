"""The built-in tool task: 3-digit multiplication with a calculator the policy may call.

A 0.8M-parameter model cannot multiply 3-digit numbers, but it can copy: the problem's expression
into a calculator call, and the calculator's result into its answer. A trajectory (Hermes tool
calls, as Qwen2.5 writes them; the task's chat template renders it)::

    prompt      "Q: 347*128=? A:"                                           user: "347*128"
    policy      " <tool_call>{"name": "calculator", "arguments": {"expression": "347*128"}}</tool_call></s>"
    tool        "<tool_response>44416</tool_response>"                       tool: "44416"
    policy      " #### 44416</s>"

or, answered directly, ``" 347*128 #### 44416</s>"``. Every assistant turn starts with a space and ends with
EOS; the chat template writes no BOS (the loaders prepend it) and no generation prompt, so a tool
message rendered on its own is exactly the tokens the engine appends after a call. The trajectory's
text, special tokens skipped, is well formed for ``arithmetic.judge``: the call and the tool
response hold no ``#`` and stand where the worked steps stand in the arithmetic task, so the rule
reward ``arithmetic_answer`` scores this task unchanged.

The teacher of the SFT set calls the tool on a share ``tool_rate`` of the problems (by a hash of
the problem) and answers directly on the others, with the right answer that the model cannot
learn to compute. Both ways start by copying the expression, so the choice is one token: the
call's tag or the expression's first digit, which the model copies with certainty. The SFT model
gives the tag about ``tool_rate``: below one half, it hardly ever calls the tool when it decodes
greedily (had the direct answer started with the answer's first digit, nine digits would share
the direct answers' mass, and the greedy choice would swing with how well the model guesses that
digit), while sampling calls it often enough for RL to find that the calls earn the reward.

The tokenizer (``write_tokenizer``, an HF ``tokenizer.json``, which carries the chat template)
spells text character by character and has one token for each fixed string of the format: the
four tool tags, the JSON around the expression, ``"Q: "``, ``"=? A:"`` and ``" #### "``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_rlhf.tasks.arithmetic import ANSWER_MARKER, ArithmeticSpec, Problem, make_problems

TOOL_NAME = "calculator"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
CALL_PREFIX = f'{{"name": "{TOOL_NAME}", "arguments": {{"expression": "'
"""The call's JSON up to the expression, as ``json.dumps`` writes it (one token)."""
CALL_SUFFIX = '"}}'
PROMPT_OPEN, PROMPT_CLOSE = "Q: ", "=? A:"
FORMAT_TOKENS = (
    CALL_OPEN,
    CALL_CLOSE,
    RESPONSE_OPEN,
    RESPONSE_CLOSE,
    CALL_PREFIX,
    CALL_SUFFIX,
    PROMPT_OPEN,
    PROMPT_CLOSE,
    f" {ANSWER_MARKER} ",
)
"""Fixed strings of the format that the tokenizer keeps whole (added tokens, not special: they are
text, which the tool-call parser and the judge read)."""
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHARACTERS = tuple(chr(c) for c in range(0x20, 0x7F))
"""Printable ASCII, one token each: task text, and any tool error message, has no unknown character."""
TOKENIZER_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS) + len(FORMAT_TOKENS)

TASK = ArithmeticSpec(ops=("*",), digits=3, seed=0)
"""The level: products of two operands below 1000 (answers up to 6 digits)."""

# Every assistant turn: a space, its text, its Hermes tool calls, EOS. Tool messages: the result
# between the response tags. No BOS, no generation prompt (see the module docstring).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{{ 'Q: ' + message.content + '=? A:' }}"
    "{% elif message.role == 'assistant' %}"
    "{{ ' ' + (message.content or '') }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set call = call.function if call.function is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' }}"
    "{{ call.arguments if call.arguments is string else call.arguments | tojson }}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<tool_response>' + message.content + '</tool_response>' }}"
    "{% else %}"
    "{{ raise_exception('the arithmetic tool task has user, assistant and tool messages, not ' + message.role) }}"
    "{% endif %}"
    "{% endfor %}"
)


def expression(problem: Problem) -> str:
    """``347*128``: the user message, the calculator's argument, and the direct answer's restatement."""
    return f"{problem.a}{problem.op}{problem.b}"


def user_message(problem: Problem) -> dict[str, str]:
    return {"role": "user", "content": expression(problem)}


def calls_tool(problem: Problem, tool_rate: float, seed: int) -> bool:
    """Whether the teacher calls the calculator on ``problem``: deterministic in (seed, problem)."""
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate={tool_rate!r}: expected a probability in [0, 1]")
    return random.Random(f"tool:{seed}:{expression(problem)}").random() < tool_rate


def teacher_messages(problem: Problem, tool_rate: float, seed: int) -> list[dict[str, Any]]:
    """The teacher's conversation in HF chat format (tool calls as ``tool_calls``)."""
    if not calls_tool(problem, tool_rate, seed):
        return [
            user_message(problem),
            {"role": "assistant", "content": f"{expression(problem)} {ANSWER_MARKER} {problem.answer}"},
        ]
    arguments = {"expression": expression(problem)}
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
    return [
        user_message(problem),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(problem.answer)},
        {"role": "assistant", "content": f"{ANSWER_MARKER} {problem.answer}"},
    ]


def sft_rows(problems: Iterable[Problem], tool_rate: float, seed: int) -> list[dict[str, Any]]:
    """Conversation rows (``messages``) for ``megatron-rlhf sft``: the SFT loss covers the teacher's
    own turns only, never the tool's result, which the model cannot compute and which RL never
    samples."""
    return [{"messages": teacher_messages(p, tool_rate, seed)} for p in problems]


def prompt_rows(problems: Iterable[Problem]) -> list[dict[str, Any]]:
    """Chat prompts (one user message) with the ``answer`` column, for RL and held-out tests."""
    return [{"prompt": [user_message(p)], "answer": str(p.answer)} for p in problems]


def problems(split: str, count: int) -> list[Problem]:
    return make_problems(TASK, split, count)


def write_tokenizer(out_dir: str | Path, model_max_length: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with ``CHAT_TEMPLATE``) into
    ``out_dir``: read alike by ``load_tokenizer`` and by transformers' ``AutoTokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    specials = list(SPECIAL_TOKENS.values())
    vocab = {token: i for i, token in enumerate([*specials, *CHARACTERS])}
    # No merges and no pre-tokenizer: one token per character, besides the added tokens.
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == TOKENIZER_VOCAB_SIZE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **SPECIAL_TOKENS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
