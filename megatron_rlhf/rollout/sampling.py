"""Token sampler of the generation engine: temperature, top-k, top-p (nucleus), greedy.

Shape legend: B = rows (one per sequence being generated), V = the real vocabulary (the caller
strips megatron's vocabulary padding before calling).
  logits (B, V) any float dtype: next-token logits
  -> tokens (B,) int64: the sampled token of each row
  -> logprobs (B,) float32: log softmax(logits / T)[token] over the FULL vocabulary

Why it is done this way:
* The returned log-prob is that of the *unfiltered* distribution softmax(logits / T), taken over the
  full vocabulary BEFORE top-k/top-p filtering (and at T=1 for greedy, T=0): exactly what the trainer
  recomputes with ``token_logprobs_and_entropy(..., temperature=T)`` (training/logprobs.py), so the
  PPO/GRPO ratio pi_new / pi_old starts at 1. It is computed the same way (float32, logits times
  1/T), so the two agree to float32 rounding. Top-k/top-p only choose which tokens may be drawn.
* Everything runs in float32 whatever the input dtype (bf16 logits are upcast).
* Ties never depend on index order or sort stability: top-k keeps every token whose z equals the
  k-th largest value (so more than k tokens survive when values tie exactly at the k-th), and top-p
  keeps every token whose z equals that of the last token of the nucleus. The kept set is thus a
  function of the values alone: identical on CPU and GPU (whose sort is not stable) and under any
  permutation of the vocabulary. Greedy (T=0) takes the argmax, lowest index on ties.
* Drawing uses the exponential race: token = argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. drawn from
  ``generator``, which picks v with probability p_v / sum p. This is what ``torch.multinomial``
  does itself for one sample per row, minus its host-synchronising validity check. It consumes B x V
  exponentials per call, is reproducible for a given generator state on a given device (CPU and
  GPU give different streams), and filtered tokens (p_v = 0) can never win.
* On a GPU, greedy and unfiltered sampling (no top-k/top-p) read the logits once in a Triton kernel
  (``rollout/sampling_kernel.py``) that draws by inverting the CDF with one uniform per row: the
  same distribution and log-prob, another random stream. Top-k/top-p go through another kernel
  there that keeps the same tokens without sorting the row (the torch path's full sort took 4.6 ms
  a step at 256 slots): draws from the mass above a pivot, rejected outside the nucleus. Where
  FlashInfer is installed, its rejection samplers draw them instead, faster, with the same kept
  sets (``rollout/sampling_flashinfer.py``).
* No host synchronisation (no ``.item()``, no data-dependent Python branching): only Python values
  of ``SamplingParams`` choose code paths. Greedy consumes no randomness.
* Rows whose logits are NaN, or all -inf, are not checked (that would need a sync); they produce
  an arbitrary token and a NaN/-inf log-prob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rlhf.config.fields import check_on_init
from megatron_rlhf.fusion import gpu_fused
from megatron_rlhf.rollout import sampling_flashinfer, sampling_kernel
from megatron_rlhf.rollout.native_config import FilteredSampler

__all__ = ["SamplingParams", "apply_top_k_top_p", "sample"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample continuations of a prompt (``rollout.sampling`` of ``ppo`` and of ``generate``)."""

    temperature: float = 1.0
    """Logits are divided by it; 0 means greedy (argmax, top_k/top_p ignored)."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th value all kept); 0 = off."""
    top_p: float = 1.0
    """Keep the nucleus: the smallest set of most likely tokens whose probability reaches top_p
    (after top-k; always at least one token); 1 = off. Not free: on one H200 the 1.5B model
    decoded 84k tokens/s at top_p=0.9 with FlashInfer installed, 77k without, against 91k greedy,
    256 slots (docs/benchmarks.md)."""
    max_new_tokens: int = 512
    """At most this many generated tokens per sample."""
    n: int = 1
    """Samples per prompt (a group, for GRPO-style estimators)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past EOS (up to max_new_tokens)."""
    seed: int = 0
    """Seed of the generator the engine draws with (ppo offsets it by the run seed and the step)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):  # a list is accepted, stored as a tuple
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check_on_init(self)

    def errors(self) -> list[str]:
        errors = []
        t = self.temperature
        if not (_is_number(t) and math.isfinite(t) and t >= 0):
            errors.append(f"temperature={t!r} must be a finite number >= 0 (0 means greedy)")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            errors.append(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k)")
        p = self.top_p
        if not (_is_number(p) and 0 < p <= 1):
            errors.append(f"top_p={p!r} must be a number with 0 < top_p <= 1 (1 disables top-p)")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            errors.append(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not (_is_int(self.n) and self.n >= 1):
            errors.append(f"n={self.n!r} must be an integer >= 1 (samples per prompt)")
        stop = self.stop_token_ids
        if not (isinstance(stop, tuple) and all(_is_int(s) and s >= 0 for s in stop)):
            errors.append(f"stop_token_ids={stop!r} must be a tuple of integer token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            errors.append(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if not _is_int(self.seed):
            errors.append(f"seed={self.seed!r} must be an integer")
        return errors

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_set(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """The ids that end a response: ``stop_token_ids``, and the engine's ``eos_token_ids`` unless
        ``ignore_eos``. A response's text leaves its final one out (``Completion.text_ids``)."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def stop_ids_errors(stop_token_ids: Sequence[int], eos_token_ids: Sequence[int], vocab: int, whose: str) -> list[str]:
    """Stop ids outside the policy's vocabulary (``whose``: "the actor's"): they can never be
    sampled, so they would never stop a response."""
    return [
        f"{key}={list(ids)} holds ids outside {whose} vocabulary (vocab_size={vocab}): {outside} can never "
        "be sampled, so they would never stop a response"
        for key, ids in (
            ("rollout.sampling.stop_token_ids", stop_token_ids),
            ("rollout.engine.eos_token_ids", eos_token_ids),
        )
        if (outside := [i for i in ids if not 0 <= i < vocab])
    ]


def _filters(top_k: int, top_p: float, vocab: int) -> tuple[bool, bool]:
    """Whether top-k and top-p each remove any token of a ``vocab``-wide row."""
    return 0 < top_k < vocab, top_p < 1


def apply_top_k_top_p(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """``z`` (B, V) with the tokens outside top-k, then outside the top-p nucleus, set to -inf.

    Top-k keeps every z >= the k-th largest z of its row (ties at the k-th value are all kept; off
    when ``top_k`` is 0 or >= V). Top-p (off when ``top_p`` is 1) then takes p = softmax of the
    top-k-filtered z and, in decreasing order of p, keeps each token while the probability of the
    tokens before it is < top_p: the smallest prefix whose cumulative probability reaches top_p, at
    least one token. Every token whose z equals that of the last kept one is kept too, so the result
    does not depend on sort order among ties. Returns a new tensor in z's dtype; no host sync.
    """
    if not (_is_int(top_k) and top_k >= 0):
        raise ValueError(f"top_k={top_k!r} must be an integer >= 0")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must satisfy 0 < top_p <= 1")
    if z.dim() != 2:
        raise ValueError(f"z must be (B, V); got shape {tuple(z.shape)}")
    use_top_k, use_top_p = _filters(top_k, top_p, z.shape[-1])
    if not (use_top_k or use_top_p):
        return z.clone()
    if not use_top_p:  # top-k alone: no full sort needed
        kth = torch.topk(z, top_k, dim=-1, sorted=True).values[:, -1:]
        return z.masked_fill(z < kth, float("-inf"))
    sorted_z = torch.sort(z, dim=-1, descending=True).values
    if use_top_k:
        kth = sorted_z[:, top_k - 1 : top_k]
        z = z.masked_fill(z < kth, float("-inf"))
        sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))  # still sorted
    probs = torch.softmax(sorted_z, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
    n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # mass_before[0] = 0
    threshold = sorted_z.gather(-1, n_keep - 1)  # z of the last token of the nucleus
    return z.masked_fill(z < threshold, float("-inf"))


def sample(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    filtered_sampler: FilteredSampler = "auto",
) -> tuple[Tensor, Tensor]:
    """Draw one token per row of ``logits`` (B, V); returns (tokens (B,) int64, logprobs (B,) float32).

    T = ``params.temperature`` > 0: z = logits / T, filtered by ``apply_top_k_top_p``, and a token is
    drawn from the renormalised kept set with ``generator`` (the default generator of the logits'
    device if None; it must live on that device). T = 0: greedy argmax (lowest index on ties), no
    randomness consumed.

    The log-prob is log softmax(logits / T)[token] over the FULL vocabulary, i.e. BEFORE top-k/top-p
    filtering (log softmax(logits)[token], T=1, for greedy): the value the trainer recomputes with
    ``token_logprobs_and_entropy(..., temperature=T)``, so PPO ratios start at 1. ``logits`` must
    cover exactly the real vocabulary (padding stripped). No host synchronisation. On a GPU,
    ``filtered_sampler`` (``rollout.engine.filtered_sampler``) picks FlashInfer's kernels or the
    Triton kernel for top-k/top-p.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams; got {type(params).__name__}")
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point (B, V) tensor; got {logits.dtype} {tuple(logits.shape)}")
    use_top_k, use_top_p = _filters(params.top_k, params.top_p, logits.shape[-1])
    unfiltered = params.greedy or not (use_top_k or use_top_p)
    if sampling_kernel.available(logits):  # Triton on a GPU: no softmax, sort or noise of (B, V) in memory
        if unfiltered:
            return sampling_kernel.sample_unfiltered(logits, params.temperature, generator)
        if sampling_flashinfer.chosen(filtered_sampler):
            top_k = params.top_k if use_top_k else 0
            return sampling_flashinfer.sample_filtered(logits, params.temperature, top_k, params.top_p, generator)
        return sampling_kernel.sample_filtered(logits, params.temperature, params.top_k, params.top_p, generator)
    if params.greedy:  # the argmax of the upcast values is that of the originals: no float32 copy
        tokens = torch.argmax(logits, dim=-1)  # first maximal index on ties
        return tokens, _logprob_of_max(logits, tokens)

    z = logits.float() * (1.0 / params.temperature)  # as training/logprobs.py scales, for identical rounding
    probs = torch.softmax(apply_top_k_top_p(z, params.top_k, params.top_p), dim=-1)  # filtered -> 0
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    race.clamp_min_(torch.finfo(race.dtype).tiny)  # guard against an exact 0 draw (p / 0)
    tokens = torch.argmax(probs / race, dim=-1)
    return tokens, _logprob_of(z, tokens)


@gpu_fused
def _logprob_of_max(z: Tensor, tokens: Tensor) -> Tensor:
    """``_logprob_of`` for tokens at the row maximum: -log sum_v exp(z_v - z_token), one pass."""
    top = z.gather(-1, tokens.unsqueeze(-1)).float()
    return -torch.log(torch.exp(z.float() - top).sum(dim=-1))


@gpu_fused
def _logprob_of(z: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(z)[token] per row in float32, without writing the (B, V) log-softmax (one fused
    read of z on GPU)."""
    z = z.float()
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
