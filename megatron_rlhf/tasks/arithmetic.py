"""The built-in verifiable task: integer arithmetic with exact answers, made here (no download).

Prompt format (fixed; anyone can score a model with transformers alone)::

    prompt    "Q: 37+48=? A:"
    response  " 85"                                    plain
    response  " 7+8=15, 3+4+1=8 #### 85"               with worked steps, then the answer marker

A response is well formed when, trailing whitespace removed, it is one space, optionally worked
steps (no ``#``) followed by `` #### ``, then the answer as a canonical integer (``0``, ``-15``,
``1776``; no leading zeros, no ``-0``). Only the final answer is checked, never the steps.
Operands are non-negative integers below ``10**digits``; subtraction may give a negative answer.

Problems go to the train / validation / test split by a hash of (seed, problem), so the splits
never share a problem whatever the counts asked for, a problem keeps its split at every level
(``ArithmeticSpec``), and a split's rows depend only on the seed.

Also here: the task's SentencePiece tokenizer (``write_tokenizer``), scoring of generated
completions (``completion_verdicts``) and reward-model pairs from a policy's own samples
(``preference_pairs``). The rule rewards are ``arithmetic_answer`` and ``arithmetic_format``
(``rewards/rules.py``); the built-in data sets ``builtin:arithmetic-*`` (``data/builtin.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

OPS = ("+", "-", "*")
SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "test": 0.1}
ANSWER_MARKER = "####"
_RESPONSE = re.compile(rf"^ (?:[^#]*[^#\s] {ANSWER_MARKER} )?(?P<answer>0|-?[1-9][0-9]*)\s*$")

Verdict = Literal["right", "wrong", "malformed"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """``a op b`` with non-negative operands."""

    a: int
    op: str
    b: int

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Problem.op={self.op!r}: expected one of {OPS}")
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Problem.{name}={value!r}: expected a non-negative int")

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b

    @property
    def prompt(self) -> str:
        return f"Q: {self.a}{self.op}{self.b}=? A:"

    def response(self, steps: bool = False) -> str:
        """The demonstration: the answer alone, or worked steps then the answer marker."""
        return f" {worked_steps(self)} {ANSWER_MARKER} {self.answer}" if steps else f" {self.answer}"


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    """A difficulty level: which operations, operands below ``10**digits``, and the split seed."""

    ops: tuple[str, ...] = ("+", "-")
    digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.ops or any(op not in OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithmeticSpec.ops={self.ops!r}: expected distinct operations from {OPS}")
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"ArithmeticSpec.digits={self.digits!r}: expected an int from 1 to 9")

    @property
    def num_problems(self) -> int:
        """Distinct problems of this level, over all splits."""
        return len(self.ops) * 10 ** (2 * self.digits)


# --------------------------------------------------------------------------- worked steps


def _digits(n: int) -> list[int]:
    """Decimal digits, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _column_add(a: int, b: int, slip: Callable[[], bool]) -> tuple[list[str], int]:
    """Columns of ``a + b``, right to left, and the sum they spell. A carry the writer ``slip``s on
    is dropped: left out of the next column's step and of the result."""
    da, db = _digits(a), _digits(b)
    steps, carry, result = [], 0, 0
    for i in range(max(len(da), len(db))):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        if carry and slip():
            carry = 0
        total = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}")
        result += total % 10 * 10**i
        carry = total // 10
    return steps, result + carry * 10 ** max(len(da), len(db))


def _column_sub(a: int, b: int, slip: Callable[[], bool]) -> tuple[list[str], int]:
    """Columns of ``a - b`` for ``a >= b`` and the difference they spell: ``12-7=5`` borrows,
    ``5-1-3=1`` pays the borrow back; a borrow the writer ``slip``s on is never paid back."""
    da, db = _digits(a), _digits(b)
    steps, borrow, result = [], 0, 0
    for i in range(len(da)):
        x, y = da[i], db[i] if i < len(db) else 0
        if borrow and slip():
            borrow = 0
        new_borrow = int(x - borrow - y < 0)
        value = x + 10 * new_borrow - borrow - y
        steps.append(f"{x + 10 * new_borrow}" + (f"-{borrow}" if borrow else "") + f"-{y}={value}")
        result += value * 10**i
        borrow = new_borrow
    return steps, result


def _partial_products(a: int, b: int) -> tuple[list[str], int]:
    """``a`` times each non-zero digit of ``b`` in place, then the running sum of the partials."""
    places = [(d, i) for i, d in enumerate(_digits(b)) if d] or [(0, 0)]
    partials = [a * d * 10**i for d, i in places]
    steps = [f"{a}*{d}{'0' * i}={p}" for (d, i), p in zip(places, partials, strict=True)]
    total = partials[0]
    for p in partials[1:]:
        steps.append(f"{total}+{p}={total + p}")
        total += p
    return steps, total


def _never() -> bool:
    return False


def work(problem: Problem, slip: Callable[[], bool] = _never) -> tuple[str, int]:
    """Worked steps (column by column, right to left, for + and -; partial products for *) and the
    answer they lead to: the right one unless ``slip`` made the writer drop a carry or a borrow."""
    a, op, b = problem.a, problem.op, problem.b
    if op == "+":
        steps, result = _column_add(a, b, slip)
    elif op == "*":
        steps, result = _partial_products(a, b)
    elif a >= b:
        steps, result = _column_sub(a, b, slip)
    else:
        steps, result = _column_sub(b, a, slip)
        steps, result = [f"{a}-{b}=-({b}-{a})", *steps], -result
    return ", ".join(steps), result


def worked_steps(problem: Problem) -> str:
    """The right worked steps of ``problem``."""
    return work(problem)[0]


def sloppy_response(problem: Problem, slip_rate: float, seed: int) -> str:
    """A demonstration by a careless teacher who drops each carry or borrow with probability
    ``slip_rate`` and writes the answer its steps lead to. The built-in SFT set is written this way
    on purpose: imitation learns the slips too, and only a reward that checks the answer can
    remove them (the room the RL stages of the pipeline take). Deterministic in (seed, problem)."""
    if not 0.0 <= slip_rate <= 1.0:
        raise ValueError(f"slip_rate={slip_rate!r}: expected a probability in [0, 1]")
    rng = random.Random(f"{seed}:{problem.a}{problem.op}{problem.b}")
    steps, result = work(problem, lambda: rng.random() < slip_rate)
    return f" {steps} {ANSWER_MARKER} {result}"


# --------------------------------------------------------------------------- splits


def split_of(problem: Problem, seed: int) -> str:
    """The split a problem belongs to under ``seed`` (a hash, so splits are disjoint by construction)."""
    digest = hashlib.blake2b(f"{seed}:{problem.a}{problem.op}{problem.b}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    for split in SPLITS:
        u -= SPLIT_FRACTIONS[split]
        if u < 0:
            return split
    return SPLITS[-1]


def make_problems(spec: ArithmeticSpec, split: str, count: int) -> list[Problem]:
    """``count`` distinct problems of ``split``, drawn uniformly (operation, then operands), in a
    fixed order for (spec, split); asking for more than half the split's share is an error."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    available = int(spec.num_problems * SPLIT_FRACTIONS[split])
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= available // 2:
        raise ValueError(
            f"count={count!r} {split} problems of {spec}: expected 0..{available // 2} "
            f"(half the about {available} problems of the split; raise digits or add ops)"
        )
    rng = random.Random(f"{spec.seed}:{split}:{','.join(spec.ops)}:{spec.digits}")
    high = 10**spec.digits - 1
    seen: set[Problem] = set()
    problems: list[Problem] = []
    while len(problems) < count:
        problem = Problem(rng.randint(0, high), rng.choice(spec.ops), rng.randint(0, high))
        if problem not in seen and split_of(problem, spec.seed) == split:
            seen.add(problem)
            problems.append(problem)
    return problems


# --------------------------------------------------------------------------- rows and scoring


def sft_rows(
    problems: Iterable[Problem], steps: bool = False, *, slip_rate: float = 0.0, seed: int = 0
) -> list[dict[str, str]]:
    """``prompt``/``response`` rows for ``megatron-rlhf sft``; with ``slip_rate`` > 0, worked steps
    by the careless teacher (``sloppy_response``)."""
    if slip_rate:
        return [{"prompt": p.prompt, "response": sloppy_response(p, slip_rate, seed)} for p in problems]
    return [{"prompt": p.prompt, "response": p.response(steps)} for p in problems]


def prompt_rows(problems: Iterable[Problem]) -> list[dict[str, str]]:
    """``prompt`` rows with the ``answer`` column (a string) for RL (``data.extra_keys=[answer]``)
    and for held-out evaluation."""
    return [{"prompt": p.prompt, "answer": str(p.answer)} for p in problems]


def parse_answer(response: str) -> int | None:
    """The final answer of a well-formed response (see the module docstring), else None."""
    match = _RESPONSE.match(response)
    return int(match["answer"]) if match else None


def judge(response: str, answer: int | str, *, finished: bool = True) -> Verdict:
    """right / wrong (well formed, another number) / malformed; a response that did not finish
    (cut at max_new_tokens: no EOS) is malformed whatever its text."""
    try:
        expected = int(answer)
    except ValueError:
        raise ValueError(f"answer={answer!r}: expected an integer (the 'answer' column of prompt_rows)") from None
    value = parse_answer(response) if finished else None
    if value is None:
        return "malformed"
    return "right" if value == expected else "wrong"


def completion_verdicts(
    prompts: Sequence[Mapping[str, Any]], completions: Sequence[Mapping[str, Any]]
) -> tuple[list[list[str]], list[list[Verdict]]]:
    """Each prompt's sampled responses and their verdicts, from ``prompt_rows`` and the rows
    ``megatron-rlhf generate`` writes (``prompt_index``, ``text``, ``finish_reason``)."""
    responses: list[list[str]] = [[] for _ in prompts]
    verdicts: list[list[Verdict]] = [[] for _ in prompts]
    for i, row in enumerate(completions):
        missing = [k for k in ("prompt_index", "text", "finish_reason") if k not in row]
        if missing:
            raise ValueError(f"completion {i}: no {missing} (expected rows of megatron-rlhf generate)")
        index = row["prompt_index"]
        if not 0 <= index < len(prompts):
            raise ValueError(f"completion {i}: prompt_index={index} outside the {len(prompts)} prompts")
        if "answer" not in prompts[index]:
            raise ValueError(f"prompt {index}: no 'answer' column (expected rows of prompt_rows)")
        responses[index].append(row["text"])
        verdicts[index].append(judge(row["text"], prompts[index]["answer"], finished=row["finish_reason"] == "stop"))
    return responses, verdicts


def verdict_rates(verdicts: Sequence[Sequence[Verdict]]) -> dict[str, float]:
    """Share of right / wrong / malformed responses over all samples (right: the accuracy)."""
    flat = [v for group in verdicts for v in group]
    if not flat:
        raise ValueError("no verdicts to count")
    return {"samples": len(flat), **{v: flat.count(v) / len(flat) for v in ("right", "wrong", "malformed")}}


def preference_pairs(
    prompts: Sequence[str],
    responses: Sequence[Sequence[str]],
    verdicts: Sequence[Sequence[Verdict]],
    *,
    seed: int,
    pairs_per_prompt: int = 1,
) -> list[dict[str, str]]:
    """Reward-model rows ``prompt``/``chosen``/``rejected`` from a policy's own samples: chosen is
    a right response, rejected a wrong or malformed one of the same prompt.

    A blank response (EOS at once) is never used: the trainers' loaders refuse empty text. Only
    prompts with at least one right and one other response give pairs; each gives up to
    ``pairs_per_prompt`` distinct (chosen, rejected) texts, drawn by a generator seeded with
    (seed, prompt index), so the rows depend only on the inputs and the seed.
    """
    if len(responses) != len(prompts) or len(verdicts) != len(prompts):
        raise ValueError(
            f"{len(prompts)} prompts but {len(responses)} response groups and "
            f"{len(verdicts)} verdict groups: expected one group of each per prompt"
        )
    if isinstance(pairs_per_prompt, bool) or not isinstance(pairs_per_prompt, int) or pairs_per_prompt < 1:
        raise ValueError(f"pairs_per_prompt={pairs_per_prompt!r}: expected an int >= 1")
    rows = []
    for index, (prompt, texts, marks) in enumerate(zip(prompts, responses, verdicts, strict=True)):
        if len(texts) != len(marks):
            raise ValueError(f"prompt {index}: {len(texts)} responses but {len(marks)} verdicts")
        unknown = next((v for v in marks if v not in ("right", "wrong", "malformed")), None)
        if unknown is not None:
            raise ValueError(f"prompt {index}: verdict {unknown!r}, expected right, wrong or malformed")
        right = sorted({t for t, v in zip(texts, marks, strict=True) if v == "right"})
        other = sorted({t for t, v in zip(texts, marks, strict=True) if v != "right" and t.strip()})
        combos = [(c, r) for c in right for r in other]
        rng = random.Random(f"{seed}:{index}")
        for chosen, rejected in rng.sample(combos, min(pairs_per_prompt, len(combos))):
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


# --------------------------------------------------------------------------- tokenizer

TOKENIZER_VOCAB_SIZE = 32
"""Pieces of the task tokenizer: 4 specials, the 23 characters of the task text, 5 merges."""
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def tokenizer_corpus() -> list[str]:
    """Task text the tokenizer is trained on: every operation, 1 to 4 digits, plain and worked
    responses; it holds every character a task row can hold."""
    lines = []
    for digits in (1, 2, 3, 4):
        for op in OPS:
            spec = ArithmeticSpec(ops=(op,), digits=digits)
            for i, problem in enumerate(make_problems(spec, "train", min(200, spec.num_problems * 8 // 20))):
                lines.append(problem.prompt + problem.response(steps=i % 2 == 1))
    return lines


def write_tokenizer(out_dir: str | Path) -> Path:
    """Train the task's SentencePiece BPE model and write ``tokenizer.model`` and
    ``tokenizer_config.json`` into ``out_dir``: read alike, with identical ids, by
    ``load_tokenizer`` and by transformers' ``AutoTokenizer.from_pretrained``.

    Digits are always single pieces (``split_digits``) so numbers are spelled digit by digit; text
    is kept verbatim (no dummy prefix, no whitespace folding) so that a prompt's and a response's
    ids concatenate to the ids of the whole row, and a response decodes with its leading space.
    """
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(tokenizer_corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hard_vocab_limit=True,
        character_coverage=1.0,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        **SPECIAL_TOKENS,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
