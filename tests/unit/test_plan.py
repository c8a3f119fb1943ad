"""``megatron-rlhf plan``: the memory estimate against the real objects it predicts (models, DDP
gradient buffers, the optimizer after a step, the engine's KV cache, all built on the CPU), against
hand-derived figures, and the command's output and refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
from megatron_rlhf.cli import main
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.hybrid.memory import GIB
from megatron_rlhf.models.architecture import architecture_from_hf_config
from megatron_rlhf.models.builder import build_model, padded_vocab_size
from megatron_rlhf.models.builtin import builtin_config
from megatron_rlhf.parallel.layout import Layout, parallel_groups
from megatron_rlhf.rollout.native import NativeEngine
from megatron_rlhf.rollout.sampling import SamplingParams
from megatron_rlhf.trainer.plan import activation_bytes, micro_batch_tokens, plan_errors, plan_ppo, stage_parameters
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
from megatron_rlhf.training.objectives import sft_loss
from megatron_rlhf.training.optim import OptimConfig, make_train_state
from megatron_rlhf.training.train import train_step
from tests.launch import run_cli_here

ONE = Layout(1, 1, 1)
CPU = torch.device("cpu")
DDP_ALIGN = 64
"""megatron's DDP buffers start every parameter at a multiple of 64 elements (distributed optimizer)."""

# The built-in tiny Llama and variants with each feature the parameter count reads.
TINY = builtin_config("builtin:tiny-llama")
VARIANTS = {
    "llama": TINY,
    "qwen2-tied": {**TINY, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "qwen3-head-dim": {**TINY, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 24},
    "score-head": builtin_config("builtin:tiny-llama-rm"),
}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_the_built_models_parameters(world_of_one, name: str, dtype: torch.dtype) -> None:
    arch = architecture_from_hf_config(VARIANTS[name], source=name)
    model = build_model(arch, parallel_groups(ONE), dtype=dtype, device=CPU)
    vocab = padded_vocab_size(arch.vocab_size, 1)
    assert _bytes(model.parameters()) == stage_parameters(arch, ONE, vocab) * dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_and_optimizer_state_are_the_real_ones_after_a_step(world_of_one, dtype: torch.dtype) -> None:
    """DDP's gradient buffers (fp32, alignment padding aside) and the optimizer's tensors after one
    step (Adam's moments, and fp32 main parameters unless the model is fp32), against the plan."""
    path = "builtin:tiny-llama"
    arch = architecture_of(path)
    state = make_train_state(
        build_role("actor", ModelConfig(path=path), arch, world_size=1, dtype=dtype, device=CPU), OptimConfig(lr=1e-3)
    )
    ids = torch.randint(3, 200, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    train_step(state, batch, sft_loss(state.role), max_tokens_per_micro_batch=64)
    assert state.step == 1
    cfg = load_config("ppo-tiny", [f"dtype={'bf16' if dtype == torch.bfloat16 else 'fp32'}"], schema=PPOConfig)
    planned = plan_ppo(cfg, 1, 80 * GIB).models[0]
    params = list(state.role.model.parameters())
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in state.ddp_model.buffers)
    assert 0 <= grads - planned.grads <= 4 * DDP_ALIGN * (len(params) + 2)
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    optimizer = 0
    for inner in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for group in inner.optimizer.param_groups:
            optimizer += _bytes(p for p in group["params"] if p.untyped_storage().data_ptr() not in model_storages)
        optimizer += _bytes(
            v for s in inner.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        )
    assert optimizer == planned.optimizer
    assert planned.weights == _bytes(params)


def test_kv_cache_is_the_engines(world_of_one) -> None:
    """The plan's KV cache equals the cache the engine allocates for a rollout of the config."""
    cfg = load_config(
        "ppo-tiny",
        [
            "dtype=fp32",
            "prompts_per_step=3",
            "rollout.sampling.n=2",
            "rollout.sampling.max_new_tokens=4",
            "rollout.engine.max_batch_size=4",
            "mini_batch_size=6",
        ],
        schema=PPOConfig,
    )
    plan = plan_ppo(cfg, 1, 80 * GIB)
    role = build_role(
        "actor", cfg.actor, architecture_of(cfg.actor.path), world_size=1, dtype=torch.float32, device=CPU
    )
    engine_cfg = dataclasses.replace(cfg.rollout.engine, max_seq_len=plan.kv_len)
    engine = NativeEngine(role, engine_cfg)
    prompts = [[5, 6, 7], [8, 9], [10]]
    engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert (plan.kv_slots, plan.kv_len) == (4, 64 + 4)
    assert engine._slots.cache.data.nbytes == plan.kv_cache


def test_hand_derived_parameters_and_activations() -> None:
    """h=8, f=16, 4 layers, 2 heads and 1 query group of 4, vocab 10 (padded to 128 x tp), untied."""
    arch = dataclasses.replace(
        architecture_of("builtin:tiny-llama"),
        vocab_size=10,
        hidden_size=8,
        ffn_hidden_size=16,
        num_layers=4,
        num_attention_heads=2,
        num_query_groups=1,
        head_dim=4,
    )
    # per layer at tp=2: norms 2*8, qkv (8+2*4)/2 * 8, proj 8 * 8/2, fc1+fc2 3 * 8 * 16/2
    layer = 16 + 64 + 32 + 192
    embedding = 256 // 2 * 8
    assert stage_parameters(arch, Layout(2, 1, 1), 256) == embedding + 4 * layer + 8 + embedding
    # pp=2: the first stage holds the embedding and 2 layers, the last 2 layers, the final norm and the head
    assert stage_parameters(arch, Layout(2, 2, 1), 256) == embedding + 2 * layer + 8
    # training, per token and layer: 4h + (4q + 3kv + 3f) / tp = 32 + (32 + 12 + 48) / 2 = 78 elements; the
    # logits once (their gradient is written over them), 128 columns per rank
    assert activation_bytes(arch, Layout(2, 1, 1), 256, 10, 2, training=True) == 4 * 10 * 78 * 2 + 10 * 128 * 2
    assert activation_bytes(arch, Layout(2, 2, 1), 256, 10, 2, training=True) == max(
        2 * 2 * 10 * 78 * 2, 2 * 10 * 78 * 2 + 10 * 128 * 2
    )
    # forward: 2h + (q + 2kv + 3f) / tp = 16 + (8 + 8 + 48) / 2 = 48 elements, and 2 logits copies
    assert activation_bytes(arch, Layout(2, 1, 1), 256, 10, 2, training=False) == 10 * 48 * 2 + 2 * 10 * 128 * 2
    assert micro_batch_tokens(16384, 256, 384) == 42 * 384 and micro_batch_tokens(100, 256, 384) == 384
    assert micro_batch_tokens(16384, 8, 384) == 8 * 384


GRPO_1_5B = [
    "actor.path=builtin:llama-1.5b",
    "reference.path=builtin:llama-1.5b",
    "data.max_prompt_length=128",
    "rollout.sampling.max_new_tokens=256",
    "rollout.sampling.n=4",
    "prompts_per_step=64",
    "mini_batch_size=256",
    "rollout.engine.max_batch_size=256",
    "max_steps=5",
    "max_tokens_per_micro_batch=16384",
    "save_hf=false",
]


def test_the_1_5b_preset_is_the_issue_12_command_and_plans() -> None:
    preset = load_config("ppo-grpo-1.5b", [], schema=PPOConfig)
    command = load_config("ppo-tiny", [*GRPO_1_5B, f"output_dir={preset.output_dir}"], schema=PPOConfig)
    assert preset == command
    plan = plan_ppo(preset, 1, int(139.8 * GIB))
    assert [m.role for m in plan.models] == ["actor", "reference"] and plan.dtype == "bfloat16"
    actor = plan.models[0]
    # untied embedding and LM head (151936 = 1187 x 128: no padding), 28 layers of norms, QKV, projection and MLP
    layer = 2 * 1536 + 2048 * 1536 + 1536 * 1536 + 3 * 1536 * 8960
    assert actor.parameters == 2 * 151936 * 1536 + 28 * layer + 1536 and actor.weights == 2 * actor.parameters
    assert actor.optimizer == 12 * actor.parameters and actor.grads == 4 * actor.parameters
    assert plan.kv_cache == 28 * 256 * 2 * 384 * 2 * 128 * 2 and plan.generation_copy == 0
    assert not plan.offload and plan.peak == plan.peaks["keep"]
    # Half the optimizer state on the host: half of it on the device, and the step's fp32 workspace
    # (4 bytes a parameter) counted through the update phase.
    half = plan_ppo(
        load_config("ppo-grpo-1.5b", ["actor_optim.cpu_offload_fraction=0.5"], schema=PPOConfig), 1, int(139.8 * GIB)
    ).models[0]
    assert half.optimizer == 6 * actor.parameters
    assert half.training_activations == actor.training_activations + 4 * actor.parameters


def test_a_lora_actor_plans_no_reference_model_and_its_merge(capsys: pytest.CaptureFixture) -> None:
    """The 1.5B GRPO run with a LoRA actor: the reference is the actor's base (no reference model; the
    weights it saves are printed); generating in the actor's layout, the adapted linears' base weights
    are kept while merged (hand-derived: all-linear adapts every linear of the 28 layers, bf16); none
    when generation reshards."""
    full = plan_ppo(load_config("ppo-grpo-1.5b", [], schema=PPOConfig), 1, int(139.8 * GIB))
    lora = plan_ppo(load_config("ppo-grpo-1.5b", ["actor.lora.rank=8"], schema=PPOConfig), 1, int(139.8 * GIB))
    assert [m.role for m in lora.models] == ["actor"] and full.reference_saved == 0
    assert lora.reference_saved == full.models[1].weights > 0
    assert lora.lora_base == 2 * 28 * (2048 * 1536 + 1536 * 1536 + 3 * 1536 * 8960) and full.lora_base == 0
    actor = lora.models[0]
    lasting = actor.weights + actor.grads + actor.optimizer
    kept = lora.kv_cache + lora.graph_outputs  # till the next rollout; the kept base only while generating
    assert lora.peaks["keep"].generation == lasting + kept + lora.lora_base + lora.generation_workspace
    resharded = plan_ppo(
        load_config("ppo-grpo-1.5b", ["actor.lora.rank=8", "actor.tp=2", "rollout.tp=1"], schema=PPOConfig),
        2,
        int(139.8 * GIB),
    )
    assert resharded.lora_base == 0 and resharded.generation_copy > 0
    assert main(["plan", "--config", "ppo-grpo-1.5b", "--gpu-memory-gib", "139.8", "actor.lora.rank=8"]) == 0
    out = capsys.readouterr().out
    saved = f"saves {lora.reference_saved / GIB:.2f} GiB of weights per GPU"
    assert "reference  the actor's base, its LoRA adapters off: no reference model" in out and saved in out
    assert "LoRA base weights kept while merged" in out


@pytest.fixture
def no_gpu_no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` must touch neither a GPU nor torch.distributed."""

    def refuse(*args, **kwargs):
        raise AssertionError("plan touched a GPU or started torch.distributed")

    for name in ("is_available", "mem_get_info", "device_count", "init"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)


def test_plan_prints_layouts_and_phases(no_gpu_no_processes, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(
            [
                "plan",
                "--config",
                "ppo-grpo-1.5b",
                "--world-size",
                "2",
                "--gpu-memory-gib",
                "139.8",
                "actor.tp=2",
                "rollout.tp=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "actor      TP2xPP1xDP1" in out and "reference  TP1xPP1xDP2" in out
    assert "generation TP1xPP1xDP2   resharded from the actor's TP2xPP1xDP1" in out
    assert "training" in out and "generation" in out and "auto would decide: hybrid.offload=auto" in out
    assert main(["plan", "--config", "ppo-grpo-1.5b", "--json", "--gpu-memory-gib", "139.8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["models"][0]["layout"] == "TP1xPP1xDP1"
        and data["peaks"]["keep"]["training"] > data["peaks"]["keep"]["generation"]
    )
    assert main(["plan", "--config", "sft-tiny", "data.train=[builtin:arithmetic-sft]"]) == 0
    assert "model      TP1xPP1xDP1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["actor.tp=5"], "actor.tp=5 must divide num_attention_heads=12"),
        (["plan.world_size=3", "actor.tp=2"], "actor.tp*actor.pp=2 must divide the world size 3"),
        (["plan.world_size=0"], "plan.world_size=0 must be >= 1"),
        (["--gpu-memory-gib", "40"], "the training phase needs about"),
        (
            ["--gpu-memory-gib", "36", "max_tokens_per_micro_batch=1024", "hybrid.offload=never"],
            "the generation phase needs about",
        ),
    ],
)
def test_impossible_configs_are_refused_naming_the_keys(
    no_gpu_no_processes, capsys: pytest.CaptureFixture, args, message
) -> None:
    assert main(["plan", "--config", "ppo-grpo-1.5b", *args]) == 2
    assert message in capsys.readouterr().err


def test_an_sft_config_planned_without_its_trainer_is_told_to_name_it(tmp_path: Path) -> None:
    """A plan is of a ppo config unless plan.trainer says otherwise; an sft config's 'model' was then
    answered with 'did you mean actor.path', which does not lead to the fix."""
    config = tmp_path / "my-sft.yaml"
    config.write_text('model: {path: "builtin:tiny-llama"}\noptim: {lr: 1.0e-4}\n')
    refused = run_cli_here("plan", "--config", str(config), exit_code=2)
    assert refused.stderr.rstrip().endswith("it loads as an sft or rm run's config: add plan.trainer=sft (or rm)")
    assert (
        "data.train is empty" in run_cli_here("plan", "--config", str(config), "plan.trainer=sft", exit_code=2).stderr
    )


def test_the_1_5b_preset_does_not_fit_an_h100_with_the_headroom_and_half_its_micro_batch_does() -> None:
    """On an 80 GB H100 the preset's run died at step 2 (CUDA out of memory with 69.5 GiB allocated and
    about 6 GiB more held outside PyTorch's tensors) where the plan had said 74.3 GiB fits in 79.2.
    Plans now keep a 10% headroom; a run gets them with the architectures it has checked."""
    h100 = int(79.18 * GIB)
    preset = load_config("ppo-grpo-1.5b", [], schema=PPOConfig)
    plan = plan_ppo(preset, 1, h100)
    assert 0.9 * h100 < plan.peak.training < h100
    (problem,) = plan_errors(plan)
    assert problem.startswith("the training phase needs about 74.3 GiB per GPU, more than 71.3 GiB")
    assert plan_ppo(preset, 1, h100, check_ppo_config(preset, 1).archs) == plan
    half = load_config("ppo-grpo-1.5b", ["max_tokens_per_micro_batch=8192"], schema=PPOConfig)
    assert plan_errors(plan_ppo(half, 1, h100)) == []
