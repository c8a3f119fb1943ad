"""OptimConfig: cpu_offload_fraction's range and what it needs, named in the message; the
learning-rate schedule's length against the run's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.trainer.ppo_config import PPOConfig
from megatron_rlhf.training.optim import OptimConfig
from tests.launch import run_cli_here


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_fraction_in_range_is_accepted(fraction: float) -> None:
    assert OptimConfig(cpu_offload_fraction=fraction).errors() == []


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_out_of_range_is_named(fraction: float) -> None:
    with pytest.raises(ValueError, match=rf"^cpu_offload_fraction={fraction} must be in \[0, 1\]$"):
        OptimConfig(cpu_offload_fraction=fraction)


def test_offload_needs_the_distributed_optimizer() -> None:
    with pytest.raises(ValueError, match=r"^cpu_offload_fraction=1.0 needs distributed_optimizer=true$"):
        OptimConfig(cpu_offload_fraction=1.0, distributed_optimizer=False)


def test_a_null_decay_length_becomes_the_runs_and_a_schedule_unlike_the_run_is_named() -> None:
    """Before, decay_steps defaulted to 1000 optimizer steps whatever the run's length: a cosine
    schedule of a 5000-step run sat at min_lr for 80% of it, and of a 100-step run barely decayed."""
    cosine = OptimConfig(lr=1e-3, min_lr=0.0, decay_style="cosine")
    assert cosine.resolve_length("optim", 30, 2) == ["optim.decay_steps: the run's 60 optimizer steps (30 steps x 2)"]
    assert cosine.decay_steps == 60
    constant = OptimConfig()
    assert constant.resolve_length("optim", 30, 2) == [] and constant.decay_steps == 60
    short = OptimConfig(lr=1e-3, decay_style="cosine", decay_steps=30, warmup_steps=5)
    assert short.resolve_length("actor_optim", 30, 2) == [
        "warning: actor_optim.decay_steps=30 ends the cosine decay before the run ends: the learning rate stays "
        "at actor_optim.min_lr=0.0 for the last 30 of the run's 60 optimizer steps (30 steps x 2)"
    ]
    assert short.decay_steps == 30  # given, kept
    long_warmup = OptimConfig(lr=1e-3, warmup_steps=100)
    assert long_warmup.resolve_length("optim", 50, 1) == [
        "warning: optim.warmup_steps=100 is not over within the run's 50 optimizer steps (50 steps x 1): the "
        "learning rate never reaches optim.lr=0.001"
    ]
    assert long_warmup.decay_steps == 101  # the scheduler's decay starts after the warm-up


def test_a_ppo_step_counts_each_mini_batch_of_each_epoch() -> None:
    """ppo-tiny: 8 prompts x 4 samples = 32 rollout sequences in mini-batches of 16: 2 optimizer steps
    per epoch (``trainer/ppo.py::update``); 3 epochs make 6. Without mini-batches, one per epoch."""
    cfg = load_config("ppo-tiny", [], schema=PPOConfig)
    assert (cfg.prompts_per_step, cfg.rollout.sampling.n, cfg.mini_batch_size) == (8, 4, 16)
    assert cfg.optimizer_steps_per_step() == 2
    assert load_config("ppo-tiny", ["ppo_epochs=3"], schema=PPOConfig).optimizer_steps_per_step() == 6
    assert load_config("ppo-tiny", ["mini_batch_size=0"], schema=PPOConfig).optimizer_steps_per_step() == 1
    assert list(cfg.optimizers()) == ["actor_optim"]  # GRPO: no critic
    gae = load_config("ppo-tiny", ["algorithm.advantage_estimator=gae"], schema=PPOConfig)
    assert list(gae.optimizers()) == ["actor_optim", "critic_optim"]


def test_an_sft_runs_cosine_schedule_spans_the_run(tmp_path: Path) -> None:
    """The learning rate each step used (metrics.jsonl ``lr``) against megatron-core's cosine by hand:
    8 rows in batches of 4 for 2 epochs is 4 steps, the decay over those 4 from lr to min_lr."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    done = run_cli_here(
        "sft", "--config", "sft-tiny", f"data.train=[{rows}]", "global_batch_size=4", "num_epochs=2",
        "optim.decay_steps=null", "optim.warmup_steps=0", "save_hf=false", "save_final=false",
        "loggers=[jsonl]", f"output_dir={out}", "device=cpu",
    )  # fmt: skip
    assert "optim.decay_steps: the run's 4 optimizer steps (4 steps x 1)" in done.stdout + done.stderr
    lr, min_lr = 1e-3, 1e-4
    used = [
        row["lr"]
        for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if row["split"] == "train"
    ]
    expected = [min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert used == pytest.approx(expected, rel=1e-6)
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["decay_steps"] == 4
