"""torchrun worker (gloo): the native engine against HF transformers and against the trainer.

    generate_worker.py OUT TP

* greedy generation equals HF ``generate`` token for token, per family, with continuous batching on
  (fewer cache slots than prompts) over prompts of mixed lengths;
* sampled log-probs equal the trainer's recomputed log-probs (forward pass at the same temperature)
  to 1e-5, at T=1 and T=0.7;
* every TP rank returns the same tokens;
* multi-turn trajectories (a scripted environment answering each turn, ``test_multi_turn_engine.py``):
  the same on every TP rank (only TP rank 0 runs the environment), log-probs at the policy's tokens
  equal the trainer's over the whole trajectory;
* which families decode through the engine's own layer forward (``fused_decode``).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.distributed.test_multi_turn_engine import STOPS, ScriptedAgent
from tests.helpers import FAMILIES, PAD_ID, make_tiny_hf_model
from tests.launch import WorkerSession, worker_session

PROMPT_LENGTHS = (3, 9, 5, 1, 7)
NEW_TOKENS = 10


def main(session: WorkerSession) -> None:
    from megatron_rlhf.checkpoint.sources import ModelConfig, build_role
    from megatron_rlhf.models.architecture import load_architecture
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams
    from megatron_rlhf.training.objectives import logprobs_output
    from megatron_rlhf.training.train import forward_pass

    env, out, results = session.env, session.out, session.results
    tp = int(session.args[0])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, PAD_ID, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    for family in FAMILIES:
        hf_dir = out / family
        if env.rank == 0:
            make_tiny_hf_model(family, False, hf_dir)
        dist.barrier()
        hf = make_tiny_hf_model(family, False, out / f"{family}-rank{env.rank}").to(env.device)
        role = build_role(
            "actor",
            ModelConfig(path=str(hf_dir), tp=tp),
            load_architecture(hf_dir),
            world_size=env.world_size,
            dtype=torch.float32,
            device=env.device,
        )
        engine = NativeEngine(role, NativeEngineConfig(max_batch_size=2, max_seq_len=64))
        results[f"{family}/fused_decode"] = int(engine.fused_decode)

        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
        mismatches = 0
        for prompt, completion in zip(prompts, greedy, strict=True):
            reference = hf.generate(
                torch.tensor([prompt], device=env.device),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_ID,
            )[0, len(prompt) :].tolist()
            mismatches += reference != completion.token_ids
        results[f"{family}/greedy_mismatches"] = mismatches
        assert mismatches == 0, f"{family}: {mismatches} prompts differ from HF generate"

        for temperature, turns in ((1.0, 1), (0.7, 1), (1.0, 4)):
            params = SamplingParams(
                temperature=temperature, top_k=20, top_p=0.9, max_new_tokens=NEW_TOKENS, n=2, ignore_eos=True, seed=11
            )
            if turns == 1:
                samples = engine.generate(prompts, params)
            else:
                with ThreadPoolExecutor(2) as pool:
                    samples = engine.generate(
                        prompts, _with_stops(params, 3 * NEW_TOKENS), agent=ScriptedAgent(pool, turns)
                    )
                assert any(c.trajectory["num_turns"] > 1 for c in samples), "no trajectory took a second turn"
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, [(c.token_ids, c.policy_mask, c.trajectory) for c in samples])
            assert all(g == gathered[0] for g in gathered), "TP ranks generated different tokens"
            width = max(len(c.prompt_ids) + len(c.token_ids) for c in samples)
            ids = torch.zeros(len(samples), width, dtype=torch.long)
            attention = torch.zeros_like(ids)
            for row, c in enumerate(samples):
                sequence = c.prompt_ids + c.token_ids
                ids[row, : len(sequence)] = torch.tensor(sequence)
                attention[row, : len(sequence)] = 1
            recomputed = forward_pass(
                role,
                {"input_ids": ids, "attention_mask": attention},
                logprobs_output(role, temperature=temperature),
                max_tokens_per_micro_batch=64,
            )
            diff = 0.0
            for row, c in enumerate(samples):
                start = len(c.prompt_ids)
                engine_lp = torch.tensor(c.logprobs, device=recomputed.device)
                policy = torch.tensor(c.policy_mask or [True] * len(c.token_ids), device=recomputed.device)
                gap = (recomputed[row, start : start + len(c.token_ids)] - engine_lp).abs()[policy]
                diff = max(diff, gap.max().item())
            results[f"{family}/logprob_max_abs_diff_t{temperature}_turns{turns}"] = diff
            assert diff < 1e-5, f"{family} T={temperature}: engine vs trainer log-probs differ by {diff:.3e}"


def _with_stops(params, max_new_tokens: int):
    """Sampling that ends turns often (``STOPS``) and leaves room for several."""
    import dataclasses

    return dataclasses.replace(params, ignore_eos=False, stop_token_ids=STOPS, max_new_tokens=max_new_tokens)


if __name__ == "__main__":
    with worker_session() as session:
        main(session)
