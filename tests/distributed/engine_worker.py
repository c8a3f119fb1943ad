"""torchrun worker (gloo): log-probs, entropy and one PPO actor / critic update in any layout.

    reference run (1 rank):  engine_worker.py OUT reference
    comparison (4 ranks):    engine_worker.py OUT compare REFERENCE_OUT

MEGATRON_RLHF_TEST_DEVICE=cuda runs it on GPUs (fp32 throughout, so the same tolerances apply);
with 2 ranks the comparison layouts are TP1xDP2, TP2 and PP2.

The reference run, with sequences unpacked, also checks that the update does not depend on the
micro-batch split. The comparison run repeats everything with packed sequences (rows of 3 to 20
tokens share rows of micro-batches) at TP1xDP4, TP2xDP2, PP2xDP2 and TP2xPP2 and compares with the
reference: log-probs/entropy to 1e-5 absolute, new weights to 1e-5 relative per tensor
(||new - ref|| / ||ref||, Frobenius). The element-wise maximum is reported too: Adam's first step
is nearly sign(g) * lr, so the few elements whose gradient is at fp32 noise level can differ by a
fraction of lr between layouts (summation order), without any layout being wrong.
Any mismatch raises; figures go to OUT/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import load_all_tensors
from tests.launch import WorkerSession, worker_session

BATCH, SEQ_LEN = 8, 20
SMALL_BUDGET, LARGE_BUDGET = 48, 100_000  # several micro-batches vs one
LOGPROB_TOL, WEIGHT_RTOL = 1e-5, 1e-5


def make_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, SEQ_LEN + 1, (BATCH,), generator=g)
    prompt_lengths = torch.randint(4, 9, (BATCH,), generator=g)
    positions = torch.arange(SEQ_LEN)[None]
    attention = (positions < lengths[:, None]).long()
    response = ((positions >= prompt_lengths[:, None]) & (positions < lengths[:, None])).float()
    return {
        "input_ids": torch.randint(0, 512, (BATCH, SEQ_LEN), generator=g) * attention,
        "attention_mask": attention,
        "response_mask": response,
        "advantages": torch.randn(BATCH, SEQ_LEN, generator=g) * response,
        "returns": torch.randn(BATCH, SEQ_LEN, generator=g) * response,
        "noise": 0.1 * torch.randn(BATCH, SEQ_LEN, generator=g),
    }


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.hf import save_hf_checkpoint
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.models.builtin import builtin_checkpoint
    from megatron_rlhf.parallel.distributed import seed_everything
    from megatron_rlhf.training.objectives import (
        PPOLossConfig,
        critic_loss,
        logprobs_output,
        next_token_logprobs,
        ppo_actor_loss,
        token_aligned,
        token_values_output,
    )
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import forward_pass, train_step

    env, out, results = session.env, session.out, session.results
    mode = session.args[0]
    reference = Path(session.args[1]) if mode == "compare" else None
    pack = mode == "compare"
    layouts = {1: [(1, 1)], 2: [(1, 1), (2, 1), (1, 2)], 4: [(1, 1), (2, 1), (1, 2), (2, 2)]}[env.world_size]
    split_check_layout = layouts[-1]
    full = make_batch()
    loss_cfg = PPOLossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, entropy_coef=0.01)
    optim_cfg = OptimConfig(lr=1e-3, adam_eps=1e-6, clip_grad=1.0)

    def build(role: str, path: str, tp: int, pp: int):
        seed_everything(0)
        return build_role(
            role,
            ModelConfig(path=path, tp=tp, pp=pp),
            architecture_of(path),
            world_size=env.world_size,
            dtype=torch.float32,
            device=env.device,
        )

    def gather_dp(role, local: torch.Tensor | None) -> torch.Tensor | None:
        """Per-DP-rank rows -> the full batch, on last-stage ranks."""
        if local is None:
            return None
        parts = [torch.empty_like(local) for _ in range(role.groups.layout.dp)]
        dist.all_gather(parts, local.contiguous(), group=role.groups.pg_collection.dp)
        return torch.cat(parts)

    def local_rows(role, batch):
        dp, rank = role.groups.layout.dp, role.groups.dp_rank
        return {k: v[rank * BATCH // dp : (rank + 1) * BATCH // dp] for k, v in batch.items()}

    def entropy_output(role):
        return lambda piece, logits: token_aligned(
            piece, next_token_logprobs(role, piece, logits, with_entropy=True)[1]
        )

    def update(tag: str, role_name: str, path: str, tp: int, pp: int, budget: int) -> None:
        role = build(role_name, path, tp, pp)
        batch = local_rows(role, full)
        if role_name == "actor":
            probe = forward_pass(
                role, batch, logprobs_output(role), max_tokens_per_micro_batch=budget, pack_sequences=pack
            )
            batch["old_logprobs"] = _shared(role, probe, batch) + batch["noise"] * batch["response_mask"]
            loss_fn = ppo_actor_loss(role, loss_cfg, temperature=1.0)
        else:
            probe = forward_pass(
                role, batch, token_values_output(), max_tokens_per_micro_batch=budget, pack_sequences=pack
            )
            batch["old_values"] = _shared(role, probe, batch) + batch["noise"] * batch["response_mask"]
            loss_fn = critic_loss(loss_cfg)
        state = make_train_state(role, optim_cfg)
        metrics = train_step(state, batch, loss_fn, max_tokens_per_micro_batch=budget, pack_sequences=pack)
        results[f"{tag}/loss"] = metrics["loss"]
        results[f"{tag}/grad_norm"] = metrics["grad_norm"]
        save_hf_checkpoint(role.model, role.arch, role.groups, out / tag)

    for tp, pp in layouts:
        name = f"tp{tp}pp{pp}"
        actor = build("actor", "builtin:tiny-llama", tp, pp)
        batch = local_rows(actor, full)
        for label, fn in (
            ("logprobs_t1", logprobs_output(actor)),
            ("logprobs_t07", logprobs_output(actor, temperature=0.7)),
            ("entropy", entropy_output(actor)),
        ):
            value = gather_dp(
                actor, forward_pass(actor, batch, fn, max_tokens_per_micro_batch=SMALL_BUDGET, pack_sequences=pack)
            )
            if value is not None and env.rank == _last_stage_rank0(actor):
                torch.save(value.cpu(), out / f"{name}-{label}.pt")
        dist.barrier()
        update(f"actor-{name}", "actor", "builtin:tiny-llama", tp, pp, SMALL_BUDGET)
        update(f"critic-{name}", "critic", "builtin:tiny-llama-rm", tp, pp, SMALL_BUDGET)
        if (tp, pp) == split_check_layout:
            update(f"actor-{name}-one-micro-batch", "actor", "builtin:tiny-llama", tp, pp, LARGE_BUDGET)

    initial_dir = builtin_checkpoint("builtin:tiny-llama")  # collective: every rank calls it
    if env.rank == 0:
        _check(out, reference, layouts, results, load_all_tensors(initial_dir))


def _last_stage_rank0(role) -> int:
    """Global rank of the first TP/DP rank of the last pipeline stage."""
    pp_ranks = role.groups.grid.get_rank_enum("pp")[0]
    return pp_ranks[-1]


def _shared(role, local: torch.Tensor | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Broadcast a last-stage result to every stage of the pipeline (the loss needs it everywhere)."""
    pg = role.groups.pg_collection.pp
    device = next(role.model.parameters()).device
    value = local if local is not None else torch.empty(batch["input_ids"].shape, device=device)
    dist.broadcast(value, src=dist.get_global_rank(pg, role.groups.layout.pp - 1), group=pg)
    return value.cpu()


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor relative difference ||a - b|| / ||b|| (Frobenius)."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


def _max_elementwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check(out: Path, reference: Path | None, layouts, results: dict[str, float], initial: dict) -> None:
    ref_dir = reference or out
    ref_actor = load_all_tensors(ref_dir / "actor-tp1pp1")
    results["actor_update_moved_weights_rel"] = _max_rel(ref_actor, initial)
    assert results["actor_update_moved_weights_rel"] > 1e-3, "the update did not change the weights"
    if reference is None:
        one = load_all_tensors(out / "actor-tp1pp1-one-micro-batch")
        results["split_independence_rel"] = _max_rel(one, ref_actor)
        assert results["split_independence_rel"] < WEIGHT_RTOL, results
        assert abs(results["actor-tp1pp1/loss"] - results["actor-tp1pp1-one-micro-batch/loss"]) < 1e-6
        return
    for tp, pp in layouts:
        name = f"tp{tp}pp{pp}"
        for label in ("logprobs_t1", "logprobs_t07", "entropy"):
            diff = (torch.load(out / f"{name}-{label}.pt") - torch.load(reference / f"tp1pp1-{label}.pt")).abs().max()
            results[f"{name}/{label}_max_abs_diff"] = diff.item()
            assert diff.item() < LOGPROB_TOL, f"{name} {label}: {diff.item():.3e}"
        for role in ("actor", "critic"):
            new, ref = load_all_tensors(out / f"{role}-{name}"), load_all_tensors(reference / f"{role}-tp1pp1")
            rel = _max_rel(new, ref)
            results[f"{name}/{role}_update_max_rel_diff"] = rel
            results[f"{name}/{role}_update_max_abs_elementwise"] = _max_elementwise(new, ref)
            assert rel < WEIGHT_RTOL, f"{name} {role} update differs from TP1 by {rel:.3e}"
    name = "tp{}pp{}".format(*layouts[-1])
    rel = _max_rel(load_all_tensors(out / f"actor-{name}-one-micro-batch"), load_all_tensors(out / f"actor-{name}"))
    results[f"{name}/split_independence_rel"] = rel
    assert rel < WEIGHT_RTOL, f"{name} update depends on the micro-batch split: {rel:.3e}"


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
