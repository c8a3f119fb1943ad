"""Two torchrun agents meeting at a c10d rendezvous, as two nodes would, through launch/torchrun.sh."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, subprocess_env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
def test_two_agents_of_two_ranks_run_ppo_as_one_world(tmp_path: Path) -> None:
    """Each agent only knows the node count and the endpoint (no node rank): the rendezvous must join
    them into one world of 4 (so the actor at TP2 is data-parallel over 2), writing one run's metrics."""
    out = tmp_path / "run"
    launcher = [
        str(REPO / "launch" / "torchrun.sh"),
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-id",
        "test-multinode",
        "ppo",
        "--config",
        "ppo-tiny",
        "device=cpu",
        f"output_dir={out}",
        "max_steps=2",
        "actor.tp=2",
        "rollout.tp=1",
        "prompts_per_step=4",
        "mini_batch_size=8",
        "rollout.sampling.max_new_tokens=8",
        "save_hf=false",
    ]
    env = dict(subprocess_env(), PYTHON=sys.executable)
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    agents = [subprocess.Popen(launcher, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT) for log in logs]
    try:
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    text = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-6000:]
    assert "ppo: world 4 on cpu" in text and "layouts: actor TP2xPP1xDP2" in text, text[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
