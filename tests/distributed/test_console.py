"""A quiet console: a 2-rank CPU ppo run, with a save and then a resume of it, prints at most one
warning line in all, and nothing but errors from rank 1 (``metrics/log.py:quiet_console``)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.launch import run_cli

WARNING_LINE = re.compile(r"warn|deprecat", re.IGNORECASE)
"""A notice of any kind: Python's ``UserWarning``/``FutureWarning``/``DeprecationWarning`` lines,
logging's ``WARNING``, torch's and megatron's own wording."""
RANK_PREFIX = re.compile(r"^\[default(\d+)\]:")
"""torchrun's ``--tee 3`` (``PET_TEE``) starts each line of a worker with its local rank."""


def console_lines(*args: str) -> list[str]:
    """stdout and stderr lines of a 2-rank run of the CLI, each line prefixed with its rank."""
    proc = run_cli(*args, nproc=2, env={"PET_TEE": "3"})
    return (proc.stdout + proc.stderr).splitlines()


def test_a_run_and_its_resume_print_at_most_one_warning_and_rank_1_only_errors(tmp_path: Path) -> None:
    ppo = ("ppo", "--config", "ppo-tiny", f"output_dir={tmp_path / 'run'}", "save_every=1")
    first = console_lines(*ppo, "max_steps=1")
    # Resumed at actor TP 2, so that megatron's tensor-parallel notices and a resharded load show up too.
    resumed = console_lines(*ppo, "max_steps=2", "actor.tp=2", "rollout.tp=1")
    assert any("saved checkpoint" in line for line in first)
    assert any("resumed from" in line for line in resumed)  # the resume's notices (torch's load) are covered
    lines = first + resumed
    assert all(RANK_PREFIX.match(line) for line in lines if line.strip()), "a line not from a rank"
    warnings = [line for line in lines if WARNING_LINE.search(line)]
    assert len(warnings) <= 1, "\n".join(warnings)
    rank1 = [line for line in lines if line.startswith("[default1]:")]
    assert all("error" in line.lower() for line in rank1), "\n".join(rank1)
