"""torchrun worker (4 ranks, gloo): HF parity, export round trip and dist-checkpoint resharding.

For each family and head (causal LM, sequence classifier) and each layout TP1, TP2, PP2, TP2xPP2:
* logits / values from our import match HF transformers (fp32) to 1e-4;
* HF export from that layout is bit-identical to the original HF tensors;
* a megatron checkpoint saved in that layout, reloaded at TP1 and exported, is bit-identical too.
Rank 0 writes the measured figures to RESULTS_JSON. Any failure raises (non-zero exit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import FAMILIES, PAD_ID, hf_reference_outputs, load_all_tensors, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
TOLERANCE = 1e-4
BATCH, SEQ_LEN, MICRO_BATCH = 4, 12, 2


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.hf import load_hf_weights, save_hf_checkpoint
    from megatron_rlhf.checkpoint.mcore import load_mcore_checkpoint, save_mcore_checkpoint
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.roles import RoleModel
    from megatron_rlhf.parallel.layout import Layout, parallel_groups
    from megatron_rlhf.training.train import forward_outputs

    env, work, results = session.env, session.out, session.results
    families = session.args[0].split(",") if session.args else FAMILIES
    tp1 = parallel_groups(Layout.for_world(1, 1, env.world_size))

    for family in families:
        for score_head in (False, True):
            name = f"{family}-{'cls' if score_head else 'lm'}"
            hf_dir = work / name / "hf"
            if env.rank == 0:
                # The llama LM is saved sharded, exercising the index-file path.
                make_tiny_hf_model(family, score_head, hf_dir, sharded=(name == "llama-lm"))
            dist.barrier()
            hf_model = make_tiny_hf_model(family, score_head, work / name / f"unused-{env.rank}")
            input_ids = torch.randint(0, PAD_ID, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
            reference = hf_reference_outputs(hf_model, input_ids)
            original = load_all_tensors(hf_dir)
            arch = load_architecture(hf_dir)

            for tp, pp in LAYOUTS:
                tag = f"{name}/tp{tp}pp{pp}"
                groups = parallel_groups(Layout.for_world(tp, pp, env.world_size))
                model = build_model(arch, groups, dtype=torch.float32, device=env.device)
                load_hf_weights(model, arch, groups, hf_dir)
                role = RoleModel(role=name, arch=arch, groups=groups, model=model, source=hf_dir)
                out = forward_outputs(role, input_ids, MICRO_BATCH)
                diff = torch.zeros(())
                if out is not None:
                    diff = (out - reference).abs().max()
                dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                results[f"{tag}/max_abs_diff"] = diff.item()
                assert diff.item() < TOLERANCE, f"{tag}: max abs diff {diff.item():.3e} vs HF"

                export_dir = work / name / f"export-tp{tp}pp{pp}"
                save_hf_checkpoint(model, arch, groups, export_dir, side_files_from=hf_dir)
                ckpt_dir = work / name / f"mcore-tp{tp}pp{pp}"
                save_mcore_checkpoint(model, arch, groups, ckpt_dir, side_files_from=hf_dir)
                resharded = build_model(arch, tp1, dtype=torch.float32, device=env.device)
                load_mcore_checkpoint(resharded, tp1, ckpt_dir)
                reexport_dir = work / name / f"reexport-tp{tp}pp{pp}"
                save_hf_checkpoint(resharded, arch, tp1, reexport_dir)
                if env.rank == 0:
                    for label, directory in (("export", export_dir), ("mcore->tp1 export", reexport_dir)):
                        exported = load_all_tensors(directory)
                        assert exported.keys() == original.keys(), (
                            f"{tag} {label}: tensor names differ: {sorted(exported.keys() ^ original.keys())}"
                        )
                        bad = [k for k in original if not torch.equal(original[k], exported[k])]
                        assert not bad, f"{tag} {label}: not bit-identical: {bad[:5]}"
                    results[f"{tag}/round_trip_bit_identical"] = 1.0
                dist.barrier()


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
