"""A rollout's scores: the reward model, rule functions and a verl ``compute_score`` function, each
weighted, plus DAPO's soft over-long penalty.

    score = sum over parts p of weights[p] * part_p          (the raw score; dynamic sampling reads it)
    reward = score + overlong penalty                         (what the advantages see, before KL)

Parts are named ``reward_model``, each rule by its name in ``scoring.rules``, and ``custom_function``;
a part without a weight has weight 1. Rules and the custom function run on a 1/world share of the
samples per rank and are gathered; the reward model scores every row in its own layout.

``Scorer.start`` runs this rank's share of the rules and the function (decoding, then plain
Python) on a host thread and returns at once, so that the trainer queues the reference and value
passes on the GPU meanwhile; ``PendingScores.result()`` gathers the shares and runs the reward
model's pass.

The response text a rule or function reads has no trailing end-of-sequence token (verl decodes
responses with special tokens skipped); the token ids are untouched.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.config.fields import at_least
from megatron_rlhf.engine.objectives import values_output
from megatron_rlhf.engine.schedule import Batch
from megatron_rlhf.engine.train import forward_all_rows
from megatron_rlhf.metrics.log import snake_case
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.rollout.engine import Completion

from .custom import CustomFunctionConfig, CustomRewardFunction, load_custom_function, metric_means
from .rules import RewardRule, Sample, resolve_rule, rule_scores

REWARD_MODEL, CUSTOM_FUNCTION, OVERLONG = "reward_model", "custom_function", "overlong_penalty"


@dataclasses.dataclass(kw_only=True)
class OverlongConfig:
    """DAPO's soft over-long punishment (Yu et al. 2025, Eq. 13): a response longer than
    max_new_tokens - buffer loses penalty x (length - (max_new_tokens - buffer)) / buffer."""

    buffer: int = 0
    """Tokens before max_new_tokens where the penalty ramps up linearly; 0: off."""
    penalty: float = 1.0
    """The penalty at max_new_tokens."""

    def errors(self) -> list[str]:
        return at_least(self, 0, "buffer", "penalty")


@dataclasses.dataclass(kw_only=True)
class ScoringConfig:
    """How a response's scalar reward is made (see the module docstring)."""

    use_reward_model: bool = False
    """Score with the reward model (``reward.path``); false (verl's default): no reward model is built."""
    rules: list[str] = dataclasses.field(default_factory=list)
    """Rule names (exact_answer, lowercase_fraction) or import paths ``package.module:function``."""
    custom_function: CustomFunctionConfig = dataclasses.field(default_factory=CustomFunctionConfig)
    """A verl ``compute_score`` function loaded from a file."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """Weight of each part: reward_model, a rule's name, custom_function (e.g. {reward_model: 0.7,
    exact_answer: 0.3}); a part not named has weight 1."""
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)

    def errors(self) -> list[str]:
        return [f"weights.{name}={value} must be a finite number" for name, value in self.weights.items()
                if not math.isfinite(value)]  # fmt: skip

    def parts(self) -> list[str]:
        """The names of the configured parts, in scoring order."""
        return (([REWARD_MODEL] if self.use_reward_model else []) + list(self.rules)
                + ([CUSTOM_FUNCTION] if self.custom_function.path else []))  # fmt: skip


def scoring_errors(cfg: ScoringConfig) -> tuple[list[str], dict[str, RewardRule], CustomRewardFunction | None]:
    """The problems of ``scoring`` that need its rules and function loaded; and those."""
    errors: list[str] = []
    rules: dict[str, RewardRule] = {}
    for name in cfg.rules:
        try:
            rules[name] = resolve_rule(name)
        except ValueError as err:
            errors.append(f"scoring.rules: {err}")
    function = None
    if cfg.custom_function.path:
        try:
            function = load_custom_function(cfg.custom_function.path, cfg.custom_function.name)
        except ValueError as err:
            errors.append(str(err))
    metric_of: dict[str, str] = {}
    for name in cfg.rules:
        other = metric_of.setdefault(snake_case(name), name)
        if other != name:
            errors.append(f"scoring.rules: {other!r} and {name!r} would both be logged as reward/rule/{snake_case(name)}; "
                          "give one of them another name")  # fmt: skip
    parts = cfg.parts()
    if not parts:
        errors.append("nothing scores the responses: set scoring.use_reward_model=true, give scoring.rules=[...] "
                      "or scoring.custom_function.path=FILE")  # fmt: skip
    errors += [f"scoring.weights.{name}: no such part; the parts are {parts}" for name in cfg.weights if name not in parts]
    return errors, rules, function


@dataclasses.dataclass
class Scores:
    """The scores of a batch of completions, row by row."""

    raw: torch.Tensor
    """(B,) weighted sum of the parts: what dynamic sampling compares within a group."""
    rewards: torch.Tensor
    """(B,) raw plus the over-long penalty: what the advantages see (before any KL penalty)."""
    parts: dict[str, torch.Tensor]
    """(B,) each part's unweighted score (and ``overlong_penalty`` when on), by part name."""
    custom_metrics: dict[str, float]
    """The reward function's other numeric keys, averaged."""

    def select(self, rows: torch.Tensor) -> "Scores":
        return Scores(self.raw[rows], self.rewards[rows], {k: v[rows] for k, v in self.parts.items()},
                      self.custom_metrics)  # fmt: skip

    @staticmethod
    def cat(pieces: Sequence["Scores"]) -> "Scores":
        return Scores(torch.cat([p.raw for p in pieces]), torch.cat([p.rewards for p in pieces]),
                      {k: torch.cat([p.parts[k] for p in pieces]) for k in pieces[0].parts},
                      pieces[0].custom_metrics)  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """The mean of each part: reward/reward_model, reward/rule/<name>, reward/custom_function, ..."""
        named = {(k if k in (REWARD_MODEL, CUSTOM_FUNCTION, OVERLONG) else f"rule/{snake_case(k)}"): v
                 for k, v in self.parts.items()}  # fmt: skip
        return {f"reward/{k}": float(v.mean()) for k, v in named.items()} | {
            f"reward/custom/{k}": v for k, v in self.custom_metrics.items()}  # fmt: skip


class Scorer:
    """Scores completions as ``ScoringConfig`` says; collective over the world."""

    def __init__(self, cfg: ScoringConfig, rules: dict[str, RewardRule], function: CustomRewardFunction | None,
                 reward_model: RoleModel | None, *, stop_ids: Sequence[int], max_new_tokens: int,
                 max_tokens_per_micro_batch: int, pack_sequences: bool = True) -> None:  # fmt: skip
        self.cfg, self.rules, self.function, self.reward_model = cfg, rules, function, reward_model
        self.stop_ids, self.max_new_tokens = set(stop_ids), max_new_tokens
        self.max_tokens_per_micro_batch, self.pack_sequences = max_tokens_per_micro_batch, pack_sequences
        self._thread: ThreadPoolExecutor | None = None  # made at the first ``start`` with rules

    def samples(self, completions: Sequence[Completion], decode_batch: Callable[[list[list[int]]], list[str]],
                extras: Sequence[dict[str, Any]] | None = None) -> list[Sample]:  # fmt: skip
        """The completions as rules read them (``extras[c.prompt_index]`` the prompt row's extra
        columns, none if not given), decoded by one ``decode_batch`` call (a tokenizer's): each
        prompt once, not once per sample of it, and every response."""
        prompts = {c.prompt_index: c.prompt_ids for c in completions}
        texts = decode_batch([*prompts.values(), *(c.text_ids(self.stop_ids) for c in completions)])
        prompt_texts = dict(zip(prompts, texts))
        return [Sample(c.prompt_ids, c.token_ids, prompt_texts[c.prompt_index], response, c.finish_reason,
                       extras[c.prompt_index] if extras is not None else {})
                for c, response in zip(completions, texts[len(prompts):])]  # fmt: skip

    def reward_model_scores(self, batch: Batch) -> torch.Tensor:
        """(rows,) the reward model's score of each row: its output at the row's last token."""
        assert self.reward_model is not None
        values = forward_all_rows(self.reward_model, {k: batch[k] for k in ("input_ids", "attention_mask")},
                                  values_output(), max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
                                  pack_sequences=self.pack_sequences)  # fmt: skip
        return values[torch.arange(len(values)), batch["lengths"] - 1]

    def score(self, batch: Batch, completions: list[Completion], extras: list[dict[str, Any]],
              decode_batch: Callable[[list[list[int]]], list[str]]) -> Scores:
        """Every part of every row (``extras[c.prompt_index]`` is the prompt row of completion c)."""
        return self.start(batch, completions, extras, decode_batch).result()

    def start(self, batch: Batch, completions: list[Completion], extras: list[dict[str, Any]],
              decode_batch: Callable[[list[list[int]]], list[str]]) -> "PendingScores":
        """``score``, begun: this rank's share of the rules and the custom function runs on a host
        thread (``decode_batch`` must not be called elsewhere until ``result()``)."""
        share = None
        if self.rules or self.function is not None:
            rank, world = dist.get_rank(), dist.get_world_size()
            if self._thread is None:
                self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scoring")
            share = self._thread.submit(self._share_scores, completions[rank::world], extras, decode_batch)
        return PendingScores(self, batch, completions, share)

    def _share_scores(self, completions: list[Completion], extras: list[dict[str, Any]],
                      decode_batch: Callable[[list[list[int]]], list[str]]) -> tuple[dict[str, list[float]], Any]:  # fmt: skip
        """The rules' and the custom function's scores of ``completions`` (this rank's share)."""
        mine = self.samples(completions, decode_batch, extras)
        local = rule_scores(self.rules, mine)
        custom = self.function.score(mine) if self.function is not None else None
        if custom is not None:
            local[CUSTOM_FUNCTION] = custom.scores
        return local, custom

    def _combine(self, batch: Batch, completions: list[Completion], share: Future | None) -> Scores:
        parts: dict[str, torch.Tensor] = {}
        custom_metrics: dict[str, float] = {}
        if self.reward_model is not None:
            parts[REWARD_MODEL] = self.reward_model_scores(batch)
        if share is not None:
            local, custom = share.result()  # re-raises what the thread raised
            world = dist.get_world_size()
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (local, custom))
            for name in local:
                column = torch.empty(len(completions))
                for r, (part, _) in enumerate(gathered):
                    column[r::world] = torch.tensor(part[name])
                parts[name] = column
            if custom is not None:
                custom_metrics = metric_means([c for _, c in gathered])
        raw = sum(self.cfg.weights.get(name, 1.0) * value for name, value in parts.items())
        rewards = raw
        if self.cfg.overlong.buffer:
            parts[OVERLONG] = self.overlong_penalty(torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32))
            rewards = raw + parts[OVERLONG]
        return Scores(raw, rewards, parts, custom_metrics)

    def overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) <= 0: 0 up to max_new_tokens - buffer, then linear down to -penalty at max_new_tokens."""
        over = self.cfg.overlong
        start = self.max_new_tokens - over.buffer
        return -over.penalty * ((lengths - start).clamp(min=0) / over.buffer).clamp(max=1.0)


@dataclasses.dataclass
class PendingScores:
    """Scores begun by ``Scorer.start``."""

    scorer: Scorer
    batch: Batch
    completions: list[Completion]
    share: Future | None  # this rank's rule and function scores, on the scorer's thread

    def result(self) -> Scores:
        """Waits for this rank's share, gathers every rank's, and runs the reward model's pass.
        Collective over the world."""
        return self.scorer._combine(self.batch, self.completions, self.share)
