"""torchrun worker (8 ranks, gloo, fp32): the 8-GPU layout of issue 14 in CPU mode.

    eight_ranks_worker.py OUT [PPO_OVERRIDE ...]

Part 1. For each model (a llama made by transformers with 4 KV heads and a prime vocabulary of 97,
so every layout pads it; and ``builtin:arith-llama``, the model the trainer runs below), the actor
is built at TP4 x PP2 (DP1) with its optimizer, and the hybrid engine reshards it into the
generation layout TP2 x DP4, where each data-parallel rank generates its own share of the prompts.
The reference is independent of the resharding: a TP1 x PP1 model built on every rank from the
same checkpoint, generating with the native engine on its own.
* greedy: every rank's completions (all prompts, gathered) have the TP1 model's tokens, and their
  log-probs are within 1e-5;
* sampling (temperature 1, top-p 0.9, 2 samples a prompt, a fixed seed): the engine's draws depend
  on which prompts share an engine call, so the TP1 model generates each generation-DP rank's
  share in one call (as that rank does); then the same tokens and log-probs within 1e-5;
* after one optimizer step at TP4 x PP2 (llama only), the refreshed generation copy's greedy
  tokens equal those of a TP1 model built from the step's weights exported to HF, and the step
  changed them.
Rank 0 writes the figures to OUT/results.json; any mismatch raises.

Part 2, with PPO_OVERRIDEs: then ``megatron-rlhf ppo PPO_OVERRIDE ...`` in the same processes (the
command line's ``main``, as ``python -m megatron_rlhf`` runs it), and the worker exits with its
exit code. One launch for both parts saves a second start-up of 8 processes (imports ~6 s CPU each).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

PROMPT_LENGTHS = (3, 9, 5, 1, 7, 4, 11, 6)  # two prompts for each generation-DP rank
NEW_TOKENS = 8
TOLERANCE = 1e-5
TRAIN_TP, TRAIN_PP, GENERATION_TP = 4, 2, 2


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.hf import save_hf_checkpoint
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.hybrid.engine import HybridEngine
    from megatron_rlhf.metrics.phases import PhaseTimer
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.rollout.native import GROUP_SEED_STRIDE, NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step

    env, out, results = session.env, session.out, session.results
    if env.world_size != 8:
        raise AssertionError(f"run with 8 processes, not {env.world_size}")
    engine_cfg = NativeEngineConfig(max_batch_size=2, max_seq_len=32)  # fewer slots than sequences: slots reused
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, n=2, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=11)

    def world_max(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def build(role: str, path: str, tp: int, pp: int):
        return build_role(
            role,
            ModelConfig(path=path, tp=tp, pp=pp),
            architecture_of(path),
            world_size=env.world_size,
            dtype=torch.float32,
            device=env.device,
        )

    def compare(key: str, got: list, expected: list) -> None:
        """Tokens equal and log-probs within TOLERANCE, over every rank; recorded under ``key``."""
        if [(c.prompt_index, c.sample_index) for c in got] != [(c.prompt_index, c.sample_index) for c in expected]:
            raise AssertionError(f"{key}: completions of other prompts or samples than the reference's")
        mismatches = int(world_max(sum(a.token_ids != b.token_ids for a, b in zip(got, expected, strict=True))))
        diffs = [
            abs(x - y) for a, b in zip(got, expected, strict=True) for x, y in zip(a.logprobs, b.logprobs, strict=True)
        ]
        diff = world_max(max(diffs, default=0.0))
        results[f"{key}/token_mismatches"] = mismatches
        results[f"{key}/logprob_max_abs_diff"] = diff
        results[f"{key}/sequences"] = len(got)
        if mismatches or diff > TOLERANCE:
            raise AssertionError(
                f"{key}: {mismatches} sequences' tokens differ from the TP1 model's; log-probs by {diff:.3e}"
            )

    if env.rank == 0:
        make_tiny_hf_model("llama", False, out / "llama", num_key_value_heads=4)
    dist.barrier()
    for name, path in (("llama", str(out / "llama")), ("arith", "builtin:arith-llama")):
        vocab = architecture_of(path).vocab_size
        g = torch.Generator().manual_seed(5)  # the same prompts on every rank
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
        actor = build("actor", path, TRAIN_TP, TRAIN_PP)
        state = make_train_state(actor, OptimConfig(lr=1e-2))
        hybrid = HybridEngine(state, generation_tp=GENERATION_TP, engine_cfg=engine_cfg, offload=False)
        generation = hybrid.resharder.target
        results[f"{name}/layouts"] = [str(actor.groups.layout), str(generation.groups.layout)]
        if actor.groups.layout != Layout(tp=4, pp=2, dp=1) or generation.groups.layout != Layout(tp=2, pp=1, dp=4):
            raise AssertionError(f"{name}: layouts {results[f'{name}/layouts']}")
        if hybrid.resharder.zero_copy or generation.model is actor.model:
            raise AssertionError(f"{name}: the generation copy is the training model")

        def reference(model_path: str) -> NativeEngine:
            """An engine on a TP1 x PP1 model (DP8) built on every rank from ``model_path``."""
            return NativeEngine(build("reference", model_path, 1, 1), engine_cfg)

        tp1 = reference(path)
        timer = PhaseTimer(env.device)
        completions = hybrid.generate(prompts, greedy, timer)
        results[f"{name}/phases"] = list(timer.step_metrics())
        compare(f"{name}/greedy", completions, tp1.generate(prompts, greedy))

        # Sampling: this rank's generation-DP share, in one engine call on the TP1 model, with the seed
        # of this rank's generation group (each group draws from its own stream).
        completions = hybrid.generate(prompts, sampled)
        share = list(range(generation.groups.dp_rank, len(prompts), generation.groups.layout.dp))
        group_seed = sampled.seed + generation.groups.dp_rank * GROUP_SEED_STRIDE
        expected = tp1.generate([prompts[i] for i in share], dataclasses.replace(sampled, seed=group_seed))
        for completion in expected:
            completion.prompt_index = share[completion.prompt_index]
        compare(f"{name}/sampled", [c for c in completions if c.prompt_index in share], expected)
        greedy_tokens = [c.token_ids for c in hybrid.generate(prompts, greedy)]
        results[f"{name}/sampled_differs_from_greedy"] = bool(
            world_max(any(c.token_ids != greedy_tokens[c.prompt_index] for c in completions))
        )
        if not results[f"{name}/sampled_differs_from_greedy"]:
            raise AssertionError(f"{name}: the sampled completions are the greedy ones")

        if name == "llama":  # an optimizer step at TP4 x PP2, then a refresh of the generation copy
            ids = torch.randint(3, vocab, (8, 16), generator=torch.Generator().manual_seed(23))
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
            train_step(state, batch, sft_loss(actor), max_tokens_per_micro_batch=64)
            save_hf_checkpoint(actor.model, actor.arch, actor.groups, out / "llama-after-step")
            completions = hybrid.generate(prompts, greedy)
            compare(
                f"{name}/after_step_greedy",
                completions,
                reference(str(out / "llama-after-step")).generate(prompts, greedy),
            )
            results[f"{name}/step_changed_tokens"] = [c.token_ids for c in completions] != greedy_tokens
            if not results[f"{name}/step_changed_tokens"]:
                raise AssertionError(f"{name}: the optimizer step did not change the greedy tokens")


if __name__ == "__main__":  # the checkpoint writer spawns processes that import this file
    with worker_session() as session:
        main(session)
    if session.args:
        from megatron_rlhf.cli import main as cli_main

        sys.exit(cli_main(["ppo", "--config", "ppo-tiny", *session.args]))
