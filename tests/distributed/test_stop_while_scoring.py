"""A stop signal while a reward hangs: the run saves the step before and exits as a stop does,
instead of waiting for the reward's timeout (CPU mode, the CLI as a user runs it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import subprocess_env

# 8 prompts x 4 samples a step on one rank: the rule hangs on step 2's first sample.
HANGING_RULE = """
import pathlib, time

calls = 0


def score(sample):
    global calls
    calls += 1
    if calls > 32:
        pathlib.Path(__file__).with_name("hanging").touch()
        time.sleep(3600)
    return 0.5
"""


@pytest.mark.distributed
def test_sigterm_while_a_reward_hangs_saves_the_step_before_and_exits_0(tmp_path: Path) -> None:
    (tmp_path / "hang_rule.py").write_text(HANGING_RULE)
    env = subprocess_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    out = tmp_path / "run"
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_rlhf",
                "ppo",
                "--config",
                "ppo-tiny",
                f"output_dir={out}",
                "max_steps=4",
                "scoring.rules=[hang_rule:score]",
                "scoring.timeout_s=600",
                "rollout.sampling.max_new_tokens=8",
                "data.max_prompt_length=64",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 300
            while not (tmp_path / "hanging").exists():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-4000:]
                time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=90)  # the reward's own limit is 600 s
        finally:
            proc.kill()
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text[-4000:]
    step_1 = out / "checkpoints" / "step_1"
    assert "SIGTERM received" in text and f"step 1: saved checkpoint {step_1}" in text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_1"]
    assert json.loads((step_1 / "run_state.json").read_text())["step"] == 1
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
