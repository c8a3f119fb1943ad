"""torchrun worker (gloo, 2 ranks, fp32): PPO steps with ``reference.update`` none / periodic / ema.

    reference_worker.py OUT

For each case of ``CASES`` it sets up the ``ppo-tiny`` run (GRPO with a KL loss, so the reference
is built) in the given layouts and runs ``ppo_step`` a few times; one pair of layouts pads the
vocabulary differently by default, with tied embeddings. Before the first step it writes
the reference as an HF checkpoint to OUT/<case>/reference-0, and after each step k the actor and
the reference to OUT/<case>/actor-k and OUT/<case>/reference-k (full tensors, layout-free), so the
test can check the reference against the actor independently. Rank 0 writes each step's
``reference/refreshed`` metric and time keys, whether the reference's data-parallel replicas hold
equal weights, and both models' padded vocabularies to OUT/results.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import make_chat_tokenizer, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

# A Qwen2 model with tied embeddings and a vocabulary of 600: padded to 640 at TP1 but 768 at TP2,
# so a TP2 reference must take the TP1 actor's padding.
TIED = "tied-qwen2"
# case -> (steps, overrides); paths are builtin:tiny-llama unless a case names TIED.
CASES = {
    "ema_tp2_to_tp1": (3, ["actor.tp=2", "reference.tp=1", "reference.update=ema", "reference.ema_decay=0.6"]),
    "ema_tied_tp1_to_tp2": (
        3,
        [
            f"actor.path={TIED}",
            f"reference.path={TIED}",
            "reference.tp=2",
            "reference.update=ema",
            "reference.ema_decay=0.6",
        ],
    ),
    "ema_same_tp2": (3, ["actor.tp=2", "reference.tp=2", "reference.update=ema", "reference.ema_decay=0.6"]),
    "periodic_pp2_to_tp2": (
        4,
        ["actor.pp=2", "reference.tp=2", "reference.update=periodic", "reference.update_every=2"],
    ),
    "none_tp2_to_tp1": (2, ["actor.tp=2", "reference.tp=1"]),
}
COMMON = [
    "prompts_per_step=4",
    "rollout.sampling.n=4",
    "mini_batch_size=16",
    "rollout.sampling.max_new_tokens=16",
    "actor_optim.lr=1e-3",
]


def replicas_equal(role) -> bool:
    """Whether every data-parallel replica of ``role`` holds the same weights (exact sums compared)."""
    total = torch.stack([p.detach().double().sum() for p in role.model.parameters()])
    gathered = [torch.empty_like(total) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, total)
    groups = role.groups
    coords = [None] * dist.get_world_size()
    dist.all_gather_object(coords, (groups.tp_rank, groups.pp_rank))
    mine = coords[dist.get_rank()]
    return all(torch.equal(t, total) for t, c in zip(gathered, coords, strict=True) if c == mine)


def save(role, directory: Path) -> None:
    """``role``'s full weights as an HF checkpoint (collective)."""
    from megatron_rlhf.checkpoint.hf import save_hf_checkpoint

    save_hf_checkpoint(role.model, role.arch, role.groups, directory)


def main(session: WorkerSession) -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.trainer.ppo import ppo_step, set_up_ppo
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    env, out, results = session.env, session.out, session.results
    if env.rank == 0:
        make_tiny_hf_model("qwen2", False, out / TIED, vocab_size=600)
        make_chat_tokenizer("qwen2", out / TIED)
    dist.barrier()
    for case, (steps, overrides) in CASES.items():
        overrides = [o.replace(TIED, str(out / TIED)) for o in overrides]
        cfg = load_config("ppo-tiny", [*COMMON, *overrides, f"output_dir={out / case / 'run'}"], schema=PPOConfig)
        run = set_up_ppo(cfg, env)
        save(run.reference, out / case / "reference-0")
        records = []
        for step in range(1, steps + 1):
            indices = list(range((step - 1) * cfg.prompts_per_step, step * cfg.prompts_per_step))
            metrics, _ = ppo_step(run, step, indices)
            save(run.actor.role, out / case / f"actor-{step}")
            save(run.reference, out / case / f"reference-{step}")
            records.append(
                {
                    "refreshed": metrics.get("reference/refreshed"),
                    "time_keys": sorted(k for k in metrics if k.startswith("timing_s/") and k.count("/") == 1),
                    "replicas_equal": replicas_equal(run.reference),
                }
            )
        padded = {"actor": run.actor.role.padded_vocab_size, "reference": run.reference.padded_vocab_size}
        results[case] = {"padded_vocab": padded, "steps": records}


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
