"""``megatron-rlhf ppo`` as a user runs it (CPU mode, subprocesses, files on disk).

References: the trainer's log-prob recomputation against the engine's sampling log-probs; KL 0
at step 1 where the actor is the reference; every sample's reward recomputed from its text; a
TP1 single-process run against the same run sharded over two ranks; transformers loading the
exported actor."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_rlhf.metrics.sinks import markdown_table
from tests.helpers import REPO, load_all_tensors
from tests.launch import run_cli

MAIN = REPO / "megatron_rlhf" / "__main__.py"
PHASES = ("gen", "reward", "ref", "old_log_prob", "adv", "update_actor")


def _records(out_dir: Path, name: str = "metrics") -> list[dict]:
    return [json.loads(line) for line in (out_dir / f"{name}.jsonl").read_text().splitlines()]


KEY = re.compile(r"[a-z][a-z0-9_]*(/[a-z0-9_]+)*")
"""The metric-key scheme: lowercase snake_case parts joined by '/' (docs/metrics.md)."""


def _documented_keys() -> list[re.Pattern]:
    """The keys docs/metrics.md lists (``<rule>`` stands for any one part)."""
    page = (REPO / "docs" / "metrics.md").read_text()
    first_cells = [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `")]
    names = [name for cell in first_cells for name in re.findall(r"`([^`]+)`", cell) if " " not in name]
    return [re.compile(re.sub(r"<[a-z_]+>", "[a-z0-9_]+", re.escape(name))) for name in names]


def _check_keys(records: list[dict]) -> None:
    """Every metric key has no space, follows the scheme and is documented."""
    documented = _documented_keys()
    keys = {key for record in records for key in record} - {"split", "step"}
    with_space = [key for key in keys if " " in key]
    assert not with_space, with_space
    off_scheme = [key for key in keys if not KEY.fullmatch(key)]
    assert not off_scheme, off_scheme
    undocumented = [key for key in keys if not any(p.fullmatch(key) for p in documented)]
    assert not undocumented, f"not in docs/metrics.md: {undocumented}"


def _lowercase_fraction(text: str) -> float:
    return sum(c in "abcdefghijklmnopqrstuvwxyz" for c in text) / len(text) if text else 0.0


@pytest.mark.distributed
def test_default_grpo_run_learns_its_rule_reward(tmp_path: Path) -> None:
    """The built-in run (GRPO, tiny random actor, lowercase-letter reward): the mean reward climbs."""
    out = tmp_path / "run"
    proc = run_cli("ppo", "--config", "ppo-tiny", f"output_dir={out}", "max_steps=30", "log_every=10")
    assert "step 30/30" in proc.stdout and "ppo done: mean reward" in proc.stdout
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[0]["kl/per_sequence"] == 0.0  # the actor still equals the reference
    assert max(r["rollout/logprob_max_abs_diff"] for r in records) < 1e-5
    assert all(f"timing_s/{phase}" in r for r in records for phase in PHASES)
    assert all(r["timing_s/gen/generation_weights_zero_copy"] >= 0 for r in records)
    _check_keys(records)
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (records[:5], records[-5:]))
    assert last > first + 0.03, (first, last)
    samples = _records(out, "samples")
    assert len(samples) == 30 * 4
    for sample in samples:
        assert sample["reward"] == pytest.approx(_lowercase_fraction(sample["response"]), abs=1e-6)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = load_all_tensors(_builtin_dir())
    changed = [name for name, p in exported.state_dict().items() if not torch.equal(p, initial[name])]
    assert changed, "the exported actor equals the initial weights"
    assert json.loads((out / "result.json").read_text())["last_reward_mean"] == records[-1]["reward/mean"]


def _builtin_dir() -> Path:
    from megatron_rlhf.models.builtin import builtin_checkpoint

    return builtin_checkpoint("builtin:tiny-llama")


PPO_ARGS = (
    "max_steps=2",
    "prompts_per_step=4",
    "mini_batch_size=8",
    "algorithm.advantage_estimator=gae",
    "scoring.use_reward_model=true",
    "algorithm.kl_penalty.coef=0.05",
    "rollout.sampling.max_new_tokens=12",
    # Every part of the actor's objective on: the KL loss and the entropy bonus too.
    "algorithm.loss.kl_loss_coef=0.001",
    "algorithm.loss.entropy_coef=0.01",
)
COMPARED = (
    "reward/mean",
    "reward/reward_model",
    "reward/rule/lowercase_fraction",
    "kl/per_sequence",
    "advantages/mean",
    "returns/mean",
    "values/mean",
    "actor/loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
    "response_length/mean",
)


@pytest.fixture(scope="module")
def ppo_one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """PPO with every part on (critic, reward model, rule, KL penalty, KL loss, entropy bonus) in one
    process: the reference of the sharded run, and the run whose metric keys are checked."""
    out = tmp_path_factory.mktemp("ppo-one")
    return out, run_cli("ppo", "--config", "ppo-tiny", f"output_dir={out}", *PPO_ARGS)


@pytest.mark.distributed
def test_ppo_sharded_over_two_ranks_equals_one_process(
    tmp_path: Path, ppo_one_process: tuple[Path, subprocess.CompletedProcess]
) -> None:
    """PPO with a critic (PP2), reward model, KL penalty, KL loss and entropy bonus: every model sharded
    over 2 ranks (data-parallel size 1 everywhere, so the rollout is the same) gives the TP1 run's figures."""
    run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        f"output_dir={tmp_path / 'two'}",
        *PPO_ARGS,
        "actor.tp=2",
        "reference.tp=2",
        "reward.tp=2",
        "critic.pp=2",
        "rollout.tp=2",
        nproc=2,
    )
    for one, two in zip(_records(ppo_one_process[0]), _records(tmp_path / "two"), strict=True):
        for key in COMPARED:
            assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-4), (one["step"], key)


@pytest.fixture(scope="module")
def resharded_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GRPO over two ranks, the actor trained at TP2 and generating at TP1 x DP2, logging to every sink
    (wandb offline, where it is installed): two steps, then the same command resumed with max_steps=3."""
    out = tmp_path_factory.mktemp("ppo-resharded")
    loggers = "console,jsonl,tensorboard" + (",wandb" if importlib.util.find_spec("wandb") else "")
    for max_steps in (2, 3):
        run_cli(
            "ppo",
            "--config",
            "ppo-tiny",
            f"output_dir={out}",
            f"max_steps={max_steps}",
            "actor.tp=2",
            "rollout.tp=1",
            f"loggers=[{loggers}]",
            "wandb.project=megatron-rlhf-tests",
            nproc=2,
            env={"WANDB_MODE": "offline"},
        )
    return out


@pytest.mark.distributed
def test_ppo_generates_from_resharded_weights(resharded_two_ranks: Path) -> None:
    """Actor trained at TP2, generation at TP1 x DP2 from resharded weights: the engine's log-probs
    equal the trainer's recomputation, and the reference (TP1) agrees with the actor at step 1."""
    records = _records(resharded_two_ranks)
    assert all("timing_s/gen/generation_weights_reshard" in r for r in records)
    # The health figures are logged without an entropy bonus or dynamic sampling (the preset's).
    assert all(r["actor/entropy"] > 0 and 0 <= r["rollout/uniform_group_fraction"] <= 1 for r in records)
    _check_keys(records)
    assert max(r["rollout/logprob_max_abs_diff"] for r in records) < 1e-5
    assert records[0]["kl/per_sequence"] < 1e-5


ONE_STEP_PER_ROLLOUT = (
    "max_steps=2",
    "prompts_per_step=4",
    "mini_batch_size=0",
    "rollout.sampling.max_new_tokens=8",
    "max_tokens_per_micro_batch=64",
    "data.max_prompt_length=56",
)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [("actor.tp=1",), ("actor.pp=2",)], ids=["dp2", "pp2"])
def test_old_logprobs_from_the_update_equal_their_own_pass(layout: tuple[str, ...], tmp_path: Path) -> None:
    """Over two ranks (the actor data-parallel, or pipelined): a rollout that feeds one optimizer step
    skips the old-log-prob pass, gathering the update's log-probs from the rank and stage that
    computed each row; the figures and the exported actor equal those of the run that recomputes."""
    runs = {}
    for mode in ("auto", "always"):
        run_cli(
            "ppo",
            "--config",
            "ppo-tiny",
            f"output_dir={tmp_path / mode}",
            *ONE_STEP_PER_ROLLOUT,
            *layout,
            f"algorithm.recompute_old_logprobs={mode}",
            nproc=2,
        )
        runs[mode] = _records(tmp_path / mode)
    for skipped, recomputed in zip(runs["auto"], runs["always"], strict=True):
        assert "timing_s/old_log_prob" not in skipped and "timing_s/old_log_prob" in recomputed
        figures = [key for key in skipped if not key.startswith(("timing_s/", "perf/"))]
        assert {k: skipped[k] for k in figures} == {k: recomputed[k] for k in figures}
    weights = [load_all_tensors(tmp_path / mode / "hf") for mode in ("auto", "always")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@pytest.mark.distributed
def test_metric_keys_follow_the_documented_scheme(ppo_one_process: tuple[Path, subprocess.CompletedProcess]) -> None:
    """A run with every part on (critic, reward model, rule, KL penalty, KL loss, entropy bonus):
    its metric keys have no spaces, follow the scheme and are listed in docs/metrics.md."""
    out, proc = ppo_one_process
    records = _records(out)
    assert len(records) == 2
    assert {
        "critic/vf_loss",
        "actor/pg_loss",
        "actor/entropy",
        "actor/kl_loss",
        "reward/reward_model",
        "reward/rule/lowercase_fraction",
        "timing_s/update_critic",
        "values/mean",
    } <= set.intersection(*map(set, records))
    _check_keys(records)
    for record in records:  # one micro-batch per optimizer step: the parts add up to the actor's objective exactly
        parts = record["actor/pg_loss"] - 0.01 * record["actor/entropy"] + 0.001 * record["actor/kl_loss"]
        assert record["actor/loss"] == pytest.approx(parts, rel=1e-5, abs=1e-7)
    # The progress line shows the step's time, then each phase's.
    assert re.search(r"\| step [0-9.]+s: gen [0-9.]+s ", proc.stdout) and " update_critic " in proc.stdout
    assert all(
        r["timing_s/step"]
        >= sum(v for k, v in r.items() if re.fullmatch(r"timing_s/[a-z_]+", k) and k != "timing_s/step")
        for r in records
    )


@pytest.mark.distributed
def test_samples_reach_tensorboard_as_text(resharded_two_ranks: Path) -> None:
    """Each step's samples.jsonl rows are a markdown table in TensorBoard's text tab at that step,
    through the resume (steps 1-2, then 3)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resharded_two_ranks / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}
    samples = _records(resharded_two_ranks, "samples")
    assert texts == {
        step: markdown_table([{k: v for k, v in s.items() if k != "step"} for s in samples if s["step"] == step])
        for step in (1, 2, 3)
    }


def _offline_wandb_run(run_dir: Path) -> tuple[dict, dict[int, dict]]:
    """The config and the history rows (by step) of an offline wandb run, read from its ``.wandb``
    file. wandb (0.31) has no reader for offline runs, so this follows the file's format: a 7-byte
    header, then wandb's ``Record`` protobufs in LevelDB-log framing (32 KiB blocks; each fragment
    is crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    config: dict = {}
    history: dict[int, dict] = {}
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a fragment header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            which = record.WhichOneof("record_type")
            if which in ("run", "config"):
                updates = record.run.config.update if which == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in updates})
            elif which == "history":
                row = {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item
                }
                history[record.history.step.num] = row
    return config, history


@pytest.mark.distributed
def test_wandb_offline_history_equals_metrics_jsonl(resharded_two_ranks: Path) -> None:
    """Two ranks with loggers=[..., wandb] and WANDB_MODE=offline, run for two steps and resumed for a
    third: one wandb run (rank 0's), its id the one the checkpoints keep, written by the first process
    (steps 1-2) and continued by the resumed one (step 3), each holding the resolved config; its
    history has every key and value of metrics.jsonl at every step, and each step's samples.jsonl
    rows as a table."""
    pytest.importorskip(
        "wandb", reason="wandb is not installed (pip install wandb, or the test extra): no offline wandb run to check"
    )
    runs = sorted((resharded_two_ranks / "wandb").glob("offline-run-*"))  # rank 0 only; named by start time
    checkpoints = sorted((resharded_two_ranks / "checkpoints").glob("step_*"))
    kept_ids = {json.loads((ckpt / "run_state.json").read_text())["loop"]["wandb_run_id"] for ckpt in checkpoints}
    assert len(runs) == 2 and len(checkpoints) == 2 and len(kept_ids) == 1
    assert [run.name.rsplit("-", 1)[1] for run in runs] == [*kept_ids] * 2
    (first_config, first), (config, resumed) = (_offline_wandb_run(run) for run in runs)
    assert first_config["max_steps"] == 2 and config["max_steps"] == 3
    assert config["loggers"] == ["console", "jsonl", "tensorboard", "wandb"]
    assert config["algorithm"]["advantage_estimator"] == "grpo" and config["wandb"]["project"] == "megatron-rlhf-tests"
    records = _records(resharded_two_ranks)
    assert (sorted(first), sorted(resumed)) == ([1, 2], [3])
    samples = _records(resharded_two_ranks, "samples")
    for record in records:
        step = record["step"]
        run, history = (runs[0], first) if step in first else (runs[1], resumed)
        logged = {k: v for k, v in history[step].items() if k not in ("_step", "_runtime", "_timestamp")}
        table = {k.removeprefix("samples/"): logged.pop(k) for k in list(logged) if k.startswith("samples/")}
        assert logged == {k: v for k, v in record.items() if k not in ("split", "step")}, step
        assert table["_type"] == "table-file"
        rows = json.loads((run / "files" / table["path"]).read_text())
        expected = [s for s in samples if s["step"] == step]
        assert len(expected) == 4 and [dict(zip(rows["columns"], row, strict=True)) for row in rows["data"]] == expected
