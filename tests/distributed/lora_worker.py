"""torchrun worker (2 ranks, gloo): LoRA at TP2 and at PP2 equals LoRA at TP1 (float32).

One tiny Qwen2 (qkv bias, 2 query groups) with adapters on all seven projections, the same full
adapter values in every layout (each rank keeps its slice: column-parallel B by output rows,
row-parallel A by input columns). For each layout:
* each rank trains the parameter count ``megatron-rlhf plan`` counts for its stage;
* the adapters' initial values (A drawn from the seed, B zero), gathered, are TP1's;
* the logits before the step and the SFT loss of one train step equal TP1's;
* the gradient norm (clipped at 1: the split pieces must be marked tensor-parallel for megatron's
  norm) and the adapters' clipped gradients, gathered into full PEFT-shaped tensors, equal TP1's;
* the weights with ``merged_delta`` added, adapters off, give the adapted model's logits;
* a megatron checkpoint saved in the layout and loaded at TP1 holds exactly the full adapters.
Rank 0 writes the max differences to OUT/results.json; the test checks them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import PAD_ID, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

LAYOUTS = ((1, 1), (2, 1), (1, 2))
BATCH, SEQ_LEN, RANK = 4, 12, 4
Key = tuple[int, str, str]  # (global layer number, PEFT name, "A" or "B")


def split_dims(adapter) -> dict[str, int]:
    """The dimension along which each of A and B is split over TP (-1: replicated)."""
    return {"A": 1, "B": -1} if adapter.input_is_split else {"A": -1, "B": 0}


def set_full_values(model: torch.nn.Module, tp: int, tp_rank: int) -> None:
    """Seeded full adapter values per (layer, name), this rank's slice of each."""
    from megatron_rlhf.models.lora import adapted_linears

    with torch.no_grad():
        for layer_number, _, adapter in adapted_linears(model):
            for name in adapter.targets:
                for which, params in (("A", adapter.lora_A), ("B", adapter.lora_B)):
                    local, dim = params[name], split_dims(adapter)[which]
                    shape = list(local.shape)
                    if dim >= 0:
                        shape[dim] *= tp
                    seed = 1000 * layer_number + 10 * adapter.targets.index(name) + (which == "B")
                    full = 0.2 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))
                    local.copy_(full.chunk(tp, dim)[tp_rank] if dim >= 0 else full)


def full_tensors(model: torch.nn.Module, tp_group, *, grads: bool) -> dict[Key, torch.Tensor]:
    """Every adapter value (or gradient) of the whole model as a full PEFT-shaped tensor, on every rank."""
    from megatron_rlhf.models.lora import adapted_linears

    mine: dict[Key, torch.Tensor] = {}
    for layer_number, _, adapter in adapted_linears(model):
        for name in adapter.targets:
            for which, params in (("A", adapter.lora_A), ("B", adapter.lora_B)):
                param = params[name]
                tensor = (param.main_grad if grads else param.detach()).float()
                dim = split_dims(adapter)[which]
                if dim >= 0:
                    parts = [torch.empty_like(tensor) for _ in range(tp_group.size())]
                    dist.all_gather(parts, tensor.contiguous(), group=tp_group)
                    tensor = torch.cat(parts, dim)
                mine[(layer_number, name, which)] = tensor
    everyone: list[dict[Key, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return {key: value for found in everyone for key, value in found.items()}


def world_max(value: float) -> float:
    found = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found.item()


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.mcore import load_mcore_checkpoint, save_mcore_checkpoint
    from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.models.lora import adapted_linears, adapters_off
    from megatron_rlhf.models.lora_config import LoraConfig
    from megatron_rlhf.trainer.plan import stage_adapter_parameters
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import forward_outputs, train_step

    env, results = session.env, session.results
    hf_dir = session.out / "hf"
    if env.rank == 0:
        make_tiny_hf_model("qwen2", False, hf_dir)
    dist.barrier()
    arch = load_architecture(hf_dir)
    input_ids = torch.randint(0, PAD_ID, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": (torch.arange(SEQ_LEN) >= 3).long().expand(BATCH, SEQ_LEN).clone(),
    }
    cfg = ModelConfig(path=str(hf_dir), lora=LoraConfig(rank=RANK, alpha=8.0))

    reference: tuple[torch.Tensor | None, float, float, dict[Key, torch.Tensor]] | None = None
    for tp, pp in LAYOUTS:
        tag = f"tp{tp}pp{pp}"
        cfg.tp, cfg.pp = tp, pp
        role = build_role("actor", cfg, arch, world_size=env.world_size, dtype=torch.float32, device=env.device)
        tp_group = role.groups.pg_collection.tp
        trained = sum(p.numel() for p in role.model.parameters() if p.requires_grad)
        planned = stage_adapter_parameters(arch, role.groups.layout, cfg.lora)  # `megatron-rlhf plan`'s count
        results[f"{tag}/planned_trained_params_exact"] = -world_max(-float(trained == planned))
        initial = full_tensors(role.model, tp_group, grads=False)
        if reference is None:
            first_initial = initial
        exact = initial.keys() == first_initial.keys() and all(
            torch.equal(initial[k], first_initial[k]) for k in initial
        )
        results[f"{tag}/initial_equals_tp1"] = float(exact)
        set_full_values(role.model, tp, tp_group.rank())
        logits = forward_outputs(role, input_ids, BATCH)

        # merged_delta in the base weights' local layout: merged weights, adapters off == adapters on.
        with torch.no_grad(), adapters_off(role.model):
            saved = {}
            for _, linear, adapter in adapted_linears(role.model):
                saved[linear] = linear.weight.detach().clone()
                linear.weight.add_(adapter.merged_delta())
            merged = forward_outputs(role, input_ids, BATCH)
            for linear, weight in saved.items():
                linear.weight.copy_(weight)
        merge_diff = 0.0 if logits is None else (merged - logits).abs().max().item()
        results[f"{tag}/merged_vs_adapters"] = world_max(merge_diff)

        # The adapters' checkpoint holds full tensors: saved in this layout, loaded at TP1, they are the
        # values set above.
        ckpt = session.out / f"ckpt-{tag}"
        save_mcore_checkpoint(role.model, arch, role.groups, ckpt)
        values = full_tensors(role.model, tp_group, grads=False)
        cfg.tp, cfg.pp = 1, 1
        tp1 = build_role("actor", cfg, arch, world_size=env.world_size, dtype=torch.float32, device=env.device)
        load_mcore_checkpoint(tp1.model, tp1.groups, ckpt)
        loaded = full_tensors(tp1.model, tp1.groups.pg_collection.tp, grads=False)
        assert loaded.keys() == values.keys() and all(torch.equal(loaded[k], values[k]) for k in values), tag
        results[f"{tag}/checkpoint_to_tp1_exact"] = 1.0

        state = make_train_state(role, OptimConfig(lr=1e-3, distributed_optimizer=False))
        metrics = train_step(state, batch, sft_loss(role), max_tokens_per_micro_batch=BATCH * SEQ_LEN)
        loss, norm = metrics["loss"], metrics["grad_norm"]
        grads = full_tensors(role.model, tp_group, grads=True)
        if reference is None:
            reference = (logits, loss, norm, grads)
            assert len(grads) == 2 * 7 * arch.num_layers, sorted(grads)
            continue
        ref_logits, ref_loss, ref_norm, ref_grads = reference
        both = logits is not None and ref_logits is not None
        # Relative to the logits' size: fp32 sums in another order differ by some ulps of it (how
        # many depends on the machine's CPU kernels).
        results[f"{tag}/logits_rel"] = world_max(
            ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() if both else 0.0
        )
        results[f"{tag}/loss"] = abs(loss - ref_loss)
        results[f"{tag}/grad_norm_rel"] = abs(norm - ref_norm) / ref_norm
        assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())
        scale = max(g.abs().max().item() for g in ref_grads.values())
        assert scale > 0
        results[f"{tag}/grads_rel"] = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads) / scale
        dist.barrier()


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
