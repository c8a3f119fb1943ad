"""The README stays short, and every command in its ``bash`` blocks is either run by a test or listed
here with the reason it is not and where it is covered instead. A command added to the README and
in neither table fails ``test_every_readme_command_is_run_or_listed``.

The CPU runs are in ``tests/distributed/test_readme_commands.py`` (torchrun tier: each starts the
CLI); the ``pip install`` commands are checked here with pip's own dry run, which resolves them
against the installed environment without downloading anything."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

README = REPO / "README.md"
MAX_BYTES = 10_000
"""The issue's bound: at most 10 KB (TRL's README is 8.4 KB, torchtitan's 7.7 KB)."""

TEST_SETTINGS = {
    "max_steps": ("2", "two steps show the run works end to end; the README's count takes minutes"),
    "prompts_per_step": ("2", "the README's prompts.jsonl has two rows (the default takes 16 per step)"),
    "rollout.sampling.max_new_tokens": ("8", "a random tiny model rarely stops early: shorter responses"),
    "device": ("cpu", "the same run on a GPU machine: the tiny models on CPU"),
}
"""Settings the test gives a run, replacing the README's value or added to its command: key -> (value, why)."""

RUN = {
    "megatron-rlhf ppo actor.path=models/Qwen2.5-0.5B-Instruct data.train=[prompts.jsonl] "
    "scoring.custom_function.path=my_reward.py algorithm.advantage_estimator=grpo rollout.sampling.n=8 "
    "rollout.sampling.max_new_tokens=64 max_steps=100 save_every=20 output_dir=runs/my-first": (
        "max_steps",
        "prompts_per_step",
        "rollout.sampling.max_new_tokens",
        "device",
    ),
    "megatron-rlhf ppo actor.path=models/Qwen2.5-0.5B-Instruct data.train=[prompts.jsonl] "
    "scoring.custom_function.path=my_reward.py --print-config > my-run.yaml": (),
    "megatron-rlhf ppo --config my-run.yaml max_steps=100": (
        "max_steps",
        "prompts_per_step",
        "rollout.sampling.max_new_tokens",
        "device",
    ),
    "megatron-rlhf generate model=runs/my-first/hf input=prompts.jsonl output=answers.jsonl "
    "rollout.sampling.temperature=0": ("rollout.sampling.max_new_tokens", "device"),
}
"""Commands tests/distributed/test_readme_commands.py runs in README order, in one scratch directory
where the README's files are written, each with the TEST_SETTINGS it names."""

PIP_DRY_RUN = ("--dry-run", "--no-index", "--no-build-isolation")
"""What ``test_pip_installs_resolve`` adds to a README ``pip install``: resolve it against the installed
packages, build the project's metadata, install and download nothing."""

DRY_RUN = (
    "pip install -c constraints-ci.txt -e .",
    'pip install -c constraints-ci.txt -e ".[test]"',
)

NOT_RUN = {
    "bash scripts/setup_env.sh": "scripts/test.sh runs it first (.ci/run runs test.sh), and the suite runs in the "
    ".venv it made",
    "source .venv/bin/activate": "puts .venv/bin on PATH; the runs use the megatron-rlhf script beside the "
    "interpreter that runs the tests (.venv's under scripts/test.sh)",
    'pip install -c constraints-ci.txt -e ".[bench]"': "TRL and datasets are not in the test environment, so a "
    "dry run without downloads cannot resolve it; scripts/bench/e2e.py uses the extra on the GPU machine "
    "(docs/benchmarks.md)",
    "bash scripts/run_default.sh": "the pipeline takes minutes: tests/distributed/test_pipeline.py runs it as this "
    "script does without a GPU (2 CPU ranks, the pipeline's default preset); test_shell_scripts.py lints the script",
    "bash scripts/test.sh": ".ci/run runs it; this test is part of what it runs",
    "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct": "downloads from the "
    "Hugging Face hub; test_readme_commands.py builds a tiny Qwen2 model directory (tests/helpers.py) at that path",
    "tensorboard --logdir runs/my-first/tb": "a server that runs until stopped; test_readme_commands.py checks that "
    "the first own run wrote its event files there",
}
"""README commands no test runs: command -> why not, and what covers it."""


def readme_commands(markdown: str) -> list[str]:
    """The commands of the ``bash`` blocks, in order: continued lines joined, comments and blank lines
    dropped, words separated by single spaces (as shlex reads them, quotes kept)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.shlex(line, posix=False, punctuation_chars=False)
            words.whitespace_split, words.commenters = True, "#"
            command = " ".join(words)
            if command:
                commands.append(command)
    return commands


def readme_block(markdown: str, language: str) -> str:
    """The text of the README's one fenced block in ``language`` (the example files of the first own run)."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"expected one ```{language} block in the README, found {len(blocks)}"
    return blocks[0]


def test_the_readme_is_at_most_10_kb() -> None:
    size = len(README.read_bytes())
    assert size <= MAX_BYTES, f"README.md is {size} bytes; at most {MAX_BYTES}: move reference material to docs/"


def test_every_readme_command_is_run_or_listed() -> None:
    commands = readme_commands(README.read_text())
    assert len(commands) == len(set(commands)), "a README command appears twice"
    tables = {"RUN": set(RUN), "DRY_RUN": set(DRY_RUN), "NOT_RUN": set(NOT_RUN)}
    unaccounted = [c for c in commands if not any(c in table for table in tables.values())]
    assert not unaccounted, (
        f"README commands neither run nor listed in {Path(__file__).name}: {unaccounted}; run them in "
        "tests/distributed/test_readme_commands.py (RUN), or add each to NOT_RUN with the reason and what covers it"
    )
    for name, table in tables.items():
        assert table <= set(commands), f"{name} lists commands the README no longer has: {table - set(commands)}"
    assert not (set(RUN) & set(NOT_RUN)) and not (set(DRY_RUN) & set(NOT_RUN))
    assert {key for keys in RUN.values() for key in keys} <= set(TEST_SETTINGS)


def test_readme_commands_are_read_as_a_shell_reads_them() -> None:
    markdown = (
        "text `not a command`\n```bash\n# a comment\nmegatron-rlhf ppo a=1 \\\n    b=[x.jsonl]   # why\n\n"
        'pip install -e ".[test]"\n```\n```text\nnot bash\n```\n'
    )
    assert readme_commands(markdown) == ["megatron-rlhf ppo a=1 b=[x.jsonl]", 'pip install -e ".[test]"']


def test_pip_installs_resolve() -> None:
    """Each README ``pip install`` for this environment: the constraints file and the project's
    requirements agree with what is installed, and its extras exist (pip warns, and does not fail,
    on an unknown extra: the test fails on the warning)."""
    for command in DRY_RUN:
        words = shlex.split(command)
        assert words[:2] == ["pip", "install"]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", *words[1:], *PIP_DRY_RUN], cwd=REPO, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "Would install megatron-rlhf" in proc.stdout, proc.stdout[-3000:]
        assert "does not provide the extra" not in proc.stderr, proc.stderr
