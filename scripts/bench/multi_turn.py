"""Benchmark: a multi-turn rollout against single-turn generation of the same token count.

    torchrun --nproc-per-node 1 scripts/bench/multi_turn.py --model builtin:llama-1.5b --out multi_turn.json

The model has random weights, so it calls no tool of its own accord: turns end on a set of stop
tokens (every ``--turn-length``-th id of the vocabulary; sampling at T=1 from a random model is
close to uniform, so turns are about that long) and a scripted environment answers each turn with
``--answer-tokens`` tokens after ``--tool-latency-ms`` on a host thread, up to ``--turns`` policy
turns. This times the engine's side of the agent loop (ending a turn, waiting, prefilling the answer
after the slot's cache, going on decoding) without a tool's own cost.

For each batch size and latency: the multi-turn rollout's wall time, its turns, policy and
environment tokens; single-turn generation of as many tokens per sequence as the trajectories held
on average (EOS ignored); the overhead per turn boundary ((multi - single) / the boundaries per
trajectory: a turn that got an answer) and the policy's decode rate while answers are in flight.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from common import RunningReport, device_name


@dataclasses.dataclass
class DelayedAnswers:
    """Each turn answered with the same tokens after ``latency_s`` on a pool thread, up to ``turns`` turns."""

    pool: ThreadPoolExecutor
    answer: list[int]
    latency_s: float
    turns: int
    seen: int = 0

    def after_turn(self, turn_ids: list[int]) -> Future | None:
        from megatron_rlhf.rollout.engine import EnvironmentTurn

        self.seen += 1
        if self.seen >= self.turns:
            return None

        def reply() -> EnvironmentTurn:
            time.sleep(self.latency_s)
            return EnvironmentTurn(list(self.answer))

        return self.pool.submit(reply)

    def close(self) -> Future[dict[str, Any]]:
        record: Future[dict[str, Any]] = Future()
        record.set_result({"num_turns": self.seen})
        return record


@dataclasses.dataclass
class ScriptedEnvironment:
    pool: ThreadPoolExecutor
    answer: list[int]
    latency_s: float
    turns: int

    def episode(self, prompt_index: int, sample_index: int) -> DelayedAnswers:
        return DelayedAnswers(self.pool, self.answer, self.latency_s, self.turns)


def timed_generate(engine: Any, prompts: list[list[int]], params: Any, agent: Any = None) -> tuple[float, list]:
    """Seconds of one ``engine.generate`` call, and what it returned."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    completions = engine.generate(prompts, params, agent=agent)
    sync()
    return time.perf_counter() - start, completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-length", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--tool-latency-ms", type=float, nargs="+", default=[0.0, 50.0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.rollout.native import NativeEngine
    from megatron_rlhf.rollout.native_config import NativeEngineConfig
    from megatron_rlhf.rollout.sampling import SamplingParams

    env = init_distributed(args.device)
    arch = architecture_of(args.model)
    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    role = build_role("actor", ModelConfig(path=args.model), arch, world_size=1, dtype=dtype, device=env.device)
    report = RunningReport(
        args.out,
        model=args.model,
        device=device_name(env.device),
        prompt_len=args.prompt_len,
        turns=args.turns,
        turn_length=args.turn_length,
        answer_tokens=args.answer_tokens,
    )
    draws = torch.Generator().manual_seed(0)
    stops = tuple(range(args.turn_length - 1, arch.vocab_size, args.turn_length))
    answer = torch.randint(0, arch.vocab_size, (args.answer_tokens,), generator=draws).tolist()
    for batch in args.batch_sizes:
        prompts = torch.randint(0, arch.vocab_size, (batch, args.prompt_len), generator=draws).tolist()
        engine = NativeEngine(
            role, NativeEngineConfig(max_batch_size=batch, max_seq_len=args.prompt_len + args.max_new_tokens)
        )
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, seed=1)
        for latency_ms in args.tool_latency_ms:
            with ThreadPoolExecutor(16) as pool:
                environment = ScriptedEnvironment(pool, answer, latency_ms / 1000, args.turns)
                engine.generate(prompts, params, agent=environment)  # warm-up: compilation, graphs for every bucket
                multi_s, trajectories = timed_generate(engine, prompts, params, environment)
            policy_tokens = sum(sum(c.policy_mask) for c in trajectories)
            total_tokens = sum(len(c.token_ids) for c in trajectories)
            turns = sum(c.trajectory["num_turns"] for c in trajectories)
            same_count = round(total_tokens / batch)
            single = SamplingParams(temperature=1.0, max_new_tokens=same_count, ignore_eos=True, seed=1)
            engine.generate(prompts, single)
            single_s, _ = timed_generate(engine, prompts, single)
            boundaries = turns - sum(1 for c in trajectories if c.trajectory["num_turns"] > 0)
            report.add(
                **{
                    f"batch{batch}_latency{latency_ms:g}ms": {
                        "multi_turn_s": multi_s,
                        "single_turn_same_tokens_s": single_s,
                        "tokens_per_trajectory": total_tokens / batch,
                        "policy_tokens_per_trajectory": policy_tokens / batch,
                        "turns_per_trajectory": turns / batch,
                        "overhead_s_per_turn_boundary": (multi_s - single_s) / max(boundaries / batch, 1e-9),
                        "policy_decode_tokens_per_s": policy_tokens / multi_s,
                        "single_turn_decode_tokens_per_s": batch * same_count / single_s,
                    }
                }
            )
        engine.release()


if __name__ == "__main__":
    main()
