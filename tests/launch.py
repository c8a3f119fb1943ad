"""How tests start processes, and how a torchrun worker starts and reports: one way each.

Test side:
- ``run_cli`` runs ``python -m megatron_rlhf`` (under torchrun when ``nproc`` > 1);
- ``run_cli_here`` calls the same ``main`` in this process, for a command that ends before it builds
  anything (an interpreter's start-up costs more than such a command: megatron-core's imports alone);
- ``run_worker`` runs a worker script (under torchrun when ``nproc`` > 1) and returns the results it
  wrote.
Each asserts the exit code and, when it is wrong, fails with the tail of the output.

Worker side: ``worker_session`` initialises torch.distributed (gloo on CPU, nccl on CUDA), seeds every
rank, hands out the results dict and, once the worker's body has run, has rank 0 write it for
``run_worker``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers import REPO

if TYPE_CHECKING:  # the worker side imports megatron_rlhf only once a session starts
    from megatron_rlhf.parallel.distributed import DistEnv

MAIN = REPO / "megatron_rlhf" / "__main__.py"
RESULTS_FILE = "results.json"
DEVICE_ENV = "MEGATRON_RLHF_TEST_DEVICE"
"""Set to ``cuda`` by a GPU test that runs a CPU worker on GPUs (nccl); ``worker_session`` reads it."""
OUTPUT_TAIL_CHARS = 6000


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment with the repo first on PYTHONPATH (carried packages stay reachable), plus ``extra``."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", **extra}


def command(nproc: int, *args: str, script: Path = MAIN) -> list[str]:
    """The command line of ``script`` (the CLI unless named) with ``args``: a plain process for one
    rank (as a user runs the CLI; torch.distributed then starts a world of one), torchrun otherwise."""
    if nproc == 1:
        return [sys.executable, *(["-m", "megatron_rlhf"] if script == MAIN else [str(script)]), *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


def check_exit(proc: subprocess.CompletedProcess, exit_code: int | None = 0) -> subprocess.CompletedProcess:
    """Assert the exit code (``None``: any failure), showing the tails of stdout and stderr otherwise."""
    ok = proc.returncode != 0 if exit_code is None else proc.returncode == exit_code
    expected = "non-zero" if exit_code is None else str(exit_code)
    assert ok, (
        f"exit code {proc.returncode}, expected {expected}: {' '.join(map(str, proc.args))}\n"
        f"--- stdout (tail) ---\n{proc.stdout[-OUTPUT_TAIL_CHARS:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-OUTPUT_TAIL_CHARS:]}"
    )
    return proc


def run(
    cmd: list[str],
    *,
    exit_code: int | None = 0,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: int = 900,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end in the tests' environment (plus ``env``) and assert its exit code."""
    proc = subprocess.run(
        cmd, env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    return check_exit(proc, exit_code)


def run_cli(
    *args: str,
    nproc: int = 1,
    exit_code: int | None = 0,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: int = 900,
) -> subprocess.CompletedProcess:
    """Run the CLI with ``args`` (``nproc`` ranks) and assert its exit code; returns the finished process."""
    return run(command(nproc, *args), exit_code=exit_code, env=env, cwd=cwd, timeout=timeout)


def run_cli_here(*args: str, exit_code: int | None = 0) -> subprocess.CompletedProcess:
    """``run_cli`` for one process, as a call of the CLI's ``main`` here, its output captured."""
    from megatron_rlhf.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse's --help and usage errors
            code = stop.code if isinstance(stop.code, int) else 1
    finished = subprocess.CompletedProcess(["megatron-rlhf", *args], code, stdout.getvalue(), stderr.getvalue())
    return check_exit(finished, exit_code)


def run_worker(
    worker: Path, nproc: int, out: Path, *args: str, env: Mapping[str, str] | None = None, timeout: int = 900
) -> dict[str, Any]:
    """Run ``worker`` on ``nproc`` ranks with ``out`` as its first argument, assert it succeeded, and
    return the results its rank 0 wrote (``worker_session``)."""
    out.mkdir(parents=True, exist_ok=True)
    run(command(nproc, str(out), *args, script=worker), env=env, timeout=timeout)
    return worker_results(out)


def worker_results(out: Path) -> dict[str, Any]:
    """The results a worker's ``worker_session`` wrote to ``out``."""
    return json.loads((out / RESULTS_FILE).read_text())


@dataclass
class WorkerSession:
    """What a worker's body gets: its rank's environment, its arguments, and the results to report."""

    env: DistEnv
    out: Path
    args: list[str]
    results: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def worker_session(device: str | None = None, seed: int = 0) -> Iterator[WorkerSession]:
    """Worker side of ``run_worker``: torch.distributed initialised on ``device`` (``DEVICE_ENV``, else the
    CPU, when not given) and every rank seeded; after the body, rank 0 writes ``session.results`` to
    OUT/results.json (OUT: the first argument) while the others wait; the process group stays up for
    what the worker runs next. A body that raises writes nothing, so ``run_worker`` fails with the
    traceback."""
    import torch.distributed as dist

    from megatron_rlhf.parallel.distributed import init_distributed, seed_everything

    env = init_distributed(device or os.environ.get(DEVICE_ENV, "cpu"))
    seed_everything(seed)
    session = WorkerSession(env=env, out=Path(sys.argv[1]), args=sys.argv[2:])
    yield session
    if env.rank == 0:
        (session.out / RESULTS_FILE).write_text(json.dumps(session.results, indent=2))
    dist.barrier()  # every rank leaves with the results written
