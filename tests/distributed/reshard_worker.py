"""torchrun worker (gloo, 2 ranks, fp32): the actor's generation copy made by resharding.

    reshard_worker.py OUT

For each training layout (TP2, PP2, and TP1xDP2 -> generation TP2) and each model (llama: untied
embeddings, rope scaling; qwen2: tied embeddings, QKV bias):
* the generation copy's logits equal the training model's to 1e-5;
* greedy generation from the copy equals greedy generation from a TP1 model built directly from
  the same checkpoint, token for token.
Then, after an in-place perturbation of the training weights, and again after a real optimizer step
(megatron DDP + distributed optimizer), ``refresh()`` brings the copy to the new weights (logits to
1e-5) writing into the same storage; the refreshes are interleaved with other model pairs of the
same layouts (megatron's plan cache is keyed by layout, not by model).
The copy's memory exists only from ``refresh()`` to ``release()``; a refresh after a release
restores it exactly. Zero copy (generation tp == training tp, pp 1) returns the very same objects.
Raises on any mismatch; rank 0 writes the measured figures to OUT/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import PAD_ID, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

PROMPT_LENGTHS = (3, 9, 5, 1, 7)
NEW_TOKENS = 8
MICRO_BATCH = 2
TOLERANCE = 1e-5
# (case, family, training tp, training pp, generation tp)
CASES = (
    ("tp2", "llama", 2, 1, 1),
    ("pp2", "llama", 1, 2, 1),
    ("tp2_tied", "qwen2", 2, 1, 1),
    ("pp2_tied", "qwen2", 1, 2, 1),
    ("tp1_to_tp2", "llama", 1, 1, 2),
)


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
    from megatron_rlhf.hybrid.reshard import WeightResharder
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import forward_outputs, train_step

    env, out, results = session.env, session.out, session.results
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, PAD_ID, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    input_ids = torch.randint(0, PAD_ID, (4, 12), generator=g)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engine_cfg = NativeEngineConfig(max_batch_size=2, max_seq_len=32)

    def build(family: str, tp: int, pp: int):
        path = out / family
        return build_role(
            "actor",
            ModelConfig(path=str(path), tp=tp, pp=pp),
            load_architecture(path),
            world_size=env.world_size,
            dtype=torch.float32,
            device=env.device,
        )

    def world_max(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def last_stage_logits(role):
        """The model's logits, from its last pipeline stage, on every rank."""
        logits = forward_outputs(role, input_ids, MICRO_BATCH)
        gathered: list = [None] * env.world_size
        dist.all_gather_object(gathered, logits)
        return next(x for x in gathered if x is not None)

    def logits_diff(source, copy) -> float:
        return world_max((last_stage_logits(source) - last_stage_logits(copy)).abs().max().item())

    def greedy_tokens(role) -> list[list[int]]:
        return [c.token_ids for c in NativeEngine(role, engine_cfg).generate(prompts, greedy)]

    for family in ("llama", "qwen2"):
        if env.rank == 0:
            make_tiny_hf_model(family, False, out / family)
    dist.barrier()
    reference_tokens = {family: greedy_tokens(build(family, 1, 1)) for family in ("llama", "qwen2")}

    # 1, 2: TP2 / PP2 (and TP1 -> TP2) training layouts -> generation copies.
    resharders = {}
    for case, family, tp, pp, gen_tp in CASES:
        source = build(family, tp, pp)
        resharder = WeightResharder(source, gen_tp)
        params = list(resharder.target.model.parameters())
        unallocated = int(world_max(sum(p.untyped_storage().nbytes() for p in params)))
        if unallocated:
            raise AssertionError(f"{case}: the copy holds {unallocated} bytes before its first refresh")
        copy = resharder.refresh()
        # The same parameter objects, now views of one buffer of destination_bytes().
        storages = {p.untyped_storage().data_ptr() for p in copy.model.parameters()}
        same_objects = all(a is b for a, b in zip(params, copy.model.parameters(), strict=True))
        nbytes = params[0].untyped_storage().nbytes()
        if len(storages) != 1 or not same_objects or nbytes != resharder.destination_bytes():
            raise AssertionError(
                f"{case}: refresh did not fill the one flat buffer ({len(storages)} storages, {nbytes} bytes)"
            )
        expected = Layout(tp=gen_tp, pp=1, dp=env.world_size // gen_tp)
        if resharder.zero_copy or copy.model is source.model or copy.groups.layout != expected:
            raise AssertionError(f"{case}: expected a separate copy in {expected}, got {copy.groups.layout}")
        if copy.padded_vocab_size != source.padded_vocab_size:
            raise AssertionError(f"{case}: padded vocab {copy.padded_vocab_size} != {source.padded_vocab_size}")
        diff = logits_diff(source, copy)
        tokens = greedy_tokens(copy)
        mismatches = int(world_max(sum(a != b for a, b in zip(tokens, reference_tokens[family], strict=True))))
        results[f"{case}/logits_max_abs_diff"] = diff
        results[f"{case}/greedy_mismatches"] = mismatches
        if diff > TOLERANCE:
            raise AssertionError(f"{case}: generation copy logits differ from the training model's by {diff:.3e}")
        if mismatches:
            raise AssertionError(f"{case}: {mismatches} prompts' greedy tokens differ from the TP1 model's")
        resharders[case] = resharder

    # A pair still copies correctly after the cache switched away from it and back.
    results["tp2_tied/refreshed_again_logits_max_abs_diff"] = diff = logits_diff(
        resharders["tp2_tied"].source, resharders["tp2_tied"].refresh()
    )
    if diff > TOLERANCE:
        raise AssertionError(f"tp2_tied: copy after other pairs differs by {diff:.3e}")

    def check_refresh(case: str, update: str, change, *, release: bool) -> None:
        """Change the training weights with ``change()``, refresh, compare (logits, storage, object).
        With ``release``, the copy's memory is freed first (as the hybrid engine does between
        generations) and the refresh must rebuild it; without, it must write in place."""
        resharder = resharders[case]
        source, copy = resharder.source, resharder.target
        pointers = [p.data_ptr() for p in copy.model.parameters()]
        change(source)
        stale = logits_diff(source, copy)
        if release:
            resharder.release()
            held = int(world_max(sum(p.untyped_storage().nbytes() for p in copy.model.parameters())))
            if held:
                raise AssertionError(f"{case}/{update}: release() left {held} bytes allocated")
        refreshed = resharder.refresh()
        diff = logits_diff(source, refreshed)
        params = list(refreshed.model.parameters())
        moved = int(world_max(sum(a != p.data_ptr() for a, p in zip(pointers, params, strict=True))))
        key = f"{case}/{update}"
        results[f"{key}/stale_logits_max_abs_diff"] = stale
        results[f"{key}/refreshed_logits_max_abs_diff"] = diff
        results[f"{key}/refresh_moved_tensors"] = moved
        results[f"{key}/refresh_same_role_object"] = refreshed is copy
        if stale < 1e-3:
            raise AssertionError(f"{key}: the update did not change the logits ({stale:.3e})")
        if diff > TOLERANCE:
            raise AssertionError(f"{key}: refreshed copy differs from the updated source by {diff:.3e}")
        if (moved and not release) or refreshed is not copy:
            raise AssertionError(f"{key}: refresh reallocated {moved} tensors (or returned a new RoleModel)")

    def perturb(source) -> None:
        noise = torch.Generator().manual_seed(17)  # the same on every rank: replicated params stay equal
        with torch.no_grad():
            for p in source.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=noise, dtype=p.dtype))

    def optimizer_step(source) -> None:
        """One real SFT step: megatron DDP (params moved into its buffers) + distributed optimizer."""
        state = make_train_state(source, OptimConfig(lr=1e-2))
        ids = torch.randint(0, PAD_ID, (4, 16), generator=torch.Generator().manual_seed(23))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        train_step(state, batch, sft_loss(source), max_tokens_per_micro_batch=32)

    # 3: change the training weights, refresh, compare. The llama TP2 refresh directly follows the
    # qwen2 TP2 one (same layout sizes: megatron's plan cache must not hand it qwen2's plan), and
    # the llama PP2 one has a stale qwen2 PP2 plan under its key unless the cache is cleared.
    for case in ("tp2", "pp2"):
        check_refresh(case, "perturbed", perturb, release=False)
    for case in ("tp2", "pp2"):
        check_refresh(case, "optimizer_step", optimizer_step, release=True)

    # 4: zero copy.
    for tp in (1, 2):
        source = build("llama", tp, 1)
        resharder = WeightResharder(source, tp)
        copy = resharder.refresh()
        same = (
            resharder.zero_copy and copy is source and copy.model is source.model and resharder.destination_bytes() == 0
        )
        results[f"zero_copy_tp{tp}/same_object"] = same
        if not same:
            raise AssertionError(f"zero copy at TP{tp}: refresh() did not return the source RoleModel itself")


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
