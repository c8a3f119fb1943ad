"""torchrun worker: GRPO on ppo-tiny with a LoRA actor (rank 8), generating at TP1, with the device,
dtype and training layout its arguments give (config overrides):

* 2 gloo ranks, ``device=cpu actor.tp=2`` or ``actor.pp=2`` (``tests/distributed/test_lora.py``):
  generation at TP1 x DP2, so the adapters are resharded with the weights (TP-split pieces gathered,
  PP stages renumbered) and merged into the generation copy;
* 1 GPU, ``device=cuda dtype=fp32|bf16`` (``tests/gpu/test_gpu_ppo.py``): the zero-copy layout, the
  adapters merged into the actor's own weights in place and the kept base copied back.

* no reference model is built: the reference is the actor's base, its adapters off;
* three steps from B = 0: the KL is 0 at step 1, the engine's log-probs stay within the tolerance of
  the trainer's, every adapter moves, and the base is bit-identical to a model of the same path and
  layout built without LoRA (the independent reference);
* then, with random B (the adapters matter), one rollout: the engine's log-probs equal the trainer's
  with the adapters unmerged and differ from the base's by far more; the actor is unchanged by it;
  the same for two rollouts of an engine that frees its generation copy after each (offloading).
Rank 0 writes the figures (reduced over the ranks) to OUT/results.json; the test checks them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import PPO_TINY_ROLLOUT, response_logprobs
from tests.launch import WorkerSession, worker_session

OVERRIDES = ("rollout.tp=1", "actor.lora.rank=8", "save_hf=false", *PPO_TINY_ROLLOUT, "actor_optim.lr=1e-3")
STEPS = 3


def world_min(value: float, device: torch.device) -> float:
    found = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    return found.item()


def main(session: WorkerSession) -> None:
    import dataclasses

    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.hybrid.engine import HybridEngine
    from megatron_rlhf.models.lora import adapters
    from megatron_rlhf.trainer.ppo import _rollout_logprobs, ppo_step, rollout_batch, set_up_ppo
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    env, results = session.env, session.results
    cfg = load_config("ppo-tiny", [*OVERRIDES, *session.args, f"output_dir={session.out / 'run'}"], schema=PPOConfig)
    run = set_up_ppo(cfg, env)
    actor = run.actor.role
    results["reference_model_built"] = float(run.reference is not None)
    results["reference_is_actor_base"] = float(run.reference_is_actor_base)
    results["resharded"] = float(not run.generation.resharder.zero_copy)

    def params() -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in actor.model.named_parameters()}

    initial = params()
    per_step = cfg.prompts_per_step
    metrics = [
        ppo_step(run, step, list(range((step - 1) * per_step, step * per_step)))[0] for step in range(1, STEPS + 1)
    ]
    results["kl_step1"] = metrics[0]["kl/per_sequence"]
    results["kl_last"] = metrics[-1]["kl/per_sequence"]
    results["logprob_max_abs_diff"] = max(m["rollout/logprob_max_abs_diff"] for m in metrics)
    where = "reshard" if results["resharded"] else "zero_copy"
    results["weights_timed"] = float(all(f"timing_s/gen/generation_weights_{where}" in m for m in metrics))

    base = build_role(
        "reference",
        ModelConfig(path=cfg.actor.path, tp=cfg.actor.tp, pp=cfg.actor.pp),
        architecture_of(cfg.actor.path),
        world_size=env.world_size,
        dtype=next(actor.model.parameters()).dtype,
        device=env.device,
    )
    expected = dict(base.model.named_parameters())
    trained = params()
    adapter_names = {name for name in trained if "_lora." in name}
    same_names = set(trained) - adapter_names == set(expected)
    results["base_exact"] = world_min(
        float(same_names and all(torch.equal(trained[name], expected[name]) for name in expected)), env.device
    )
    results["adapters_moved"] = world_min(
        float(bool(adapter_names) and all(not torch.equal(trained[n], initial[n]) for n in adapter_names)), env.device
    )

    prompts = [run.prompts[i].prompt_ids.tolist() for i in range(per_step)]

    def rollout(generation, seed: int) -> tuple[float, float]:
        """Random B (alike on every rank: row-parallel linears' B is replicated over TP), one
        rollout: the engine's log-probs against the trainer's (adapters unmerged), and how far
        the adapters move the trainer's from the base's."""
        with torch.no_grad():
            for index, adapter in enumerate(adapters(actor.model)):
                draws = torch.Generator().manual_seed(seed + index)
                for b in adapter.lora_B.values():
                    b.copy_(torch.empty(b.shape).normal_(0.0, 0.05, generator=draws))
        before = params()
        completions = generation.generate(prompts, dataclasses.replace(cfg.rollout.sampling, seed=seed))
        after = params()
        if not all(torch.equal(after[n], before[n]) for n in before):
            raise AssertionError("the rollout changed the actor's weights")
        batch = rollout_batch(completions, run.tokenizer.pad_id)
        mask = batch["response_mask"]
        adapted = response_logprobs(actor, batch, cfg.max_tokens_per_micro_batch)
        based = response_logprobs(base, batch, cfg.max_tokens_per_micro_batch)
        engine = _rollout_logprobs(completions, mask)
        return float(((engine - adapted).abs() * mask).max()), float(((adapted - based).abs() * mask).max())

    diff, effect = rollout(run.generation, 100)
    results["random_b/logprob_max_abs_diff"], results["random_b/adapters_effect"] = diff, effect
    # An engine that frees its generation copy after each rollout (hybrid.offload, on a GPU): the
    # adapters' storage goes with the weights' and comes back at the next refresh.
    freeing = HybridEngine(run.actor, 1, run.generation.engine.cfg, offload=True)
    results["freeing/logprob_max_abs_diff"] = max(rollout(freeing, seed)[0] for seed in (200, 300))


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
