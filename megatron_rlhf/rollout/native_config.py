"""The native engine's settings (``rollout.engine.*`` of ``ppo`` and of ``generate``),
apart from the engine itself so that reading or checking a config imports neither torch's
compiler nor megatron-core."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Sequence
from typing import Literal

from megatron_rlhf.config.fields import at_least, check_on_init

FilteredSampler = Literal["auto", "flashinfer", "triton"]


@functools.cache
def flashinfer_installed() -> bool:
    """Whether ``flashinfer`` is importable (found without importing it, or torch). Cached: the
    sampler asks at every top-k/top-p decode step, and a search of the path costs ~30-45 us."""
    return importlib.util.find_spec("flashinfer") is not None


@dataclasses.dataclass(kw_only=True)
class NativeEngineConfig:
    max_batch_size: int = 64
    """KV-cache slots: sequences decoded together."""
    max_seq_len: int = 2048
    """Prompt + response tokens per sequence (the cache length). ppo caps it at
    data.max_prompt_length + rollout.sampling.max_new_tokens, the longest sequence a rollout holds."""
    on_long_prompt: Literal["error", "truncate"] = "error"
    """A prompt with no room for one new token: error, or truncate (drop its oldest tokens, counted,
    as many as leave room for sampling.max_new_tokens)."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids; generation stops on them unless ignore_eos. Empty: the tokenizer's."""
    cuda_graphs: bool = True
    """On GPU, replay decode steps as CUDA graphs (one per KV-length bucket), removing per-step
    launch overhead; prefill stays eager. Ignored on CPU."""
    graph_kv_bucket: int = 64
    """Decode graphs attend over the cache rounded up to a multiple of this many positions (one
    graph per multiple reached). On a GPU the Triton decode attention reads each slot's own prefix
    whatever the bucket, so there it only sets how many graphs are captured."""
    filtered_sampler: FilteredSampler = "auto"
    """Top-k/top-p draws on a GPU: FlashInfer's kernels (pip install flashinfer-python; faster, see
    docs/benchmarks.md) or the project's Triton kernel. auto: FlashInfer where it is installed and
    its kernels load (its JIT builds them with nvcc on first use), else Triton, saying why once.
    Greedy and plain temperature sampling always use the Triton kernel; the CPU, torch."""

    def __post_init__(self) -> None:
        check_on_init(self)

    def with_eos_of(self, stop_ids: Sequence[int]) -> NativeEngineConfig:
        """This config, with the tokenizer's ``stop_ids`` where it names no ``eos_token_ids``."""
        return self if self.eos_token_ids else dataclasses.replace(self, eos_token_ids=tuple(stop_ids))

    def errors(self) -> list[str]:
        errors = at_least(self, 1, "max_batch_size", "graph_kv_bucket") + at_least(self, 2, "max_seq_len")
        if self.filtered_sampler == "flashinfer" and not flashinfer_installed():
            errors.append(
                "filtered_sampler='flashinfer', but flashinfer is not importable here "
                "(pip install flashinfer-python), or set it to 'auto' or 'triton'"
            )
        return errors
