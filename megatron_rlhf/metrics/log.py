"""Rank-aware logging, progress bars, phase timers and memory figures.

Only global rank 0 prints (other ranks would repeat it); errors are printed by every rank that
hits them (``quiet_console``). Progress is a tqdm bar with an ETA on a terminal and plain lines
elsewhere (logs, Slurm, CI). Memory figures come from the CUDA allocator on GPU and from the
process RSS in CPU mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from tqdm import tqdm


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log(message: str) -> None:
    """Print on rank 0, above the progress bar if one is shown (the bar is drawn again below)."""
    if is_rank0():
        with tqdm.external_write_mode(file=sys.stdout):
            print(message, file=sys.stdout, flush=True)


def progress_bar(total: int, label: str, unit: str, initial: int = 0) -> tqdm | None:
    """A tqdm bar (count, rate, elapsed and ETA) when this is rank 0 and stdout is a terminal;
    None otherwise: logs, Slurm and CI get plain progress lines instead, which read well in a file."""
    if not (is_rank0() and sys.stdout.isatty()):
        return None
    return tqdm(total=total, initial=initial, desc=label, unit=unit, file=sys.stdout, dynamic_ncols=True)


def python_environment() -> str:
    """The interpreter and the environment it runs in: a venv (its prefix), a conda env (its name)
    or the system's; a package missing or of the wrong version is often a run in another one."""
    prefix = Path(sys.prefix)
    if sys.prefix != sys.base_prefix:
        environment = f"venv {prefix}"
    elif (prefix / "conda-meta").is_dir():
        active = os.environ.get("CONDA_PREFIX") == sys.prefix and os.environ.get("CONDA_DEFAULT_ENV")
        environment = f"conda env {active or prefix.name} ({prefix})"
    else:
        environment = f"no venv ({prefix})"
    return f"python {platform.python_version()} {sys.executable}, {environment}"


def environment_report() -> str:
    """One line for a run's log saying what it ran on: package and git commit, the interpreter and
    its environment, torch, CUDA, megatron-core, whether apex and Transformer Engine are importable
    (without them megatron falls back to torch kernels: slower, and other numerics), whether
    FlashInfer is (the engine's top-k/top-p draws use it), and torch's intra-op threads."""
    import megatron_rlhf

    def version(module: str) -> str:
        try:
            return importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    here = Path(megatron_rlhf.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    present = {
        name: importlib.util.find_spec(module) is not None
        for name, module in (
            ("apex", "apex"),
            ("transformer-engine", "transformer_engine"),
            ("flashinfer", "flashinfer"),
        )
    }
    return (
        f"megatron-rlhf {megatron_rlhf.__version__} (git {commit or 'unknown'}), {python_environment()}; "
        f"torch {torch.__version__}, "
        f"CUDA {torch.version.cuda or 'none'}, megatron-core {version('megatron-core')}, "
        + ", ".join(f"{name} {'present' if ok else 'absent'}" for name, ok in present.items())
        + f"; {torch.get_num_threads()} host threads"
    )


def memory_summary(device: torch.device) -> str:
    gib = 1024**3
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device) / gib
        peak = torch.cuda.max_memory_allocated(device) / gib
        return f"gpu allocated {allocated:.2f} GiB, peak {peak:.2f} GiB"
    return f"cpu rss {psutil.Process().memory_info().rss / gib:.2f} GiB"


def format_eta(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """The progress of long work (rank 0), called with the count done so far: a bar on a terminal
    (``progress_bar``), else a line at most every ``every_s`` seconds and at the end:
    ``label: done/total (rate/s, eta)``."""

    def __init__(
        self, label: str, total: int, unit: str, every_s: float = 10.0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.label, self.total, self.unit, self.every_s, self.clock = label, total, unit, every_s, clock
        self.start = self.last = clock()
        self.bar = progress_bar(total, label, unit)

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            if done >= self.total:
                self.bar.close()
            return
        now = self.clock()
        if done < self.total and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = f", eta {format_eta((self.total - done) / rate)}" if 0 < done < self.total else ""
        log(f"{self.label}: {done}/{self.total} {self.unit} ({rate:,.1f}/s{eta})")


def snake_case(text: str) -> str:
    """A name (a phase, a reward rule's import path) as one part of a metric key: lowercase, each
    run of other characters than letters and digits one ``_`` (``generation weights (reshard)`` ->
    ``generation_weights_reshard``)."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


PHASE_MARK = "phase/"


def phase_range(phase: str) -> contextlib.AbstractContextManager[Any]:
    """A named range around a phase for the profiler (``profile_steps``: ``metrics/kernels.py``
    reports each ``phase/...`` range it finds); next to free when no profiler runs."""
    return torch.profiler.record_function(PHASE_MARK + phase)


@contextlib.contextmanager
def timed(
    phase: str,
    device: torch.device,
    times: dict[str, float] | None = None,
    *,
    quiet: bool = False,
    peaks: dict[str, float] | None = None,
) -> Iterator[None]:
    """Time a phase across all ranks (barrier at both ends), add it to ``times[phase]`` and log it
    with memory use (unless quiet). On a GPU, ``peaks`` gets the phase's peak allocated and reserved
    GiB of this rank (``peak_allocated_gib/<phase>``, ``peak_reserved_gib/<phase>``; the largest when
    a phase runs more than once): the allocator's peak counters are reset when the phase starts and
    read after the synchronize that ends it."""
    measure = peaks is not None and device.type == "cuda"
    if dist.is_initialized():
        dist.barrier()
    if measure:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with phase_range(phase):
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if peaks is not None and measure:
        for kind, value in (
            ("allocated", torch.cuda.max_memory_allocated(device)),
            ("reserved", torch.cuda.max_memory_reserved(device)),
        ):
            key = f"peak_{kind}_gib/{phase}"
            peaks[key] = max(peaks.get(key, 0.0), value / 1024**3)
    if dist.is_initialized():
        dist.barrier()
    elapsed = time.perf_counter() - start
    if times is not None:  # a phase run more than once in a step (extra rollout batches) adds up
        times[phase] = times.get(phase, 0.0) + elapsed
    if not quiet:
        log(f"[{phase}] {elapsed:.2f}s, {memory_summary(device)}")


MEGATRON = r"megatron(_fsdp)?\."
"""megatron-core's modules (its FSDP package also installs standalone as ``megatron_fsdp``)."""
TORCH_DCP = r"torch\.distributed\.checkpoint\."
"""torch's distributed checkpoint, which megatron's ``torch_dist`` checkpoints are read with."""

HARMLESS_WARNINGS: tuple[tuple[str, str], ...] = (
    # Python warnings: (module that warns, start of the message). Each repeats on every rank.
    # Without apex and Transformer Engine megatron uses torch's kernels (environment_report says which).
    (MEGATRON, "Transformer Engine and Apex are not installed"),
    (MEGATRON, "Apex is not installed"),
    # TransformerConfig's own default cuda_graph_modules; we capture no graphs through megatron.
    (MEGATRON, "full scope is deprecated"),
    # get_megatron_optimizer imports MimoModel to ask whether the model is one; we build none.
    (MEGATRON, "MimoModelConfig is experimental"),
    # The distributed optimizer's zero_grad reads .grad of its fp32 parameter shards, which are
    # views of the parameters, not leaves ("throws grad-access warning", megatron's own comment there
    # says); megatron sets and clears those .grad itself, autograd never does.
    (MEGATRON, "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    # (GPU) A speed hint for overlapping tensor-parallel all-reduces with the weight-gradient GEMM:
    # the results are the same either way; the variable would change how every stream is scheduled.
    (MEGATRON, "When using async grad allreduce it is recommended to set the environment variable"),
    (MEGATRON, "When using sequence parallelism it is recommended to set the environment variable"),
    # megatron's torch_dist load: each rank reads its own shards (no_dist=True, megatron plans the
    # exchange itself), with the reader passed positionally, in torch's ShardedTensor format; the
    # deprecation is torch's, of the format megatron-core 0.19 writes.
    (TORCH_DCP, "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"),
    (TORCH_DCP, "The argument order of load has been changed"),
    (TORCH_DCP, "Please use DTensor instead and we are deprecating ShardedTensor"),
)

HARMLESS_LOG_RECORDS: tuple[tuple[str, str], ...] = (
    # logging records: (logger, start of the message).
    # GPTModel, the class models/builder.py builds, takes bug fixes only.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    # torch found a CUDA toolkit but no GPU: the CPU mode (gloo) needs none.
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    # Every megatron save goes through its async machinery (a synchronous save too, where megatron
    # itself names the "mcore" strategy); the suggested NVRx strategy is another package, not a setting.
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
)


@dataclasses.dataclass(frozen=True)
class DropRecordsStartingWith:
    """A logging filter dropping one logger's records whose message starts with ``prefix``."""

    prefix: str

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_console() -> None:
    """Keep the console for the run's own lines: silence the known-harmless notices above (each by
    its module or logger and message, so a new notice still shows), and let ranks other than 0
    print errors only (their warnings would repeat rank 0's). Call it before megatron is imported:
    some notices come at import."""
    for module, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), module=module)
    for logger_name, message in HARMLESS_LOG_RECORDS:
        logger = logging.getLogger(logger_name)
        dropper = DropRecordsStartingWith(message)
        if dropper not in logger.filters:
            logger.addFilter(dropper)
    if os.environ.get("RANK", "0") != "0":  # torchrun's global rank (there is no process group yet)
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # every logger, whatever its own level (torch's have their own)
