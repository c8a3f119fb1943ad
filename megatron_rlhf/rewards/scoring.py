"""A rollout's scores: the reward model, rule functions and a verl ``compute_score`` function, each
weighted, plus DAPO's soft over-long penalty.

    score = sum over parts p of weights[p] * part_p          (the raw score; dynamic sampling reads it)
    reward = score + overlong penalty                         (what the advantages see, before KL)

Parts are named ``reward_model``, each rule by its name in ``scoring.rules``, and ``custom_function``;
a part without a weight has weight 1. Rules and the custom function run on a 1/world share of the
samples per rank and are gathered; the reward model scores every row in its own layout.

``Scorer.start`` runs this rank's share of the rules and the function (decoding, then plain
Python) on a host thread, or split over worker processes (``scoring.workers``, ``workers.py``),
and returns at once, so that the trainer queues the reference and value passes on the GPU
meanwhile; ``PendingScores.result()`` runs the reward model's pass and gathers the shares.

The prompt and response texts a rule or function reads are decoded with special tokens skipped, as
verl decodes them for its reward functions (a ``<|im_start|>`` sampled mid-response is not in the
text), and the response has no final stop token; the token ids are untouched.

The user's code fails the run, never hangs it or ends it quietly: whatever it raises, a call longer
than ``timeout_s`` and a score that is no finite float32 are a ``RewardFunctionError`` naming the
function, its file and the sample (``calls.py``). A share that fails on one rank fails every rank
with that message: each rank's share goes into the same gather, failed or not, so that no rank is
left waiting in it. A stop signal that comes while this rank waits on a call that has not returned
(the trainer's ``interrupted``: ``trainer/stop.py``'s ``stop_requested``) abandons the step on
every rank (``ScoringInterrupted``, through the same gather): the loop saves the step before it and
stops, as a stop at a step boundary does; a second signal ends the process at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.metrics.log import snake_case
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.training.objectives import score_positions, values_output
from megatron_rlhf.training.schedule import Batch
from megatron_rlhf.training.train import forward_all_rows

from .calls import RewardFunctionError, ScoringInterrupted, Watched, formatted
from .config import CUSTOM_FUNCTION, REWARD_MODEL, ScoringConfig
from .custom import CustomRewardFunction, metric_means
from .rules import SCORE_DTYPE, RewardRule, Sample
from .samples import Decoder, Share, decoded_samples, watched_share
from .workers import ScoringWorkers, WorkerShare

PendingShare = Watched[Share] | WorkerShare
"""A rank's share being scored: on the scorer's thread, or in its worker processes."""

OVERLONG = "overlong_penalty"


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

    def select(self, rows: torch.Tensor) -> Scores:
        return Scores(
            self.raw[rows], self.rewards[rows], {k: v[rows] for k, v in self.parts.items()}, self.custom_metrics
        )

    @staticmethod
    def cat(pieces: Sequence[Scores]) -> Scores:
        return Scores(
            torch.cat([p.raw for p in pieces]),
            torch.cat([p.rewards for p in pieces]),
            {k: torch.cat([p.parts[k] for p in pieces]) for k in pieces[0].parts},
            pieces[0].custom_metrics,
        )

    def metrics(self) -> dict[str, float]:
        """The mean of each part: reward/reward_model, reward/rule/<name>, reward/custom_function, ..."""
        named = {
            (k if k in (REWARD_MODEL, CUSTOM_FUNCTION, OVERLONG) else f"rule/{snake_case(k)}"): v
            for k, v in self.parts.items()
        }
        return {f"reward/{k}": float(v.mean()) for k, v in named.items()} | {
            f"reward/custom/{k}": v for k, v in self.custom_metrics.items()
        }


class Scorer:
    """Scores completions as ``ScoringConfig`` says; collective over the world."""

    def __init__(
        self,
        cfg: ScoringConfig,
        rules: dict[str, RewardRule],
        function: CustomRewardFunction | None,
        reward_model: RoleModel | None,
        *,
        stop_ids: Collection[int],
        max_new_tokens: int,
        max_tokens_per_micro_batch: int,
        pack_sequences: bool = True,
        interrupted: Callable[[], bool] | None = None,
        texts: Decoder | None = None,
    ) -> None:
        """``interrupted``: a stop request, watched while this rank waits on reward code (its
        share raises ``ScoringInterrupted`` on every rank when it turns true). ``texts``: what
        worker processes decode with (``reward_texts`` of the run's tokenizer); needed with
        ``scoring.workers``, which start here when there are rules or a function to run."""
        self.cfg, self.rules, self.function, self.reward_model = cfg, rules, function, reward_model
        self.interrupted = interrupted
        self.stop_ids, self.max_new_tokens = set(stop_ids), max_new_tokens
        self.max_tokens_per_micro_batch, self.pack_sequences = max_tokens_per_micro_batch, pack_sequences
        self.workers: ScoringWorkers | None = None
        if cfg.workers and (rules or function is not None):
            if texts is None:
                raise ValueError("scoring.workers needs the run's decoder (Scorer's texts)")
            self.workers = ScoringWorkers(cfg.workers, cfg, texts, sorted(self.stop_ids))

    def samples(
        self,
        completions: Sequence[Completion],
        decode_batch: Callable[[list[list[int]]], list[str]],
        extras: Sequence[dict[str, Any]] | None = None,
    ) -> list[Sample]:
        """``decoded_samples`` with this scorer's stop ids."""
        return decoded_samples(completions, decode_batch, self.stop_ids, extras)

    def reward_model_scores(self, batch: Batch) -> torch.Tensor:
        """(rows,) the reward model's score of each row, read where transformers reads it
        (``score_positions`` with its config's pad_token_id)."""
        assert self.reward_model is not None
        values = forward_all_rows(
            self.reward_model,
            {k: batch[k] for k in ("input_ids", "attention_mask")},
            values_output(),
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
            pack_sequences=self.pack_sequences,
        )
        pad_id = self.reward_model.arch.hf_config.get("pad_token_id")
        at = score_positions(batch["input_ids"], batch["lengths"], None if pad_id is None else int(pad_id))
        return values[torch.arange(len(values)), at.to(values.device)]

    def score(
        self,
        batch: Batch,
        completions: list[Completion],
        extras: list[dict[str, Any]],
        decode_batch: Callable[[list[list[int]]], list[str]],
    ) -> Scores:
        """Every part of every row (``extras[c.prompt_index]`` is the prompt row of completion c)."""
        return self.start(batch, completions, extras, decode_batch).result()

    def start(
        self,
        batch: Batch,
        completions: list[Completion],
        extras: list[dict[str, Any]],
        decode_batch: Callable[[list[list[int]]], list[str]],
    ) -> PendingScores:
        """``score``, begun: this rank's share of the rules and the custom function runs on a host
        thread (``decode_batch`` must not be called elsewhere until ``result()``), or in the worker
        processes (``scoring.workers``), which decode with the ``texts`` the scorer was given."""
        share: PendingShare | None = None
        if self.rules or self.function is not None:
            rank, world = dist.get_rank(), dist.get_world_size()
            rows = range(rank, len(completions), world)
            if self.workers is not None:
                share = self.workers.start(completions[rank::world], rows, extras)
            else:
                share = watched_share(
                    self.rules,
                    self.function,
                    completions[rank::world],
                    rows,
                    extras,
                    decode_batch,
                    self.stop_ids,
                    self.cfg.timeout_s,
                )
        return PendingScores(self, batch, completions, share)

    def close(self) -> None:
        """Stop the worker processes, if any."""
        if self.workers is not None:
            self.workers.close()

    def _combine(self, batch: Batch, completions: list[Completion], share: PendingShare | None) -> Scores:
        parts: dict[str, torch.Tensor] = {}
        custom_metrics: dict[str, float] = {}
        if self.reward_model is not None:
            parts[REWARD_MODEL] = self.reward_model_scores(batch)
        if share is not None:
            shares = _gather_shares(share, self.interrupted)
            world = len(shares)
            for name in shares[0][0]:
                column = torch.empty(len(completions), dtype=SCORE_DTYPE)
                for r, (part, _) in enumerate(shares):
                    column[r::world] = torch.tensor(part[name], dtype=SCORE_DTYPE)
                parts[name] = column
            if self.function is not None:
                custom_metrics = metric_means([c for _, c in shares if c is not None])
        raw = sum((self.cfg.weights.get(name, 1.0) * value for name, value in parts.items()), torch.zeros(()))
        unusable = (~torch.isfinite(raw)).nonzero()
        if len(unusable):
            row = int(unusable[0])
            values = ", ".join(f"{name} {float(value[row]):g}" for name, value in parts.items())
            raise ValueError(
                f"sample {row}'s score {float(raw[row]):g} is not finite in float32: its parts are "
                f"{values}, weighted by scoring.weights={self.cfg.weights} (1 where not named)"
            )
        rewards = raw
        if self.cfg.overlong.buffer:
            parts[OVERLONG] = self.overlong_penalty(
                torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
            )
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
    share: PendingShare | None  # this rank's rule and function scores, on a thread or in worker processes

    def result(self) -> Scores:
        """Runs the reward model's pass, waits for this rank's share and gathers every rank's.
        Collective over the world; a share that failed on any rank raises on every rank."""
        return self.scorer._combine(self.batch, self.completions, self.share)


def _gather_shares(share: PendingShare, interrupted: Callable[[], bool] | None) -> list[Share]:
    """Every rank's share, in rank order. Collective: a rank whose share failed, or was interrupted
    by a stop request, still joins the gather (saying so), so that all ranks end the step together
    instead of some waiting for it there: an interruption on any rank raises ``ScoringInterrupted``
    on every rank; otherwise a failed rank raises its own exception, the others a
    ``RewardFunctionError`` with its message."""
    stopped = False
    try:
        mine, error = share.result(interrupted), None
    except ScoringInterrupted:
        mine, error, stopped = None, None, True
    except Exception as err:  # a real Ctrl-C (KeyboardInterrupt) is no share's failure: it passes
        mine, error = None, err
    gathered: list[Any] = [None] * dist.get_world_size()
    message = None if error is None else str(error) if isinstance(error, ValueError) else formatted(error)
    dist.all_gather_object(gathered, (mine, message, stopped))
    waiting = [rank for rank, (_, _, was_stopped) in enumerate(gathered) if was_stopped]
    if waiting:
        raise ScoringInterrupted(f"a stop was requested while reward code ran on rank(s) {waiting}")
    if error is not None:
        raise error
    for rank, (_, failed, _) in enumerate(gathered):
        if failed is not None:
            raise RewardFunctionError(f"scoring failed on rank {rank}: {failed}")
    return [part for part, _, _ in gathered]
