"""Starting the adapters from a PEFT adapter directory (``lora.adapter_path``): the model then gives
PEFT's logits for the same adapter on the same base, a written adapter reads back bit for bit, and
every adapter this stack cannot reproduce is refused at start-up with the file, key and value."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rlhf.checkpoint.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_errors
from megatron_rlhf.checkpoint.sources import ModelConfig, model_errors
from megatron_rlhf.models.architecture import load_architecture
from megatron_rlhf.models.lora_config import LoraConfig
from tests.helpers import PAD_ID, VOCAB, make_tiny_hf_model

RANK, ALPHA = 4, 12.0
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-4
"""float32; HF's and megatron's kernels differ by ~1e-5 in these logits, the adapter moves them by > 0.05."""


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base HF dir, PEFT adapter dir): a tiny llama and PEFT's own LoRA on it, A and B random."""
    import peft

    root = tmp_path_factory.mktemp("peft")
    base = make_tiny_hf_model("llama", False, root / "base")
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:  # B too: PEFT starts it at zero, which would hide a wrong B
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def _lora(adapter: Path, **changes: Any) -> LoraConfig:
    settings: dict[str, Any] = dict(rank=RANK, alpha=ALPHA, target_modules=TARGETS, adapter_path=str(adapter))
    return LoraConfig(**(settings | changes))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)


def test_a_model_started_from_a_peft_adapter_gives_peft_logits_and_writes_it_back(
    world_of_one, peft_adapter: tuple[Path, Path], tmp_path: Path
) -> None:
    import peft
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.checkpoint.export import export_hf
    from megatron_rlhf.checkpoint.sources import build_role

    base_dir, adapter_dir = peft_adapter
    role = build_role(
        "actor",
        ModelConfig(path=str(base_dir), lora=_lora(adapter_dir)),
        load_architecture(base_dir),
        world_size=1,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    input_ids = torch.randint(0, PAD_ID, (2, 10), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(10)[None].expand_as(input_ids)
    with torch.no_grad():
        ours = role.model(input_ids, positions, None)[..., :VOCAB]
        base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()
        base_logits = base(input_ids).logits
        theirs = peft.PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids).logits
    assert (theirs - base_logits).abs().max() > 0.05  # the adapter matters
    assert (ours - theirs).abs().max() < TOLERANCE

    tokenizer: Any = types.SimpleNamespace(pad_id=PAD_ID, bos_id=None, eos_id=None, stop_ids=(), chat_template=None)
    export_hf(role, tokenizer, tmp_path / "hf", adapter_dir=tmp_path / "hf_adapter")
    written, read = _tensors(tmp_path / "hf_adapter" / ADAPTER_WEIGHTS), _tensors(adapter_dir / ADAPTER_WEIGHTS)
    assert written.keys() == read.keys()
    for name, tensor in written.items():
        assert torch.equal(tensor, read[name]), name


def _edited(adapter: Path, tmp_path: Path, config: dict[str, Any], tensors: Any = None) -> Path:
    """A copy of ``adapter`` with ``config`` merged into its adapter_config.json and its tensors
    passed through ``tensors`` (a function of the name -> tensor dict)."""
    copy = tmp_path / "edited"
    shutil.copytree(adapter, copy)
    settings = json.loads((copy / ADAPTER_CONFIG).read_text()) | config
    (copy / ADAPTER_CONFIG).write_text(json.dumps(settings))
    if tensors is not None:
        save_file(tensors(_tensors(copy / ADAPTER_WEIGHTS)), copy / ADAPTER_WEIGHTS)
    return copy


LAYER0_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "expected"),
    [
        ({"peft_type": "IA3"}, None, "peft_type='IA3', expected 'LORA'"),
        ({"task_type": "SEQ_CLS"}, None, "task_type='SEQ_CLS', expected 'CAUSAL_LM'"),
        ({"use_dora": True}, None, "use_dora=True is a PEFT feature this stack does not implement"),
        ({"use_rslora": True}, None, "use_rslora=True is a PEFT feature"),
        ({"modules_to_save": ["score"]}, None, "modules_to_save=['score'] is a PEFT feature"),
        ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern={'q_proj': 8} is a PEFT feature"),
        ({"layers_to_transform": [0]}, None, "layers_to_transform=[0] is a PEFT feature"),
        ({"bias": "lora_only"}, None, "bias='lora_only' trains biases"),
        ({"r": 8}, None, "model.lora.rank=4 but CONFIG has r=8: pass model.lora.rank=8"),
        ({"lora_alpha": 16}, None, "model.lora.alpha=12.0 but CONFIG has lora_alpha=16: pass model.lora.alpha=16"),
        (
            {"target_modules": ["q_proj", "k_proj"]},
            None,
            "has target_modules=['q_proj', 'k_proj']: pass model.lora.target_modules=[k_proj,q_proj]",
        ),
        ({"target_modules": ".*proj"}, None, "target_modules='.*proj', expected a list of module names"),
        ({"target_modules": ["q_proj", "lm_head"]}, None, "target_modules has ['lm_head'], which this stack"),
        (
            {},
            lambda t: t | {LAYER0_Q_A: torch.zeros(RANK, 32)},
            f"1 tensor(s) of another shape, e.g. '{LAYER0_Q_A}' has [4, 32], expected [4, 64] for r=4 on a "
            "LlamaForCausalLM of 4 layers",
        ),
        (
            {},
            lambda t: {k: v for k, v in t.items() if k != LAYER0_Q_A},
            f"1 tensor(s) missing, e.g. '{LAYER0_Q_A}' (expected shape [4, 64])",
        ),
        (
            {},
            lambda t: t | {"base_model.model.model.layers.4.mlp.up_proj.lora_A.weight": torch.zeros(RANK, 64)},
            "1 unexpected tensor(s), e.g. 'base_model.model.model.layers.4.mlp.up_proj.lora_A.weight' [4, 64]",
        ),
    ],
)
def test_an_adapter_this_run_cannot_reproduce_is_refused_naming_file_key_and_value(
    peft_adapter: tuple[Path, Path], tmp_path: Path, config: dict[str, Any], tensors: Any, expected: str
) -> None:
    base_dir, adapter_dir = peft_adapter
    edited = _edited(adapter_dir, tmp_path, config, tensors)
    errors, _ = model_errors("model", ModelConfig(path=str(base_dir), lora=_lora(edited)), 1, score_head=False)
    assert any(expected.replace("CONFIG", str(edited / ADAPTER_CONFIG)) in error for error in errors), errors
    assert any(str(edited) in error for error in errors)


def test_an_adapter_directory_that_is_not_one_is_refused(peft_adapter: tuple[Path, Path], tmp_path: Path) -> None:
    base_dir, adapter_dir = peft_adapter
    arch = load_architecture(base_dir)
    (tmp_path / "empty").mkdir()
    assert adapter_errors("actor.lora", _lora(tmp_path / "empty"), arch) == [
        f"actor.lora.adapter_path='{tmp_path / 'empty'}': adapter_config.json and adapter_model.safetensors not "
        "found (expected a PEFT LoRA adapter directory)"
    ]
    broken = _edited(adapter_dir, tmp_path, {})
    (broken / ADAPTER_CONFIG).write_text("{not json")
    assert "is not valid JSON" in adapter_errors("actor.lora", _lora(broken), arch)[0]
    assert adapter_errors("actor.lora", _lora(adapter_dir), arch) == []
    with pytest.raises(ValueError, match="adapter_path='x' is set with rank=0: set rank to the adapter's r"):
        LoraConfig(adapter_path="x")
    # Before: accepted, and the run trained the full model (LoRA off) where adapters were meant.
    with pytest.raises(ValueError, match=r"alpha=32.0, target_modules=\['q_proj'\] set with rank=0, which trains"):
        LoraConfig(alpha=32.0, target_modules=["q_proj"])
    assert LoraConfig(rank=8, alpha=32.0, target_modules=["q_proj"]).errors() == []


def test_ppo_names_the_actors_keys_at_start_up(peft_adapter: tuple[Path, Path]) -> None:
    """The check runs with the config's (before any model is built), naming ppo's own keys."""
    from tests.launch import run_cli_here

    _, adapter_dir = peft_adapter
    args = ("ppo", "--config", "ppo-tiny", "actor.lora.rank=8", f"actor.lora.adapter_path={adapter_dir}")
    proc = run_cli_here(*args, "actor.lora.target_modules=[all-linear]", "--print-config", exit_code=2)
    assert f"actor.lora.rank=8 but {adapter_dir / ADAPTER_CONFIG} has r=4: pass actor.lora.rank=4" in proc.stderr
    assert "pass actor.lora.alpha=12.0" in proc.stderr
    assert "pass actor.lora.target_modules=[down_proj,o_proj,q_proj,up_proj,v_proj]" in proc.stderr


def test_a_dropout_other_than_the_adapters_is_said(
    world_of_one, peft_adapter: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's dropout is used (rank and alpha must match; dropout is a training choice), and the log
    says that it differs from the one the adapter was trained with. Before: replaced with no word."""
    from megatron_rlhf.checkpoint.sources import build_role

    base_dir, adapter_dir = peft_adapter
    config = ModelConfig(path=str(base_dir), lora=_lora(adapter_dir, dropout=0.1))
    build_role(
        "actor", config, load_architecture(base_dir), world_size=1, dtype=torch.float32, device=torch.device("cpu")
    )
    assert (
        f"actor.lora.dropout=0.1 is this run's; the adapter at {adapter_dir} was trained with lora_dropout=0.0 "
        "(pass actor.lora.dropout=0.0 to keep it)"
    ) in capsys.readouterr().out
