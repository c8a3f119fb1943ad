"""The ``megatron-rlhf`` command line. Run it plainly for one process, or under torchrun.

Every command takes its settings as ``key=value`` (checked against the command's config dataclass,
with the closest key suggested for a typo), builds on ``--config PRESET|FILE.yaml``, and prints
the resolved settings with ``--print-config`` (YAML with each setting's description as a comment;
it loads again with ``--config``):

megatron-rlhf smoke [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf ppo [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf sft [--config PRESET|FILE.yaml] data.train=[FILE.jsonl,...] [key=value ...]
megatron-rlhf rm [--config PRESET|FILE.yaml] data.train=[FILE.jsonl,...] [key=value ...]
megatron-rlhf pipeline [--config PRESET|FILE.yaml] [key=value ...]
megatron-rlhf generate model=DIR input=prompts.jsonl output=out.jsonl [rollout.tp=N] [rollout.sampling.n=4 ...]
megatron-rlhf plan [--config PRESET|FILE.yaml] [plan.world_size=N] [plan.gpu_memory_gib=G] [key=value ...]
megatron-rlhf convert hf-to-mcore HF_DIR OUT_DIR [tp=N pp=M]
megatron-rlhf convert mcore-to-hf CKPT_DIR OUT_DIR [tp=N pp=M]

The flags ``generate``, ``plan`` and ``convert`` had before stay as aliases of keys
(``config/flags.py``: ``--num-samples 4`` is ``rollout.sampling.n=4``). This module only
dispatches: each command's settings and entry live in ``megatron_rlhf/commands/``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from typing import NoReturn

from megatron_rlhf.commands import COMMANDS, schema_of
from megatron_rlhf.commands.config_args import CommandParser
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.metrics.log import quiet_console
from megatron_rlhf.parallel.distributed import shutdown_distributed

SILENT_RANK_EXIT_DELAY_S = 30.0
"""How long a rank other than 0 waits before exiting on a configuration error that rank 0 reports."""
REMOVED = {
    "config": "'megatron-rlhf config' is gone: use 'megatron-rlhf <command> --print-config' "
    "(e.g. megatron-rlhf ppo --config ppo-tiny --print-config)"
}
"""Commands that no longer exist, and what to run instead."""


class _PrintVersions(argparse.Action):
    """``--version``: the line every run logs first (package and commit, Python, torch, CUDA,
    megatron-core, the optional kernels), after importing megatron-core, so that it fails (status 1)
    where the install cannot run; the image's HEALTHCHECK is this."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from megatron_rlhf.metrics.log import environment_report

        quiet_console()
        print(environment_report())
        try:
            import megatron.core  # noqa: F401
        except Exception as error:  # any failure to import is the news here, not only ImportError
            parser.exit(1, f"megatron-rlhf: error: megatron-core cannot be imported: {error!r}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rlhf",
        description="Megatron-native RLHF. Runs as one process, or as an SPMD job under torchrun. Every command "
        "takes key=value settings, builds on a preset or YAML file (--config) and prints its resolved settings "
        "(--print-config): megatron-rlhf COMMAND --help lists them.",
    )
    parser.add_argument("--version", action=_PrintVersions, help="print the versions this install runs on, and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION, allow_abbrev=False)
        sub.command, sub.schema_of = name, functools.partial(schema_of, name)
        command.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given and given[0] in REMOVED:
        print(f"megatron-rlhf: error: {REMOVED[given[0]]}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(given)
    quiet_console()
    try:
        return COMMANDS[args.command].run(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        # Every rank finds the same configuration error: only the first says so. Other errors may
        # be rank-specific (a file missing on one node) and are reported by each rank that hits them.
        if not isinstance(err, ConfigError) or os.environ.get("RANK", "0") == "0":
            print(f"megatron-rlhf: error: {err}", file=sys.stderr)
        else:
            # The first to exit makes torchrun stop the others: were it this rank, rank 0 could be
            # stopped before saying why (seen on a loaded host). Rank 0 exits first; this one is then
            # stopped while it waits, or exits after the wait if rank 0 went on.
            time.sleep(SILENT_RANK_EXIT_DELAY_S)
        return 2


def entry() -> None:
    """The process's entry (``python -m megatron_rlhf``, the ``megatron-rlhf`` script): ``main``, then
    the process groups torn down before the interpreter exits. ``main`` leaves them up, for callers
    that run it more than once in one process."""
    # Ctrl-C and TERM act as in any program until a trainer takes them (trainer/stop.py):
    # launch/torchrun.sh starts torchrun with them ignored (--signals-to-handle leaves them so), and
    # its workers inherit that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = main()
    shutdown_distributed()
    exit_before_teardown(code)


def exit_before_teardown(code: int) -> NoReturn:
    """Exit as the interpreter would, short of tearing it down. ``destroy_process_group`` leaves
    gloo's C++ worker threads running while anything holds a group (megatron-core's parallel state,
    the models' process-group collections: a 4-rank smoke run ends with about 135 threads). One that
    frees a tensor as the interpreter finalizes is ended inside a destructor when it takes the GIL,
    and a run that succeeded aborts ("terminate called without an active exception", SIGABRT; a rank
    in one of CI's torchrun tests in two of three runs). Everything that exit does for this program
    is done here first, with the interpreter's own private steps: threading's shutdown (its exit
    hooks stop idle executor workers, then non-daemon threads are joined), the ``atexit`` handlers
    (the run lock's release, logging's flush, temporary directories, multiprocessing's children) and
    the standard streams' flush. The files a run writes are flushed as written and closed by the run."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream: as exit does
            stream.flush()
    os._exit(code)
