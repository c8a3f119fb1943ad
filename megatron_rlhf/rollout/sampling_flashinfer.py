"""Top-k / top-p draws through FlashInfer's sampling kernels, where ``flashinfer-python`` is installed.

FlashInfer's rejection samplers keep the tokens ``sampling.apply_top_k_top_p`` keeps: top-k every
token with fewer than k tokens more likely (its radix top-k keeps every probability >= the k-th,
ties included), top-p every token whose more likely tokens hold less than top_p of the mass (the
kernel accepts a draw when the mass strictly above it is < top_p). On one H200 they draw faster
than the project's Triton kernel (``sampling_kernel.sample_filtered``), which stays the fallback
where FlashInfer is absent or its kernels do not load (docs/benchmarks.md, "Kernels"). Unfiltered
draws stay on the Triton kernel, which is faster there.

FlashInfer draws from float32 probabilities, and its own softmax writes them in the logits' dtype,
so they are computed here in float32 from z = logits * (1 / T), as the trainer scales them, with the
log-sum-exp that gives each drawn token's log-prob over the whole vocabulary. Its random numbers come
from the caller's generator (its Philox offset advances), so a seeded run repeats its draws.

Its kernels load on first use from its AOT package or JIT cache; where neither has them, its JIT
builds them with nvcc (minutes, once per machine). The first use says so and how long it took.
"""

from __future__ import annotations

import time
from types import ModuleType

import torch

from megatron_rlhf.fusion import gpu_fused
from megatron_rlhf.metrics.log import log
from megatron_rlhf.rollout.native_config import FilteredSampler, flashinfer_installed

_loaded: dict[str, ModuleType | Exception] = {}
"""``flashinfer.sampling`` once its kernels loaded, or why they did not (a load is tried once)."""


def _sampling_module() -> ModuleType | Exception:
    if not _loaded:
        log("FlashInfer: loading its sampling kernels (where none are built, its JIT builds them with nvcc: minutes)")
        start = time.perf_counter()
        try:
            from flashinfer import sampling

            sampling.get_sampling_module()
            _loaded["sampling"] = sampling
            log(f"FlashInfer: sampling kernels ready in {time.perf_counter() - start:.1f} s")
        except Exception as error:  # not importable here, no nvcc for its JIT, a build that failed
            _loaded["sampling"] = error
    return _loaded["sampling"]


def chosen(mode: FilteredSampler) -> bool:
    """Whether top-k / top-p draws go through FlashInfer under ``rollout.engine.filtered_sampler``
    = ``mode``. ``auto`` takes it where it is installed and its kernels load, and otherwise says
    once why it fell back to the Triton kernel; ``flashinfer`` raises where they do not load."""
    if mode == "triton" or (mode == "auto" and not flashinfer_installed()):
        return False
    first = not _loaded
    module = _sampling_module()
    if isinstance(module, ModuleType):
        return True
    if mode == "flashinfer":
        raise RuntimeError(
            f"rollout.engine.filtered_sampler=flashinfer, but FlashInfer's sampling kernels did not load: "
            f"{type(module).__name__}: {module}"
        ) from module
    if first:
        log(
            f"FlashInfer is installed, but its sampling kernels did not load ({type(module).__name__}: {module}); "
            "top-k/top-p use the Triton kernel (set rollout.engine.filtered_sampler=triton to skip FlashInfer)"
        )
    return False


@gpu_fused
def _probs_and_logsumexp(logits: torch.Tensor, inv_temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(z) in float32 and logsumexp(z), z = logits.float() * inv_temperature."""
    z = logits.float() * inv_temperature
    logsumexp = torch.logsumexp(z, dim=-1)
    return torch.exp(z - logsumexp[:, None]), logsumexp


def sample_filtered(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) float32), as ``sampling_kernel.sample_filtered`` returns
    them: drawn from softmax(logits / T) filtered by top-k (``top_k`` 0: off) then top-p (``top_p``
    1: off), at least one filter on, T > 0; the log-prob over the whole vocabulary, before
    filtering. Only where ``chosen`` returned True. No host synchronisation."""
    module = _sampling_module()
    assert isinstance(module, ModuleType), "sample_filtered runs only where chosen() returned True"
    logits = logits.contiguous()  # FlashInfer reads dense rows
    inv_temperature = 1.0 / temperature
    probs, logsumexp = _probs_and_logsumexp(logits, inv_temperature)
    if top_k and top_p < 1:
        probs = module.top_k_renorm_probs(probs, top_k, is_deterministic=True)  # its sum in a fixed order
    if top_p < 1:
        tokens = module.top_p_sampling_from_probs(probs, top_p, generator=generator)
    else:
        tokens = module.top_k_sampling_from_probs(probs, top_k, generator=generator)
    tokens = tokens.long()
    z_token = logits.gather(-1, tokens[:, None])[:, 0].float() * inv_temperature
    return tokens, z_token - logsumexp
