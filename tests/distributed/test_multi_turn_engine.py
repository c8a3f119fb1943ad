"""The native engine's multi-turn loop: a trajectory's later turns continue in its KV-cache slot and
equal what a from-scratch prefill of everything before them gives; the environment's tokens are
masked and never sampled; answers that arrive late or out of order do not stall or mix up slots."""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tests.distributed.test_generate import _tiny_engine

STOPS = tuple(range(0, 512, 3))  # a third of the vocabulary ends a turn: turns are short and many
ANSWER = [7, 8, 10, 11]  # the environment's tokens (not stop-checked: the engine never samples them)


@dataclasses.dataclass
class ScriptedEpisode:
    """An environment that answers each of the first ``turns - 1`` turns with ``ANSWER`` plus the
    turn's own length, after a delay that differs per trajectory and turn (so that answers arrive
    out of order while other slots decode), then ends the trajectory: at once, or (``ends_late``)
    by an answer that comes later, as an interaction's end does."""

    pool: ThreadPoolExecutor
    prompt_index: int
    sample_index: int
    turns: int
    ends_late: bool = False
    seen: list[list[int]] = dataclasses.field(default_factory=list)
    closed: bool = False

    def after_turn(self, turn_ids: list[int]) -> Future | None:
        from megatron_rlhf.rollout.engine import EnvironmentTurn

        self.seen.append(list(turn_ids))
        last = len(self.seen) >= self.turns
        if last and not self.ends_late:
            return None
        delay = 0.002 * ((self.prompt_index * 7 + len(self.seen) * 3) % 5)

        def answer() -> EnvironmentTurn:
            time.sleep(delay)
            return EnvironmentTurn([], ends=True) if last else EnvironmentTurn(ANSWER + [len(turn_ids) + 20])

        return self.pool.submit(answer)

    def close(self) -> Future[dict[str, Any]]:
        self.closed = True
        record: Future[dict[str, Any]] = Future()
        record.set_result({"num_turns": len(self.seen)})
        return record


@dataclasses.dataclass
class ScriptedAgent:
    pool: ThreadPoolExecutor
    turns: int
    ends_late: bool = False
    episodes: list[ScriptedEpisode] = dataclasses.field(default_factory=list)

    def episode(self, prompt_index: int, sample_index: int) -> ScriptedEpisode:
        episode = ScriptedEpisode(self.pool, prompt_index, sample_index, self.turns, self.ends_late)
        self.episodes.append(episode)
        return episode


def _policy_segments(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of the policy's tokens."""
    segments, start = [], None
    for i, policy in enumerate([*mask, False]):
        if policy and start is None:
            start = i
        elif not policy and start is not None:
            segments.append((start, i))
            start = None
    return segments


def test_later_turns_equal_a_from_scratch_prefill_of_the_whole_history(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams
    from tests.helpers import response_logprobs

    engine = _tiny_engine("error")
    engine.cfg.max_seq_len, engine.cfg.max_batch_size = 64, 3  # 5 trajectories over 3 slots
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14], [20, 1], [30, 31, 32]]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS)
    with ThreadPoolExecutor(4) as pool:
        agent = ScriptedAgent(pool, turns=4)
        trajectories = engine.generate(prompts, params, agent=agent)

    assert all(episode.closed for episode in agent.episodes) and len(agent.episodes) == len(prompts)
    assert sum(c.trajectory["num_turns"] for c in trajectories) > 2 * len(prompts), "most should take several turns"
    assert any(c.finish_reason == "stop" for c in trajectories) and any(
        c.finish_reason == "length" for c in trajectories
    )
    for c in trajectories:
        assert c.policy_mask is not None and len(c.policy_mask) == len(c.token_ids) == len(c.logprobs)
        segments = _policy_segments(c.policy_mask)
        episode = next(e for e in agent.episodes if e.prompt_index == c.prompt_index)
        # every turn that ended on a stop token reached the episode; a last one may have run out of tokens
        assert len(segments) == len(episode.seen) + (c.finish_reason == "length" and c.policy_mask[-1])
        assert episode.seen == [c.token_ids[a:b] for a, b in segments if c.token_ids[b - 1] in STOPS]
        for (turn_start, turn_end), (next_start, _) in itertools.pairwise(segments):
            assert c.token_ids[turn_end:next_start] == ANSWER + [turn_end - turn_start + 20]  # the answer, masked
            assert c.logprobs[turn_end:next_start] == [0.0] * (next_start - turn_end)
        for start, end in segments:  # each turn: a single-turn run on everything before it
            alone = engine.generate(
                [c.prompt_ids + c.token_ids[:start]],
                dataclasses.replace(params, max_new_tokens=end - start),
            )[0]
            assert alone.token_ids == c.token_ids[start:end]
            torch.testing.assert_close(
                torch.tensor(alone.logprobs), torch.tensor(c.logprobs[start:end]), rtol=0, atol=1e-5
            )

    # The trainer's log-probs of the whole sequences, at the policy's tokens.
    from megatron_rlhf.data.batch import padded_ids

    rows = [c.prompt_ids + c.token_ids for c in trajectories]
    lengths = torch.tensor([len(r) for r in rows])
    batch = padded_ids(torch.tensor([t for r in rows for t in r]), lengths, 0)
    columns = torch.arange(batch["input_ids"].shape[1])
    starts = torch.tensor([len(c.prompt_ids) for c in trajectories])
    batch["response_mask"] = batch["attention_mask"] & (columns[None] >= starts[:, None])
    trainer = response_logprobs(engine.role, batch, max_tokens_per_micro_batch=256)
    for row, c in enumerate(trajectories):
        span = trainer[row, starts[row] : starts[row] + len(c.token_ids)]
        policy = torch.tensor(c.policy_mask)
        torch.testing.assert_close(span[policy], torch.tensor(c.logprobs)[policy], rtol=0, atol=1e-5)


def test_an_answer_past_the_budget_is_cut_and_ends_the_trajectory(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    engine.cfg.max_seq_len = 64
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=STOPS)
    with ThreadPoolExecutor(1) as pool:
        (c,) = engine.generate([[5, 6, 7]], params, agent=ScriptedAgent(pool, turns=10))
    # the first turn stops after 6 tokens (test_later_turns_...'s first trajectory); 2 of the answer's 5 fit
    assert c.token_ids[6:] == ANSWER[:2] and c.policy_mask == [True] * 6 + [False] * 2
    assert c.finish_reason == "length"


def test_one_turn_agent_gives_the_single_turn_completions(world_of_one) -> None:
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    engine.cfg.max_seq_len, engine.cfg.max_batch_size = 64, 2
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14]]
    params = SamplingParams(temperature=0.9, max_new_tokens=12, stop_token_ids=STOPS, seed=4, n=2)
    single = engine.generate(prompts, params)
    with ThreadPoolExecutor(1) as pool:
        multi = engine.generate(prompts, params, agent=ScriptedAgent(pool, turns=1))
    for a, b in zip(single, multi, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.finish_reason == b.finish_reason
        assert b.policy_mask == [True] * len(b.token_ids)
        assert b.trajectory == {"num_turns": 1 if a.finish_reason == "stop" else 0}  # turns that reached the episode


def test_an_answer_that_ends_the_trajectory_ends_it_at_the_policys_turn(world_of_one) -> None:
    """An interaction's end comes as a later answer (``EnvironmentTurn.ends``): the slot waits for it
    while the others decode, then the trajectory ends on its stop token with nothing appended, as
    greedy single-turn generation ends it (greedy: the slots' timing cannot change the tokens)."""
    from megatron_rlhf.rollout.sampling import SamplingParams

    engine = _tiny_engine("error")
    engine.cfg.max_seq_len, engine.cfg.max_batch_size = 64, 2
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=STOPS)
    single = engine.generate(prompts, params)
    with ThreadPoolExecutor(1) as pool:
        agent = ScriptedAgent(pool, turns=1, ends_late=True)
        multi = engine.generate(prompts, params, agent=agent)
    assert any(c.finish_reason == "stop" for c in single)
    for a, b in zip(single, multi, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert b.policy_mask == [True] * len(b.token_ids)
    assert all(e.closed for e in agent.episodes) and len(agent.episodes) == len(prompts)
