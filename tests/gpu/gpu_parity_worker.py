"""torchrun worker on GPUs (nccl): bf16 parity with HF transformers at TP1, and TP2/PP2 on 2 GPUs.

The tolerance is relative to HF's own bf16 error: our bf16 logits may differ from the fp32 HF
reference by at most twice what HF transformers' bf16 run of the same weights differs by (plus a
small floor). bf16's unit roundoff (2^-8) sets that error; a mapping or sharding bug gives errors of
the order of the logits themselves, orders of magnitude above it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import FAMILIES, PAD_ID, hf_reference_outputs, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

BATCH, SEQ_LEN, MICRO_BATCH = 4, 64, 2
RATIO, FLOOR = 2.0, 1e-2


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.hf import load_hf_weights
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.roles import RoleModel
    from megatron_rlhf.parallel.layout import Layout, parallel_groups
    from megatron_rlhf.training.train import forward_outputs

    env, work, results = session.env, session.out, session.results
    layouts = [(1, 1)] + ([(2, 1), (1, 2)] if env.world_size == 2 else [])
    for family in FAMILIES:
        for score_head in (False, True):
            name = f"{family}-{'cls' if score_head else 'lm'}"
            hf_dir = work / name
            if env.rank == 0:
                make_tiny_hf_model(family, score_head, hf_dir)
            dist.barrier()
            hf_model = make_tiny_hf_model(family, score_head, work / f"{name}-rank{env.rank}").to(env.device)
            ids = torch.randint(0, PAD_ID, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
            reference = hf_reference_outputs(hf_model, ids.to(env.device)).float()
            hf_bf16_err = (
                (hf_reference_outputs(hf_model.to(torch.bfloat16), ids.to(env.device)).float() - reference).abs().max()
            )
            arch = load_architecture(hf_dir)
            for tp, pp in layouts:
                groups = parallel_groups(Layout.for_world(tp, pp, env.world_size))
                model = build_model(arch, groups, dtype=torch.bfloat16, device=env.device)
                load_hf_weights(model, arch, groups, hf_dir)
                out = forward_outputs(RoleModel(name, arch, groups, model, hf_dir), ids, MICRO_BATCH)
                err = torch.zeros((), device=env.device)
                if out is not None:
                    err = (out.float() - reference).abs().max()
                dist.all_reduce(err, op=dist.ReduceOp.MAX)
                tag = f"{name}/tp{tp}pp{pp}"
                results[f"{tag}/bf16_max_abs_err"] = err.item()
                results[f"{tag}/hf_bf16_max_abs_err"] = hf_bf16_err.item()
                bound = max(RATIO * hf_bf16_err.item(), FLOOR)
                assert err.item() <= bound, f"{tag}: bf16 error {err.item():.4f} > bound {bound:.4f}"


if __name__ == "__main__":
    with worker_session("cuda") as session:
        main(session)
