"""The model-building smoke run: a quick check of a cluster and a config before a long job.

It does what every RLHF step relies on: validate the config against the world and the models,
build the four models (actor, critic, reference, reward) each in its own parallel layout, load
their weights, and run a forward pass through each with megatron's pipeline schedule.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.sources import build_role
from megatron_rlhf.config.loader import to_yaml
from megatron_rlhf.config.run import resolve_dtype
from megatron_rlhf.metrics.log import environment_report, log, timed
from megatron_rlhf.models.roles import ROLES
from megatron_rlhf.parallel.distributed import DistEnv, seed_everything
from megatron_rlhf.trainer.smoke_config import SmokeConfig, check_smoke_config
from megatron_rlhf.training.train import forward_outputs

SMOKE_BATCH, SMOKE_SEQ_LEN = 4, 32


def run_smoke(cfg: SmokeConfig, env: DistEnv) -> dict[str, dict[str, float]]:
    archs = check_smoke_config(cfg, env.world_size)
    seed_everything(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)
    log(f"world {env.world_size} on {env.device.type}, dtype {str(dtype).removeprefix('torch.')}")
    log(environment_report())  # versions first: the smoke run doubles as an image's health check
    out_dir = Path(cfg.output_dir)
    if env.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(to_yaml(cfg))
    report: dict[str, dict[str, float]] = {}
    for role in ROLES:
        times: dict[str, float] = {}
        with timed(f"{role}: build+load", env.device, times):
            role_model = build_role(
                role, cfg.role(role), archs[role], world_size=env.world_size, dtype=dtype, device=env.device
            )
        arch = role_model.arch
        local_params = sum(p.numel() for p in role_model.model.parameters())
        log(
            f"{role:9s} {arch.hf_class_name} {arch.num_layers} layers, {role_model.groups.layout}, "
            f"{local_params / 1e6:.2f}M parameters on rank 0, from {role_model.source}"
        )
        generator = torch.Generator().manual_seed(cfg.seed)
        input_ids = torch.randint(0, arch.vocab_size, (SMOKE_BATCH, SMOKE_SEQ_LEN), generator=generator)
        with timed(f"{role}: forward", env.device, times):
            outputs = forward_outputs(role_model, input_ids, micro_batch_size=SMOKE_BATCH // 2)
        stats = torch.zeros(2, dtype=torch.float64)
        if outputs is not None and role_model.groups.tp_rank == 0 and role_model.groups.dp_rank == 0:
            stats = torch.tensor([outputs.float().mean().item(), outputs.float().std().item()], dtype=torch.float64)
        dist.all_reduce(stats)  # exactly one rank contributes: the last stage's first TP/DP rank
        kind, width = ("values", arch.num_labels) if arch.score_head else ("logits", arch.vocab_size)
        log(f"{role:9s} {kind} {(SMOKE_BATCH, SMOKE_SEQ_LEN, width)} mean {stats[0]:+.4f} std {stats[1]:.4f}")
        report[role] = {**times, "output_mean": stats[0].item(), "output_std": stats[1].item()}
        del role_model
    if env.rank == 0:
        (out_dir / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"smoke run done: {out_dir / 'smoke.json'}")
    return report
