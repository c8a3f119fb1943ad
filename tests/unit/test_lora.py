"""LoRA: our adapters on megatron's fused linears equal PEFT's on the HF model (float64 logits and
adapter gradients), only the adapters train, and the config's checks name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
from megatron_rlhf.models.hf_weights import shard_from_hf, tensor_maps
from megatron_rlhf.models.lora_config import TARGET_LINEARS, LoraConfig
from megatron_rlhf.models.roles import RoleModel
from tests.helpers import PAD_ID, VOCAB, make_tiny_hf_model

CPU = torch.device("cpu")
BATCH, SEQ_LEN, RANK, ALPHA = 2, 10, 4, 8.0
TOLERANCE = 1e-5
"""Everything runs in float64 but the rotary tables, which HF and megatron both build in float32: their
base models differ by ~2e-6 in the logits and ~3e-7 of the largest gradient. The adapters change the
logits by more than 0.05: a wrong slice would be far above this."""


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rank": -1}, "rank=-1 must be >= 0 (0: no adapters)"),
        ({"alpha": 0.0}, "alpha=0.0 must be > 0 and finite"),
        ({"alpha": float("inf")}, "alpha=inf must be > 0 and finite"),
        ({"dropout": 1.0}, "dropout=1.0 must be in [0, 1)"),
        ({"dropout": -0.1}, "dropout=-0.1 must be in [0, 1)"),
        ({"target_modules": []}, "target_modules is empty: name at least one of"),
        ({"target_modules": ["q_proj", "qproj"]}, "target_modules: 'qproj' is not a known module; expected names"),
        ({"target_modules": ["qproj"]}, "did you mean 'q_proj'?"),
    ],
)
def test_config_errors_name_the_field_and_the_expectation(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        LoraConfig(**({"rank": 8} | fields))
    assert message in str(info.value), info.value


def test_config_targets_expand_all_linear_in_fixed_order() -> None:
    assert LoraConfig(rank=2, target_modules=["v_proj", "q_proj"]).targets() == ("q_proj", "v_proj")
    assert len(LoraConfig(rank=2).targets()) == 7
    assert LoraConfig(rank=4, alpha=8.0).scaling == 2.0
    assert not LoraConfig().enabled and LoraConfig().errors() == []


def _config_error(command: str, overrides: list[str]) -> str:
    from megatron_rlhf.config.loader import ConfigError, load_config
    from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
    from megatron_rlhf.trainer.sft import SFTConfig
    from megatron_rlhf.trainer.supervised import check_config

    with pytest.raises(ConfigError) as info:
        if command == "ppo":
            check_ppo_config(load_config("ppo-tiny", overrides, schema=PPOConfig), 1)
        else:
            check_config(load_config("sft-tiny", overrides, schema=SFTConfig), 1, score_head=False)
    return str(info.value)


def test_commands_name_the_full_key_of_a_bad_lora_setting(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "response": "b"}\n')
    message = _config_error("sft", [f"data.train=[{rows}]", "model.lora.rank=-2", "model.lora.target_modules=[o_prj]"])
    assert "model.lora.rank=-2 must be >= 0" in message
    assert "model.lora.target_modules: 'o_prj' is not a known module" in message and "did you mean 'o_proj'?" in message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.lora.rank=8", "scoring.use_reward_model=true"], "reward.lora.rank=8 must be 0: the reward model"),
        (["reference.lora.rank=4"], "reference.lora.rank=4 must be 0: the reference never trains"),
        (
            ["actor.lora.rank=8", "save_hf=false", "reference.update=ema"],
            "reference.update='ema' with actor.lora.rank=8: a reference that follows a LoRA actor is not supported",
        ),
    ],
)
def test_ppo_refuses_lora_where_it_cannot_train(overrides: list[str], message: str) -> None:
    assert message in _config_error("ppo", overrides)


def peft_model(hf_dir: Path, targets: list[str]):
    """The tiny HF model (float64) with PEFT's adapters, their B random (PEFT starts B at zero)."""
    import peft

    hf = make_tiny_hf_model("qwen2", False, hf_dir).double()
    # PEFT takes all-linear as a string, never inside a list.
    names = "all-linear" if targets == ["all-linear"] else targets
    model = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=names))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def peft_adapters(model) -> dict[tuple[int, str], tuple[torch.nn.Linear, torch.nn.Linear]]:
    """(layer, PEFT name) -> (lora_A, lora_B) linears."""
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            layer = int(name.split("layers.")[1].split(".")[0])
            found[(layer, name.rsplit(".", 1)[1])] = (module.lora_A["default"], module.lora_B["default"])
    return found


def our_adapters(role: RoleModel) -> dict[tuple[int, str], tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    from megatron_rlhf.models.lora import LoraAdapter

    found = {}
    for name, module in role.model.named_modules():
        if isinstance(module, LoraAdapter):
            layer = int(name.split("layers.")[1].split(".")[0])
            for target in module.targets:
                found[(layer, target)] = (module.lora_A[target], module.lora_B[target])
    return found


def our_logits(role: RoleModel, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
    return role.model(input_ids, positions, None)[..., :VOCAB]


@pytest.mark.parametrize(
    "targets", [["all-linear"], ["q_proj", "v_proj"], ["up_proj"], ["k_proj", "gate_proj", "o_proj"]]
)
def test_logits_and_adapter_grads_equal_peft_float64(world_of_one, tmp_path: Path, targets: list[str]) -> None:
    hf = peft_model(tmp_path / "hf", targets)
    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets)
    role = build_role(
        "actor",
        ModelConfig(path=str(tmp_path / "hf"), lora=lora),
        _arch(tmp_path / "hf"),
        world_size=1,
        dtype=torch.float64,
        device=CPU,
        seed=5,
    )
    theirs, ours = peft_adapters(hf), our_adapters(role)
    assert sorted(ours) == sorted(theirs) and ours, (sorted(ours), sorted(theirs))
    with torch.no_grad():
        for key, (a, b) in ours.items():
            a.copy_(theirs[key][0].weight)
            b.copy_(theirs[key][1].weight)

    input_ids = torch.randint(0, PAD_ID, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(BATCH, SEQ_LEN, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    reference = hf(input_ids).logits
    (reference * probe).sum().backward()
    logits = our_logits(role, input_ids)
    (logits * probe).sum().backward()

    with torch.no_grad(), hf.disable_adapter():
        base = hf(input_ids).logits
        assert (our_logits_off(role, input_ids) - base).abs().max() < TOLERANCE
    assert (reference - base).abs().max() > 0.05  # the adapters matter: a wrong slice would show
    assert (logits - reference).abs().max() < TOLERANCE
    for key, (a, b) in ours.items():
        for ours_grad, peft_linear in ((a.grad, theirs[key][0]), (b.grad, theirs[key][1])):
            expected = peft_linear.weight.grad
            assert (ours_grad - expected).abs().max() <= TOLERANCE * expected.abs().max() != 0, key
    from megatron_rlhf.models.lora import adapted_linears, adapters
    from tests.unit.test_hf_weights import MemorySource

    adapter_params = {id(p) for adapter in adapters(role.model) for p in adapter.parameters()}
    base = [p for p in role.model.parameters() if id(p) not in adapter_params]
    assert base and not any(p.requires_grad or p.grad is not None for p in base)

    # merged_delta is PEFT's merge in megatron's fused layout: W + delta equals PEFT's merged HF
    # weights converted by the HF map (pure float64 matmuls: no rotary in the way).
    merged_hf = {name: t.detach() for name, t in hf.merge_and_unload().state_dict().items()}
    maps = {tmap.mcore: tmap for tmap in tensor_maps(role.arch, 1, 0)}
    names = {id(p): name for name, p in role.model.named_parameters()}
    checked = 0
    for _, linear, adapter in adapted_linears(role.model):
        tmap = maps[names[id(linear.weight)]]
        expected = shard_from_hf(tmap, MemorySource(merged_hf), role.arch, 1, 0, role.padded_vocab_size)
        torch.testing.assert_close(
            linear.weight.detach() + adapter.merged_delta().detach(), expected, rtol=0, atol=1e-12
        )
        checked += 1
    assert checked == len({TARGET_LINEARS[t] for t in lora.targets()}) * role.arch.num_layers


def our_logits_off(role: RoleModel, input_ids: torch.Tensor) -> torch.Tensor:
    from megatron_rlhf.models.lora import adapters_off

    with torch.no_grad(), adapters_off(role.model):
        return our_logits(role, input_ids)


def _arch(hf_dir: Path):
    from megatron_rlhf.models.architecture import load_architecture

    return load_architecture(hf_dir)


@pytest.mark.parametrize("path", ["builtin:tiny-llama", "builtin:tiny-llama-rm"])
def test_only_adapters_get_gradient_buffers_optimizer_state_and_updates(world_of_one, path: str) -> None:
    """The base is frozen: DDP buffers and the distributed optimizer hold the adapters (and a score
    head) only, and an SFT step (a critic step for the score-head model) changes only those."""
    from megatron_rlhf.checkpoint.sources import architecture_of
    from megatron_rlhf.models.lora import adapters
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.trainer.plan import stage_adapter_parameters
    from megatron_rlhf.training.objectives import PPOLossConfig, critic_loss, sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state, torch_optimizers
    from megatron_rlhf.training.train import train_step
    from tests.unit.test_packing import LENGTHS, batch_of

    lora = LoraConfig(rank=4, target_modules=["q_proj", "o_proj", "up_proj"])
    role = build_role(
        "actor",
        ModelConfig(path=path, lora=lora),
        architecture_of(path),
        world_size=1,
        dtype=torch.float32,
        device=CPU,
    )
    model = role.model
    trainable = {id(p) for a in adapters(model) for p in a.parameters()}
    if role.arch.score_head:
        trainable |= {id(p) for p in model.output_layer.parameters()}
    assert len(adapters(model)) == 3 * role.arch.num_layers  # qkv, proj, fc1 per layer
    planned = stage_adapter_parameters(role.arch, Layout(1, 1, 1), lora)  # what `megatron-rlhf plan` counts
    assert sum(p.numel() for p in model.parameters() if id(p) in trainable) == planned
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    state = make_train_state(role, OptimConfig(lr=1e-2, clip_grad=100.0))
    in_buffers = {id(p) for buffer in state.ddp_model.buffers for p in buffer.params}
    assert in_buffers == trainable
    held = sum(p.numel() for opt in torch_optimizers(state.optimizer) for g in opt.param_groups for p in g["params"])
    assert held == sum(p.numel() for p in model.parameters() if id(p) in trainable)
    loss_fn = critic_loss(PPOLossConfig()) if role.arch.score_head else sft_loss(role)
    for _ in range(2):  # B starts at zero: A moves from the second step on
        metrics = train_step(state, batch_of(LENGTHS), loss_fn, max_tokens_per_micro_batch=80)
        assert metrics["update_skipped"] == 0.0
    changed = {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed == {name for name, p in model.named_parameters() if id(p) in trainable}


def _tiny_adapted_role(lora: LoraConfig, dtype: torch.dtype) -> RoleModel:
    """builtin:tiny-llama with these adapters and a random B (B starts at zero: the adapters would
    change nothing)."""
    from megatron_rlhf.checkpoint.sources import architecture_of
    from megatron_rlhf.models.lora import adapters

    path = "builtin:tiny-llama"
    role = build_role(
        "actor", ModelConfig(path=path, lora=lora), architecture_of(path), world_size=1, dtype=dtype, device=CPU
    )
    with torch.no_grad():
        for adapter in adapters(role.model):
            for b in adapter.lora_B.values():
                b.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(4))
    return role


def test_dropout_acts_in_training_only(world_of_one) -> None:
    """With lora.dropout the adapters' input is dropped in train mode only; in eval mode the model is
    the one without dropout."""
    from megatron_rlhf.models.lora import adapters

    role = _tiny_adapted_role(LoraConfig(rank=4, dropout=0.5), torch.float32)
    input_ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8)[None].expand_as(input_ids)
    with torch.no_grad():
        role.model.train()
        first, second = (role.model(input_ids, positions, None) for _ in range(2))
        role.model.eval()
        evaluated = role.model(input_ids, positions, None)
        for adapter in adapters(role.model):
            adapter.dropout = 0.0
        without = role.model(input_ids, positions, None)
    assert (first - second).abs().max() > 1e-3
    assert torch.equal(evaluated, without)


def test_a_misspelt_lora_section_is_pointed_to_and_a_value_never_is() -> None:
    from megatron_rlhf.config.loader import ConfigError, load_config
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    with pytest.raises(ConfigError, match=r"did you mean actor\.lora\.rank=8\?"):
        load_config(None, ["actor.lorra.rank=8"], schema=PPOConfig)
    with pytest.raises(ConfigError, match=r"did you mean actor_optim\.lr=1e-6\?"):  # not the lora section
        load_config(None, ["actor.lr=1e-6"], schema=PPOConfig)


def test_a_bf16_base_merged_in_place_comes_back_bit_identical(world_of_one) -> None:
    """In bf16 (a GPU run's dtype), W + delta - delta is not W: the in-place merge (generation in the
    actor's own layout) keeps W and copies it back. The merged weight is W + delta to bf16's precision
    (the delta in float64 here: an independent product)."""
    from megatron_rlhf.models.lora import adapted_weights, adapters, merge_adapters, unmerge_adapters

    role = _tiny_adapted_role(LoraConfig(rank=4), torch.bfloat16)
    before = {name: p.detach().clone() for name, p in role.model.named_parameters()}
    deltas = [
        (weight.detach().clone(), (adapter.fused_b().double() @ adapter.fused_a().double()).detach() * adapter.scaling)
        for weight, adapter in adapted_weights(role.model)
    ]
    kept = merge_adapters(role.model, keep_base=True)
    assert not any(adapter.enabled for adapter in adapters(role.model))
    merged = [weight.detach().clone() for weight, _ in adapted_weights(role.model)]
    for (base, delta), weight in zip(deltas, merged, strict=True):
        exact = base.double() + delta
        assert ((weight.double() - exact).abs() <= 2**-8 * exact.abs()).all()  # half a bf16 step
    back = [(weight.double() - delta).bfloat16() for (_, delta), weight in zip(deltas, merged, strict=True)]
    assert any(not torch.equal(w, base) for w, (base, _) in zip(back, deltas, strict=True))  # not the base
    unmerge_adapters(role.model, kept)
    assert all(adapter.enabled for adapter in adapters(role.model))
    after = dict(role.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())
