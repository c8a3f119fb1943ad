"""The command line as a user runs it: subprocesses, exit codes, files on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import PAD_ID, REPO, hf_classes, make_tiny_hf_model, run_torchrun, subprocess_env


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rlhf", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


def test_help_lists_every_command() -> None:
    proc = _cli("--help")
    assert proc.returncode == 0
    for command in ("smoke", "config", "convert"):
        assert command in proc.stdout


def test_config_override_and_unknown_key() -> None:
    proc = _cli("config", "actor.tp=2", "seed=7")
    assert proc.returncode == 0, proc.stderr
    assert "seed: 7" in proc.stdout and "tp: 2" in proc.stdout
    bad = _cli("config", "actor.tpp=2")
    assert bad.returncode == 2
    assert "unknown key 'actor.tpp'; did you mean 'actor.tp'?" in bad.stderr


@pytest.mark.distributed
def test_smoke_run_single_process(tmp_path: Path) -> None:
    proc = _cli("smoke", f"output_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"torch {torch.__version__}, CUDA " in proc.stdout  # the versions line a health check shows
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert set(report) == {"actor", "critic", "reference", "reward"}
    # actor and reference load the same built-in weights: same outputs.
    assert report["actor"]["output_mean"] == report["reference"]["output_mean"]


@pytest.mark.distributed
def test_smoke_run_per_model_layouts_under_torchrun(tmp_path: Path) -> None:
    proc = run_torchrun(
        REPO / "megatron_rlhf" / "__main__.py",
        4,
        "smoke",
        f"output_dir={tmp_path}",
        "actor.tp=2",
        "actor.pp=2",
        "critic.pp=2",
        "reference.tp=2",
        "reward.tp=1",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for layout in ("TP2xPP2xDP1", "TP1xPP2xDP2", "TP2xPP1xDP2", "TP1xPP1xDP4"):
        assert layout in proc.stdout
    single = _cli("smoke", f"output_dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-4000:]
    multi = json.loads((tmp_path / "smoke.json").read_text())
    ref = json.loads((tmp_path / "single" / "smoke.json").read_text())
    for role in ("actor", "critic", "reference", "reward"):
        assert abs(multi[role]["output_mean"] - ref[role]["output_mean"]) < 1e-5
        assert abs(multi[role]["output_std"] - ref[role]["output_std"]) < 1e-5


@pytest.mark.distributed
def test_convert_round_trip_loads_in_transformers(tmp_path: Path) -> None:
    original = make_tiny_hf_model("qwen3", False, tmp_path / "hf")
    to_mcore = run_torchrun(
        REPO / "megatron_rlhf" / "__main__.py",
        4,
        "convert",
        "hf-to-mcore",
        str(tmp_path / "hf"),
        str(tmp_path / "ckpt"),
        "--tp",
        "2",
        "--pp",
        "2",
    )
    assert to_mcore.returncode == 0, to_mcore.stderr[-4000:]
    to_hf = _cli("convert", "mcore-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert to_hf.returncode == 0, to_hf.stderr[-4000:]
    _, lm_cls, _ = hf_classes("qwen3")
    reloaded = lm_cls.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = torch.randint(0, PAD_ID, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)


@pytest.mark.distributed
def test_invalid_layout_is_reported_once_before_anything_is_built(tmp_path: Path) -> None:
    proc = run_torchrun(REPO / "megatron_rlhf" / "__main__.py", 4, "smoke", f"output_dir={tmp_path}", "reference.tp=4")
    assert proc.returncode != 0
    message = "reference.tp=4 must divide num_key_value_heads=2 (model builtin:tiny-llama)"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "build+load" not in proc.stdout


def test_convert_refuses_tp_not_dividing_heads(tmp_path: Path) -> None:
    make_tiny_hf_model("llama", False, tmp_path / "hf")
    proc = _cli("convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--tp", "3")
    assert proc.returncode == 2
    assert "--tp=3 must divide num_attention_heads=4" in proc.stderr
    assert "--tp=3 must divide num_key_value_heads=2" in proc.stderr
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.distributed
def test_generate_command_same_tokens_at_tp1_and_tp2(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n{"prompt_ids": [5, 6, 7, 8]}\n{"prompt": "abc"}\n')
    common = [
        "--model",
        "builtin:tiny-llama",
        "--input",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-batch-size",
        "2",
    ]
    single = _cli("generate", *common, "--output", str(tmp_path / "tp1.jsonl"))
    assert single.returncode == 0, single.stderr[-4000:]
    multi = run_torchrun(
        REPO / "megatron_rlhf" / "__main__.py",
        2,
        "generate",
        *common,
        "--tp",
        "2",
        "--output",
        str(tmp_path / "tp2.jsonl"),
    )
    assert multi.returncode == 0, multi.stderr[-4000:]
    rows1 = [json.loads(line) for line in (tmp_path / "tp1.jsonl").read_text().splitlines()]
    rows2 = [json.loads(line) for line in (tmp_path / "tp2.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in rows1] == [0, 1, 2]
    assert [r["token_ids"] for r in rows1] == [r["token_ids"] for r in rows2]
    assert all(len(r["token_ids"]) == 6 and r["finish_reason"] == "length" for r in rows1)
    for a, b in zip(rows1, rows2, strict=True):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-5


def test_generate_command_names_a_missing_column(tmp_path: Path) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"question": "hi"}\n')
    proc = _cli(
        "generate", "--model", "builtin:tiny-llama", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl")
    )
    assert proc.returncode == 2
    assert str(prompts) in proc.stderr and "prompt" in proc.stderr


@pytest.mark.parametrize("command", ["ppo", "sft", "rm"])
def test_output_dir_under_a_file_is_a_named_error_not_a_traceback(command: str, tmp_path: Path) -> None:
    blocker = tmp_path / "somefile"
    blocker.write_text("")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "response": "b", "chosen": "b", "rejected": "c"}\n')
    proc = _cli(command, "--config", f"{command}-tiny", f"output_dir={blocker / 'run'}", f"data.train=[{rows}]")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"output_dir='{blocker / 'run'}': {blocker} is a file, not a directory" in proc.stderr
    assert "Traceback" not in proc.stderr and "build+load" not in proc.stdout


@pytest.mark.parametrize("command", ["ppo", "sft", "rm"])
def test_unusable_data_fails_before_the_run_writes_or_builds_anything(command: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    missing = _cli(command, "--config", f"{command}-tiny", f"output_dir={out}", "data.train=[/nope.jsonl]")
    assert missing.returncode == 2, missing.stderr[-3000:]
    assert "data.train: dataset path '/nope.jsonl' does not exist" in missing.stderr
    no_columns = tmp_path / "rows.jsonl"
    no_columns.write_text('{"question": "a"}\n')
    bad_rows = _cli(command, "--config", f"{command}-tiny", f"output_dir={out}", f"data.train=[{no_columns}]")
    assert bad_rows.returncode == 2, bad_rows.stderr[-3000:]
    assert str(no_columns) in bad_rows.stderr and "no column 'prompt'" in bad_rows.stderr
    for proc in (missing, bad_rows):
        assert "Traceback" not in proc.stderr and "build+load" not in proc.stdout
    assert not out.exists()  # no config.yaml left behind
