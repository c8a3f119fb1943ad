"""The HF export of a LoRA model at TP2 and PP2 writes what TP1 writes: the merged ``hf/`` and the
PEFT ``hf_adapter/`` (gathered from TP shards and pipeline stages), and PEFT's adapter on the base
gives the merged model's logits; TP1's adapter read back at TP2 and PP2 gives the same shards (2 gloo
ranks, ``lora_export_worker.py``; TP1's own check against our model's logits is in
tests/unit/test_lora_export.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.helpers import PAD_ID
from tests.launch import run_worker

WORKER = Path(__file__).with_name("lora_export_worker.py")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            found.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return found


@pytest.mark.distributed
def test_lora_export_at_tp2_and_pp2_equals_tp1(tmp_path: Path) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    results = run_worker(WORKER, 2, tmp_path, timeout=600)
    layouts = ("tp1pp1", "tp2pp1", "tp1pp2")
    assert all(results[f"{tag}/model_untouched"] == 1.0 for tag in layouts)
    assert all(results[f"{tag}/adapter_read_back"] == 1.0 for tag in layouts[1:])
    merged = {tag: _tensors(tmp_path / tag / "hf") for tag in layouts}
    adapter = {tag: _tensors(tmp_path / tag / "hf_adapter") for tag in layouts}
    assert len(adapter["tp1pp1"]) == 4 * 7 * 2  # layers * projections * (A, B)
    for tag in layouts[1:]:
        assert adapter[tag].keys() == adapter["tp1pp1"].keys(), tag
        for name, tensor in adapter[tag].items():
            assert torch.equal(tensor, adapter["tp1pp1"][name]), (tag, name)
        assert merged[tag].keys() == merged["tp1pp1"].keys(), tag
        for name, tensor in merged[tag].items():
            torch.testing.assert_close(tensor, merged["tp1pp1"][name], rtol=0, atol=1e-6, msg=f"{tag} {name}")

    input_ids = torch.randint(0, PAD_ID, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32).eval()
        base_logits = base(input_ids).logits
        for tag in ("tp2pp1", "tp1pp2"):
            hf = AutoModelForCausalLM.from_pretrained(tmp_path / tag / "hf", torch_dtype=torch.float32).eval()
            logits = hf(input_ids).logits
            assert (logits - base_logits).abs().max() > 0.05
            fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32).eval()
            with_adapter = peft.PeftModel.from_pretrained(fresh, tmp_path / tag / "hf_adapter").eval()
            assert (with_adapter(input_ids).logits - logits).abs().max() < 1e-4, tag


@pytest.mark.distributed
def test_sft_and_rm_runs_with_lora_export_the_merged_model_and_sft_the_peft_adapter(tmp_path: Path) -> None:
    """The trainers' final export (``save_hf=true``, the default): sft writes hf/ (merged) and
    hf_adapter/, whose base is the run's model and which on it gives hf/'s logits; rm writes hf/ with
    its merged weights and no hf_adapter/ (a score-head adapter is not written). ``convert
    mcore-to-hf`` of sft's final checkpoint writes the same hf/ and hf_adapter/ tensors and config."""
    import json

    import peft
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_sft_rm import _preference_rows, _sft_rows, _write_jsonl
    from tests.launch import run_cli

    sft_out, rm_out = tmp_path / "sft", tmp_path / "rm"
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(32, 0))
    pairs = _write_jsonl(tmp_path / "pairs.jsonl", _preference_rows(32, 0))
    common = ("model.lora.rank=4", "max_steps=2", "optim.lr=1e-2", "optim.warmup_steps=0")
    run_cli("sft", "--config", "sft-tiny", f"data.train=[{train}]", *common, f"output_dir={sft_out}")
    rm_proc = run_cli("rm", "--config", "rm-tiny", f"data.train=[{pairs}]", *common, f"output_dir={rm_out}")
    converted = tmp_path / "converted" / "hf"
    run_cli("convert", "mcore-to-hf", str(sft_out / "checkpoints" / "step_2" / "models" / "actor"), str(converted))
    for exported, written in ((sft_out / "hf", converted), (sft_out / "hf_adapter", converted.parent / "hf_adapter")):
        theirs, mine = _tensors(exported), _tensors(written)
        assert mine.keys() == theirs.keys(), written
        for name, tensor in mine.items():
            assert torch.equal(tensor, theirs[name]), (written, name)
    # The same config.json: before, convert's lacked the bos/eos ids the run's export writes. The pad
    # id goes into a reward model's config only (transformers scores a batch by it); in a causal LM's
    # it would become the embedding's padding_idx, which transformers' training leaves untrained.
    exported_config = json.loads((sft_out / "hf" / "config.json").read_text())
    assert json.loads((converted / "config.json").read_text()) == exported_config
    assert exported_config["eos_token_id"] is not None and exported_config.get("pad_token_id") is None
    assert json.loads((rm_out / "hf" / "config.json").read_text())["pad_token_id"] is not None

    config = json.loads((sft_out / "hf_adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["task_type"] == "CAUSAL_LM" and len(config["target_modules"]) == 7
    base_dir = Path(config["base_model_name_or_path"])
    input_ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(sft_out / "hf", torch_dtype=torch.float32).eval()
        logits = merged(input_ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
        assert (base(input_ids).logits - logits).abs().max() > 1e-3  # the adapters trained
        for adapter_dir in (sft_out / "hf_adapter", converted.parent / "hf_adapter"):
            with_adapter = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
            assert (with_adapter(input_ids).logits - logits).abs().max() < 1e-4, adapter_dir
            base = with_adapter.unload()

    assert (rm_out / "hf" / "config.json").is_file() and not (rm_out / "hf_adapter").exists()
    found = re.search(r"merged LoRA adapters; saved HF checkpoint .* from (\S+)\n", rm_proc.stdout)
    assert found, rm_proc.stdout[-3000:]
    exported, rm_base = _tensors(rm_out / "hf"), _tensors(Path(found.group(1)))
    assert exported.keys() == rm_base.keys()
    for name, tensor in exported.items():  # the adapted weights moved; the frozen ones are the base's
        adapted = name.endswith("_proj.weight")
        assert torch.equal(tensor, rm_base[name]) != adapted or name == "score.weight", name


@pytest.mark.distributed
def test_a_grpo_run_with_a_lora_actor_exports_its_merged_model_and_adapter(tmp_path: Path) -> None:
    """ppo's export of a LoRA actor: hf/ merged, hf_adapter/ on the actor's base gives hf/'s logits.
    The actor starts from a PEFT adapter (``actor.lora.adapter_path``) with B non-zero: the KL to the
    free reference (the base, adapters off) is then above zero at step 1, where a fresh adapter's is 0."""
    import json

    import peft
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.models.builtin import builtin_checkpoint
    from tests.launch import run_cli

    start = tmp_path / "start_adapter"
    policy = AutoModelForCausalLM.from_pretrained(builtin_checkpoint("builtin:tiny-llama"), torch_dtype=torch.float32)
    peft_model = peft.get_peft_model(policy, peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(start)
    out = tmp_path / "run"
    proc = run_cli(
        "ppo",
        "--config",
        "ppo-tiny",
        "actor.lora.rank=4",
        f"actor.lora.adapter_path={start}",
        "actor_optim.lr=1e-2",
        "prompts_per_step=4",
        "mini_batch_size=8",
        "rollout.sampling.max_new_tokens=8",
        "max_steps=2",
        f"output_dir={out}",
    )
    config = json.loads((out / "hf_adapter" / "adapter_config.json").read_text())
    input_ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out / "hf", torch_dtype=torch.float32).eval()(input_ids).logits
        base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], torch_dtype=torch.float32)
        assert (base.eval()(input_ids).logits - logits).abs().max() > 1e-4  # the adapters trained
        with_adapter = peft.PeftModel.from_pretrained(base, out / "hf_adapter").eval()
        assert (with_adapter(input_ids).logits - logits).abs().max() < 1e-4
    assert f"without the adapter it started from ({start})" in proc.stdout
    first_step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first_step["step"] == 1 and first_step["kl/per_sequence"] > 1e-3
