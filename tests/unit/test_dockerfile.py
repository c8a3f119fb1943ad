"""scripts/dockerfile_check.py: the static checks of the Dockerfile (COPY sources against the context and
.dockerignore, pins found), on the real Dockerfile and on small hand-made ones with known faults."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "dockerfile_check.py"


def load_check():
    spec = importlib.util.spec_from_file_location("dockerfile_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dockerfile_passes_the_offline_checks() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--offline"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "COPY sources: ok" in proc.stdout


def test_copy_sources_missing_or_ignored_are_named(tmp_path: Path) -> None:
    check = load_check()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_text("")
    (tmp_path / "notes.md").write_text("")
    (tmp_path / ".dockerignore").write_text("# comment\nnotes.md\n**/*.safetensors\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM base:1\n"
        "COPY pkg/ pkg/\n"
        "COPY missing.txt \\\n"
        "     ./\n"
        "COPY notes.md ./\n"
        "COPY weights/ weights/\n"
        "COPY --from=builder /opt/x /opt/x\n"
        "COPY . .\n"
    )
    problems = check.copy_problems(tmp_path / "Dockerfile", tmp_path)
    assert len(problems) == 3, problems
    assert problems[0].startswith("Dockerfile:3: COPY missing.txt: no such file")
    assert problems[1].startswith("Dockerfile:5: COPY notes.md: excluded by .dockerignore")
    assert problems[2].startswith("Dockerfile:6: COPY weights/: every file under it is excluded")


def test_pins_are_found_in_run_lines_and_setup_py(tmp_path: Path) -> None:
    check = load_check()
    (tmp_path / "Dockerfile").write_text(
        "FROM base:1\nRUN pip install --no-cache-dir foo==1.2.3 \\\n && pip install 'bar>=2' baz==0.1.0rc1\n"
    )
    (tmp_path / "setup.py").write_text('install_requires=["qux==4.5", "free"]\n')
    pins = check.pinned_packages(tmp_path / "Dockerfile", tmp_path / "setup.py")
    assert pins == [("foo", "1.2.3", "Dockerfile:2"), ("baz", "0.1.0rc1", "Dockerfile:2"), ("qux", "4.5", "setup.py")]
