"""The built-in pipeline, as the README's main job runs it on a CPU machine (2 ranks), its RL and
reward-model stages shortened for CI (``CI_STAGE_STEPS``): a model made from scratch improves at
held-out arithmetic by RL. The accuracies are recomputed from the responses the test stage wrote,
the export is checked with transformers alone, and the PPO run's accuracy (judged by the rule) is
checked to ignore the reward model mixed into its score. A LoRA GRPO run (preset
``pipeline-arith-tiny-lora``) starts from the same SFT model and must gain as much."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from megatron_rlhf.tasks.arithmetic import judge
from tests.launch import run

MIN_GAIN = 0.15
"""The issue's bar for the CPU pipeline, met by its GRPO stage (+20.4 points at the preset's 30 steps
when written; +24.2 at ``RL_STEPS`` in CI's shortened run, docs/benchmarks.md)."""
MIN_PPO_GAIN = 0.10
"""PPO (critic + reward model + rule + KL) on CPU gained +16.6 points when written (+23.6 in CI's
shortened run); its bar has more room for another CPU's rounding to take another path (the GPU
preset's PPO gains about +30)."""
RL_STEPS = 15
"""GRPO's and PPO's steps, the LoRA run's too: half the preset's 30, to spare CI time. The learning
rates are constant after warm-up, so these are the first 15 steps of the preset's runs; most of the
gain comes by then (docs/benchmarks.md)."""
CI_STAGE_STEPS = (f"grpo.max_steps={RL_STEPS}", f"ppo.max_steps={RL_STEPS}", "rm.max_steps=50")
"""The preset's stages, shortened for CI. The reward model's cosine schedule is set to 150 steps, so
its first 50 are the preset's: its validation accuracy is about as high at step 50 as at 150 (73.6%
and 74.2% when shortened, 70.9% at 50 since)."""


def _pipeline(out: Path, *args: str, timeout: int) -> str:
    """Run ``megatron-rlhf pipeline`` on 2 CPU ranks into ``out``; returns its output."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "megatron_rlhf",
        "pipeline",
        *args,
        f"output_dir={out}",
        "device=cpu",
    ]
    proc = run(cmd, timeout=timeout)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("pipeline") / "run"
    return out, _pipeline(out, *CI_STAGE_STEPS, timeout=1500)


def _recomputed_accuracy(test_dir: Path, model: str) -> float:
    """The share of the test stage's responses of ``model`` that the judge finds right, each judged
    against its prompt's expression evaluated here."""
    rows = [json.loads(line) for line in (test_dir / f"{model}.jsonl").read_text().splitlines()]
    assert len(rows) == 500
    answers = [r["prompt"][len("Q: ") : -len("=? A:")] for r in rows]
    right = [judge(r["response"], eval(expr)) == "right" for r, expr in zip(rows, answers, strict=True)]
    return sum(right) / len(rows)


def _validations(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "validation"]


@pytest.mark.distributed
def test_rl_raises_held_out_accuracy(pipeline_run: tuple[Path, str]) -> None:
    out, _ = pipeline_run
    result = json.loads((out / "pipeline.json").read_text())
    accuracy = result["test_accuracy"]
    assert set(accuracy) == {"sft", "grpo", "ppo"}
    for model, value in accuracy.items():
        assert value == pytest.approx(_recomputed_accuracy(out / "test", model))
    assert 0.3 < accuracy["sft"] < 0.8  # the careless teacher's slips: room for RL
    assert accuracy["grpo"] - accuracy["sft"] >= MIN_GAIN, accuracy
    assert accuracy["ppo"] - accuracy["sft"] >= MIN_PPO_GAIN, accuracy
    assert list(result["stages"]) == ["sft", "pairs", "rm", "grpo", "ppo", "test"]


@pytest.mark.distributed
def test_every_stage_validates_and_draws_its_curves(pipeline_run: tuple[Path, str]) -> None:
    out, log = pipeline_run
    for stage in ("sft", "rm", "grpo", "ppo"):
        assert (out / stage / "curves.png").read_bytes()[:4] == b"\x89PNG", stage
    assert log.count("validation curve:") == 4
    # Pairs of the SFT model's own right and wrong answers, chance 0.5: 0.709 at rm.max_steps=50 while
    # both data-parallel generation groups sampled from one random stream; 0.616 and 0.589 since each
    # has its own, on two machines (the last bits of CPU matmuls differ between machines, and the
    # samples with them).
    # About 350 validation pairs: 0.56 is 2.2 standard deviations above chance.
    assert _validations(out / "rm")[-1]["accuracy"] >= 0.56
    grpo, ppo = _validations(out / "grpo"), _validations(out / "ppo")
    assert [v["step"] for v in grpo] == list(range(0, RL_STEPS + 1, 5))
    # The same SFT model on the same prompts: PPO's accuracy is judged by the rule alone, though its
    # score mixes in the reward model.
    assert ppo[0]["greedy_accuracy"] == grpo[0]["greedy_accuracy"]
    assert ppo[0]["greedy_reward"] != pytest.approx(ppo[0]["greedy_accuracy"])
    pairs = json.loads((out / "pairs" / "summary.json").read_text())
    assert pairs["train_pairs"] > 500 and pairs["validation_pairs"] > 100


@pytest.mark.distributed
def test_the_exported_policy_answers_alike_in_transformers(pipeline_run: tuple[Path, str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = pipeline_run
    tokenizer = AutoTokenizer.from_pretrained(out / "grpo" / "hf")
    model = AutoModelForCausalLM.from_pretrained(out / "grpo" / "hf", dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (out / "test" / "grpo.jsonl").read_text().splitlines()][:24]
    for row in rows:
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            new = model.generate(
                ids,
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, ids.shape[1] :].tolist()
        assert new[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(new[:-1]) == row["response"], row


def _file_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.distributed
def test_a_rerun_keeps_the_pairs_its_reward_model_trained_on(pipeline_run: tuple[Path, str]) -> None:
    """Sampling again on a GPU need not give the same pairs; the rm stage's resume would then meet
    other data. A re-run pipeline keeps the pairs made from the same policy, prompts and settings."""
    out = pipeline_run[0]
    pairs_before, rm_metrics = _file_digests(out / "pairs"), (out / "rm" / "metrics.jsonl").read_text()
    log = _pipeline(out, *CI_STAGE_STEPS, "stages=[sft,pairs,rm]", timeout=300)
    assert f"pairs: {out / 'pairs'} holds the pairs of this policy, prompts and settings: kept" in log, log[-3000:]
    assert _file_digests(out / "pairs") == pairs_before
    assert (out / "rm" / "metrics.jsonl").read_text() == rm_metrics  # complete: not trained again


@pytest.mark.distributed
def test_lora_grpo_from_the_sft_model_raises_held_out_accuracy(pipeline_run: tuple[Path, str], tmp_path: Path) -> None:
    sft = pipeline_run[0] / "sft"
    base_before = _file_digests(sft / "hf")
    out = tmp_path / "lora"
    log = _pipeline(
        out,
        "--config",
        "pipeline-arith-tiny-lora",
        "stages=[grpo,test]",
        f"sft.output_dir={sft}",
        f"grpo.max_steps={RL_STEPS}",
        timeout=600,
    )
    accuracy = json.loads((out / "pipeline.json").read_text())["test_accuracy"]
    assert set(accuracy) == {"sft", "grpo"}
    for model, value in accuracy.items():
        assert value == pytest.approx(_recomputed_accuracy(out / "test", model))
    assert accuracy["grpo"] - accuracy["sft"] >= MIN_GAIN, accuracy
    adapter = json.loads((out / "grpo" / "hf_adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["base_model_name_or_path"] == str(sft / "hf")
    assert "reference: the actor's base, its LoRA adapters off (no reference model built)" in log
    assert _file_digests(sft / "hf") == base_before
