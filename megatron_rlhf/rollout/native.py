"""The native generation engine: megatron-core model + preallocated KV cache, continuous batching.

Flow of ``generate``: prompts (x n samples) wait in a queue; free cache slots take waiting prompts
(one batched, right-padded prefill), then every running sequence advances one token per decode
step; a finished sequence frees its slot for the next waiting prompt. TP-aware: each rank computes
its attention heads and vocabulary shard; the sampled tokens are broadcast from TP rank 0 so that
all ranks continue with identical sequences. Pipeline parallelism is collapsed (pp=1).

The decode loop keeps the device ahead of the host. Each slot's state (last token, position,
remaining budget, whether it still generates) lives on the device and a decode step advances it
there, stop tokens and budgets included, so step t+1 is launched before the host has read step t.
The host reads every step one step late into a history, with per-step work that does not grow with
the number of slots, and learns of finished slots then. New prompts are admitted into free slots
after draining the step in flight. The engine keeps its KV cache and CUDA graphs for the next call
with as many slots (``release()`` frees them): the hybrid engine keeps one engine per run, so a
run captures its graphs once. A graph holds the addresses of the weights it read: when a weight's
storage has moved since the capture, the next call captures again.

Shapes: prefill input (b, W) right-padded; decode input (slots, 1): every cache slot decodes
(a static shape, as CUDA graphs need), idle slots a dummy token whose result is dropped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from megatron_rlhf.data.batch import flat_tensor, right_padded
from megatron_rlhf.fusion import gpu_fused
from megatron_rlhf.models.attention import (
    CachedSelfAttention,
    add_rms_norm,
    rotary_tables,
    rotate_store_attend,
    swiglu,
)
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.rollout.engine import Agent, Completion, EnvironmentTurn, Episode, TrajectoryRecord
from megatron_rlhf.rollout.kv_cache import DecodeStep, KVCache
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams, sample

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer


class PromptTooLongError(ValueError):
    pass


class _History:
    """Every decode step's output per slot, one row per step: the produced token (-1 where the slot
    did not produce one) and its log-prob. Host tensors, grown by doubling."""

    def __init__(self, slots: int) -> None:
        self.tokens = torch.full((256, slots), -1, dtype=torch.long)
        self.logprobs = torch.zeros(256, slots, dtype=torch.float32)
        self.steps = 0

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        if self.steps == len(self.tokens):
            self.tokens = torch.cat([self.tokens, torch.full_like(self.tokens, -1)])
            self.logprobs = torch.cat([self.logprobs, torch.zeros_like(self.logprobs)])
        self.tokens[self.steps] = tokens
        self.logprobs[self.steps] = logprobs
        self.steps += 1

    def of_slots(self, slots: list[int], since: list[int]) -> list[tuple[list[int], list[float]]]:
        """The tokens and log-probs each slot produced from its step ``since`` on. One read of the
        slots' columns for all of them: at the end of a rollout every slot finishes at once, and
        a read per slot keeps the GPU idle for tens of milliseconds (docs/benchmarks.md, "Host
        overheads")."""
        first = min(since)
        columns = self.tokens[first : self.steps, slots].t()
        every_step = (columns >= 0).all(dim=1).tolist()  # no gap to filter out (the usual case)
        # numpy's tolist of the transposed columns is faster than torch's
        tokens, logprobs = columns.numpy().tolist(), self.logprobs[first : self.steps, slots].t().numpy().tolist()
        result = []
        for row_tokens, row_logprobs, start, whole in zip(tokens, logprobs, since, every_step, strict=True):
            if start > first:
                row_tokens, row_logprobs = row_tokens[start - first :], row_logprobs[start - first :]
            if not whole:
                row_logprobs = [p for t, p in zip(row_tokens, row_logprobs, strict=True) if t >= 0]
                row_tokens = [t for t in row_tokens if t >= 0]
            result.append((row_tokens, row_logprobs))
        return result


@dataclasses.dataclass
class _LaunchedStep:
    """A decode step queued on the device whose outputs the host has not read yet."""

    tokens: torch.Tensor  # (slots,) host buffers the step's outputs are copied into
    logprobs: torch.Tensor
    live: torch.Tensor
    ready: torch.cuda.Event | None  # recorded after the copies (None on CPU: already there)


class _Slots:
    """What decoding over a fixed number of slots keeps from one ``generate`` call to the next: the
    KV cache, the device-side slot state (``input_ids`` (slots, 1), each slot's last token, the next
    step's input, at ``positions`` (slots, 1); ``remaining`` (slots,), tokens it may still generate;
    ``live`` (slots,), whether it is generating), pinned staging buffers for the host (two sets,
    alternating, so that filling one never races the copy out of the other), and the CUDA graphs
    that read them. Capturing costs a few eager steps per KV-length bucket: paid once per engine,
    slot count and weight storage, not per call."""

    def __init__(self, engine: NativeEngine, count: int) -> None:
        arch, device = engine.role.arch, engine.device
        self.count = count
        self.cache = KVCache(
            num_layers=len(engine.attention),
            slots=count,
            max_len=engine.cfg.max_seq_len,
            groups=arch.num_query_groups // engine.role.groups.layout.tp,
            head_dim=arch.head_dim,
            dtype=engine.model.config.params_dtype,
            device=device,
        )
        self.input_ids = torch.zeros(count, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(count, 1, dtype=torch.long, device=device)
        self.remaining = torch.zeros(count, dtype=torch.long, device=device)
        self.live = torch.zeros(count, dtype=torch.bool, device=device)
        self.all_slots = torch.arange(count, device=device)
        pin = device.type == "cuda"
        self.staging = [
            (
                torch.zeros(count, dtype=torch.long, pin_memory=pin),
                torch.zeros(count, dtype=torch.float32, pin_memory=pin),
                torch.zeros(count, dtype=torch.bool, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self.graphs = _DecodeGraphs(engine, self) if engine.cfg.cuda_graphs and pin else None

    def use_weights(self, engine: NativeEngine) -> None:
        """Drop the graphs if the weights they read have moved (a freed and reallocated
        generation copy, weights loaded by replacing the tensors)."""
        if self.graphs is not None and self.graphs.weights != _weight_addresses(engine.model):
            self.graphs = _DecodeGraphs(engine, self)


class _DecodeState:
    """One ``generate`` call's decode state: the device side (the loop's truth) lives in ``_Slots``
    and is advanced there by each decode step (a live slot moves one position, spends one token,
    and dies on a stop token or an empty budget), so the host never reads a step before launching
    the next and its per-step work does not grow with the number of slots. The host keeps a lagged
    view: ``live_known`` as of the last step read, ``position_bound`` (>= every slot's device
    position, for the attention length), and the history of the steps read."""

    def __init__(self, slots: _Slots, stop_ids: Collection[int]) -> None:
        self.slots = slots
        slots.live.zero_()  # nothing from an earlier call is generating
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=slots.live.device)
        self.live_known = torch.zeros(slots.count, dtype=torch.bool)
        self.position_bound = torch.zeros(slots.count, dtype=torch.long)
        self.history = _History(slots.count)
        self.parity = 0


_RESUME_COST_STEPS = 4
"""What continuing answered trajectories costs (draining the step in flight, an eager prefill of
their answers), in decode steps of every slot. Answers wait until the steps their slots sat idle add
up to that much (or until a round happens anyway): prefilling each answer as it comes made
rollouts with fast tools several times slower (docs/benchmarks.md, "Multi-turn rollouts")."""


class _Environment:
    """A multi-turn ``generate`` call's side of the environment: the episode of each trajectory in a
    slot, and the slots whose trajectory waits for the environment's answer (its KV cache kept).

    Under TP only the group's rank 0 runs episodes, so that each tool call runs once; what it
    learns (which turns get an answer, which answers are in, their tokens, the trajectory records)
    is broadcast to the group, so that every rank keeps the same slots. An episode that raises on
    rank 0 raises on every rank of the group."""

    def __init__(self, agent: Agent, tp_group: dist.ProcessGroup, tp_src: int) -> None:
        self.agent = agent
        self.group, self.src = tp_group, tp_src
        self.speaks = tp_group.size() == 1 or dist.get_rank() == tp_src
        self.episodes: dict[int, Episode] = {}  # slot -> its trajectory's episode (rank 0 only)
        self.pending: dict[int, Future[EnvironmentTurn] | None] = {}  # slot -> its answer (None off rank 0)
        self.answered_at: dict[int, int] = {}  # slot -> the decode step its answer was seen in

    def _agreed[T](self, compute: Callable[[], T]) -> T:
        """``compute()`` on rank 0, given to the whole TP group."""
        if self.group.size() == 1:
            return compute()
        box: list[Any] = [None]
        if self.speaks:
            try:
                box[0] = compute()
            except Exception as exc:  # every rank must leave the loop, not only this one
                box[0] = _EnvironmentFailure(f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        if isinstance(box[0], _EnvironmentFailure):
            raise RuntimeError(f"the multi-turn environment failed on TP rank 0: {box[0].message}")
        return box[0]

    def start(self, slot: int, completion: Completion) -> None:
        if self.speaks:
            self.episodes[slot] = self.agent.episode(completion.prompt_index, completion.sample_index)

    def after_turns(self, turns: dict[int, list[int]]) -> set[int]:
        """Give each slot's finished turn to its episode; the slots that now wait for an answer."""
        if not turns:
            return set()

        def answers() -> dict[int, Future[EnvironmentTurn]]:
            asked = {slot: self.episodes[slot].after_turn(ids) for slot, ids in turns.items()}
            return {slot: answer for slot, answer in asked.items() if answer is not None}

        futures = answers() if self.speaks else {}
        waiting = set(futures) if self.group.size() == 1 else self._agreed(lambda: set(futures))
        self.pending.update({slot: futures.get(slot) for slot in waiting})
        return waiting

    def waits(self, slot: int) -> bool:
        return slot in self.pending

    def waiting_slots(self) -> list[int]:
        return list(self.pending)

    def ready(self, step: int) -> list[int]:
        """The waiting slots whose answer is in (noted as seen at decode step ``step``)."""
        if not self.pending:
            return []
        slots = self._agreed(
            lambda: [slot for slot, answer in self.pending.items() if answer is not None and answer.done()]
        )
        for slot in slots:
            self.answered_at.setdefault(slot, step)
        return slots

    def idle_slot_steps(self, step: int) -> int:
        """Decode steps that answered slots have sat idle since their answers came, summed."""
        return sum(step - seen for seen in self.answered_at.values())

    def take(self, slots: list[int]) -> dict[int, EnvironmentTurn]:
        """The answers of ``slots`` (all ready)."""
        if not slots:
            return {}

        def turns() -> dict[int, EnvironmentTurn]:
            return {slot: answer.result() for slot in slots if (answer := self.pending[slot]) is not None}

        answers = self._agreed(turns)
        for slot in slots:
            del self.pending[slot]
            self.answered_at.pop(slot, None)
        return answers

    def wait(self) -> None:
        """Block until an answer is in (rank 0; the others wait in the next ``ready``)."""
        if self.speaks:
            concurrent.futures.wait(
                [answer for answer in self.pending.values() if answer is not None],
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    def close(self, slots: list[int]) -> dict[int, TrajectoryRecord]:
        """End the episodes of ``slots``; their trajectory records."""
        if not slots:
            return {}

        def records() -> dict[int, TrajectoryRecord]:
            closing = {slot: self.episodes.pop(slot).close() for slot in slots}  # side by side
            return {slot: record.result() for slot, record in closing.items()}

        return self._agreed(records)

    def abandon(self) -> None:
        """Release what episodes are left (``generate`` was interrupted); their records are not read."""
        for episode in self.episodes.values():
            episode.close()
        self.episodes.clear()


@dataclasses.dataclass
class _EnvironmentFailure:
    message: str


class NativeEngine:
    def __init__(self, role: RoleModel, cfg: NativeEngineConfig) -> None:
        if role.groups.layout.pp != 1:
            raise ValueError(
                f"the generation layout must have pp=1 (got {role.groups.layout}): PP is collapsed for decoding"
            )
        if role.arch.score_head:
            raise ValueError(f"cannot generate with a {role.arch.hf_class_name}: it has no LM head")
        self.role, self.cfg = role, cfg
        self.model = role.model
        self.device = next(self.model.parameters()).device
        self.attention = [m for m in self.model.modules() if isinstance(m, CachedSelfAttention)]
        self.fused_decode = _decode_fusable(self.model.decoder)
        window = self.model.config.window_size
        self.window = window[0] if window is not None else None
        tp_group = role.groups.pg_collection.tp
        self.tp_group = tp_group
        self.tp_src = dist.get_global_rank(tp_group, 0)
        self._slots: _Slots | None = None
        self.graph_captures = 0
        """CUDA graphs captured over the engine's life (one per KV-length bucket a call reaches,
        again after ``release()``, a change of slot count or moved weights); 0 without graphs."""
        self.graph_capture_seconds = 0.0
        """What those captures cost, warm-up steps included."""

    # ------------------------------------------------------------------ public

    @property
    def kv_cache(self) -> KVCache | None:
        """The KV cache kept for the next call (None after ``release()``)."""
        return self._slots.cache if self._slots is not None else None

    def release(self) -> None:
        """Free the KV cache and the CUDA graphs (the next ``generate`` rebuilds them)."""
        self._slots = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        on_finished: Callable[[int], None] | None = None,
        agent: Agent | None = None,
    ) -> list[Completion]:
        """``params.n`` completions per prompt, ordered by (prompt_index, sample_index);
        ``on_finished(count)`` is told how many are complete whenever that number grows.

        With ``agent`` each completion is a multi-turn trajectory. When a policy turn ends on a stop
        token, its ``Episode`` answers (tools run on host workers) while the other slots go on
        decoding; the slot keeps its KV cache meanwhile, and once the answer is there only the
        answer's tokens are prefilled (``_prefill`` of a continued turn) and the policy goes on in
        the same slot. ``params.max_new_tokens`` bounds the whole trajectory's response."""
        waiting = collections.deque(
            self._completion(i, j, list(prompt), params, agent is not None)
            for i, prompt in enumerate(prompts)
            for j in range(params.n)
        )
        if not waiting:
            return []
        count = min(self.cfg.max_batch_size, len(waiting))
        if self._slots is None or self._slots.count != count:
            self.release()
            self._slots = _Slots(self, count)
        self._slots.use_weights(self)
        stop_ids = params.stop_set(self.cfg.eos_token_ids)
        state = _DecodeState(self._slots, stop_ids)
        environment = _Environment(agent, self.tp_group, self.tp_src) if agent is not None else None
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        occupant: list[Completion | None] = [None] * count
        first_step = [0] * count  # the history row where each occupant's current turn began
        finished: list[Completion] = []
        in_flight: _LaunchedStep | None = None

        def end_turns(slots: list[int]) -> None:
            """The turns of ``slots`` are over: their tokens to their completions; each trajectory
            then waits for the environment's answer, or is finished."""
            if not slots:
                return
            histories = state.history.of_slots(slots, [first_step[s] for s in slots])
            turns: dict[int, list[int]] = {}
            for slot, (tokens, logprobs) in zip(slots, histories, strict=True):
                completion = occupant[slot]
                assert completion is not None, "end_turns() is given occupied slots only"
                # the policy mask runs to the end of the last turn or answer: this turn's first token is past it
                turn_start = len(completion.policy_mask) if completion.policy_mask is not None else 0
                completion.token_ids += tokens
                completion.logprobs += logprobs
                completion.finish_reason = "stop" if completion.token_ids[-1] in stop_ids else "length"
                if completion.policy_mask is not None:
                    completion.policy_mask += [True] * (len(completion.token_ids) - len(completion.policy_mask))
                    if completion.finish_reason == "stop" and self._room(completion, params) > 1:
                        turns[slot] = completion.token_ids[turn_start:]  # room for an answer and a turn after it
            answered = environment.after_turns(turns) if environment is not None else set()
            finish([slot for slot in slots if slot not in answered])

        def finish(slots: list[int]) -> None:
            records = environment.close(slots) if environment is not None else {}
            for slot in slots:
                completion = occupant[slot]
                assert completion is not None, "finish() is given occupied slots only"
                if slot in records:
                    completion.trajectory = records[slot]
                finished.append(completion)
                occupant[slot] = None
                if on_finished is not None:
                    on_finished(len(finished))

        def continue_answered(slots: list[int]) -> None:
            """Append the environment's answers, then prefill them to continue each trajectory
            (or finish it when the answer ends it or leaves no room for another token)."""
            answers = environment.take(slots) if environment is not None else {}
            continued: dict[int, list[int]] = {}
            ended = []
            for slot in slots:
                completion = occupant[slot]
                assert completion is not None and completion.policy_mask is not None
                if answers[slot].ends:  # the trajectory ends at the policy's turn, its stop token last
                    ended.append(slot)
                    continue
                room = self._room(completion, params)
                answer = answers[slot].token_ids[:room]
                completion.token_ids += answer
                completion.logprobs += [0.0] * len(answer)
                completion.policy_mask += [False] * len(answer)
                if len(answer) < room:
                    # from the turn's last token: a decode step caches a token's keys only when it
                    # feeds it, which may never have happened to a stop token
                    continued[slot] = completion.token_ids[-len(answer) - 1 :]
                    first_step[slot] = state.history.steps
                else:  # the answer filled the response budget or the context
                    completion.finish_reason = "length"
                    ended.append(slot)
            finish(ended)
            rows = [(slot, completion) for slot in continued if (completion := occupant[slot]) is not None]
            self._prefill(
                [c for _, c in rows],
                [slot for slot, _ in rows],
                state,
                params,
                generator,
                continued_by=list(continued.values()),
            )

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                while True:
                    ended = [
                        slot
                        for slot in (~state.live_known).nonzero().flatten().tolist()
                        if occupant[slot] is not None and not (environment is not None and environment.waits(slot))
                    ]
                    if environment is not None and ended:
                        end_turns(ended)  # no drain: the step in flight gives a slot that ended no token
                        continue
                    answered = environment.ready(state.history.steps) if environment is not None else []
                    free = [slot for slot, held in enumerate(occupant) if held is None]
                    resume = bool(answered) and (
                        not bool(state.live_known.any())
                        or bool(waiting and free)
                        or (
                            environment is not None
                            and environment.idle_slot_steps(state.history.steps) >= _RESUME_COST_STEPS * count
                        )
                    )
                    if resume or (waiting and (free or ended)):
                        if in_flight is not None:  # drain: the host's view of the slots must be current first
                            self._collect(in_flight, state)
                            in_flight = None
                            continue
                        end_turns(ended)
                        continue_answered(answered)
                        free = [slot for slot, held in enumerate(occupant) if held is None]
                        admitted = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                        for slot, completion in zip(free, admitted, strict=False):
                            occupant[slot], first_step[slot] = completion, state.history.steps
                            if environment is not None:
                                environment.start(slot, completion)
                        self._prefill(admitted, free[: len(admitted)], state, params, generator)
                        continue
                    if not bool(state.live_known.any()):  # nothing generates any more
                        if in_flight is not None:
                            self._collect(in_flight, state)
                            in_flight = None
                            continue
                        if environment is not None and environment.waiting_slots():
                            environment.wait()  # for an answer: nothing else to do meanwhile
                            continue
                        break
                    launched = self._launch_decode(state, params, generator)
                    if in_flight is not None:
                        self._collect(in_flight, state)
                    in_flight = launched
                end_turns([slot for slot, held in enumerate(occupant) if held is not None])
        finally:
            self.model.train(was_training)
            if environment is not None:
                environment.abandon()
        return sorted(finished, key=lambda c: (c.prompt_index, c.sample_index))

    # ------------------------------------------------------------------ steps

    def _completion(
        self, prompt_index: int, sample_index: int, prompt: list[int], params: SamplingParams, multi_turn: bool
    ) -> Completion:
        if not prompt:
            raise ValueError(f"prompt {prompt_index} is empty")
        room = self.cfg.max_seq_len - 1  # at least one new token must fit
        if len(prompt) > room and self.cfg.on_long_prompt == "error":
            raise PromptTooLongError(
                f"prompt {prompt_index} has {len(prompt)} tokens; rollout.engine.max_seq_len={self.cfg.max_seq_len} "
                f"leaves room for at most {room} (set rollout.engine.on_long_prompt=truncate to drop the oldest "
                "tokens instead)"
            )
        # Truncated, a prompt leaves room for the whole response budget (down to one token of its own).
        dropped = (
            max(len(prompt) - max(self.cfg.max_seq_len - params.max_new_tokens, 1), 0) if len(prompt) > room else 0
        )
        return Completion(
            prompt_index,
            sample_index,
            prompt[dropped:],
            [],
            [],
            prompt_tokens_dropped=dropped,
            policy_mask=[] if multi_turn else None,
        )

    def _room(self, completion: Completion, params: SamplingParams) -> int:
        """Tokens a completion may still add: its response budget and the context, whichever ends first."""
        used = len(completion.token_ids)
        return min(params.max_new_tokens - used, self.cfg.max_seq_len - len(completion.prompt_ids) - used)

    def _prefill(
        self,
        admitted: list[Completion],
        slot_ids: list[int],
        state: _DecodeState,
        params: SamplingParams,
        generator: torch.Generator,
        *,
        continued_by: list[list[int]] | None = None,
    ) -> None:
        """Sequences into their slots: one batched prefill, the first token of each, and the slots'
        device state (budget: ``_room``).

        A new sequence's prefill is its prompt from position 0. The samples of one prompt admitted
        together share it: the first sample's slot is computed, the others copy its cache rows,
        and each samples its first token from the same logits (with n samples per prompt, 1/n of
        the prefill's work). With ``continued_by``, each sequence is a trajectory already in its
        slot, and these are its response's last tokens (the turn's last token, then the
        environment's answer): only they are prefilled, after what the slot holds."""
        if not admitted:
            return
        continued = continued_by is not None
        if continued_by is not None:
            new_tokens = continued_by
            starts = [
                len(c.prompt_ids) + len(c.token_ids) - len(new) for c, new in zip(admitted, new_tokens, strict=True)
            ]
            computed = list(range(len(admitted)))
            source = computed
        else:
            new_tokens = [c.prompt_ids for c in admitted]
            starts = [0] * len(admitted)
            first_row: dict[int, int] = {}  # prompt index -> the admitted row computed for it
            source = [first_row.setdefault(c.prompt_index, row) for row, c in enumerate(admitted)]
            computed = list(first_row.values())
        lengths = [start + len(new) for start, new in zip(starts, new_tokens, strict=True)]  # tokens in each slot
        width = max(len(new_tokens[row]) for row in computed)
        input_ids = right_padded(
            flat_tensor((new_tokens[row] for row in computed), torch.long),
            torch.tensor([len(new_tokens[row]) for row in computed]),
            width,
            0,
        )
        # Padding's positions run past a row's tokens; capped in the cache, their keys are never read.
        positions = (torch.tensor([starts[row] for row in computed])[:, None] + torch.arange(width)).clamp(
            max=self.cfg.max_seq_len - 1
        )
        device_state = state.slots
        computed_slots = torch.tensor([slot_ids[row] for row in computed], device=self.device)
        logits = self._model_logits(
            input_ids,
            positions,
            computed_slots,
            device_state.cache,
            last=torch.tensor([len(new_tokens[row]) for row in computed]) - 1,
            continued=continued,
        )
        if len(computed) < len(admitted):
            copies = [row for row in range(len(admitted)) if source[row] != row]
            cache = device_state.cache.data
            cache[:, [slot_ids[row] for row in copies], :, :width] = cache[
                :, [slot_ids[source[row]] for row in copies], :, :width
            ]
            where = {row: i for i, row in enumerate(computed)}
            logits = logits[torch.tensor([where[source[row]] for row in range(len(admitted))], device=self.device)]
        slots = torch.tensor(slot_ids, device=self.device)
        tokens, logprobs = self._sample(logits, params, generator)
        budget = torch.tensor([self._room(c, params) for c in admitted], device=self.device)
        device_state.input_ids[slots, 0] = tokens
        device_state.positions[slots, 0] = torch.tensor(lengths, device=self.device)  # the first token's position
        device_state.remaining[slots] = budget - 1
        device_state.live[slots] = (budget > 1) & ~torch.isin(tokens, state.stop_ids)
        state.live_known[slot_ids] = device_state.live[slots].cpu()
        state.position_bound[slot_ids] = torch.tensor(lengths)
        for completion, token, logprob in zip(admitted, tokens.tolist(), logprobs.tolist(), strict=True):
            completion.token_ids.append(token)
            completion.logprobs.append(logprob)

    def _launch_decode(self, state: _DecodeState, params: SamplingParams, generator: torch.Generator) -> _LaunchedStep:
        """Queue one decode step over every slot and the state update after it; returns without
        waiting for the device."""
        device_state = state.slots
        maybe_live = state.live_known  # a superset of the device's live slots (the host lags)
        kv_len = min(int(state.position_bound[maybe_live].max()) + 1, device_state.cache.max_len)
        if device_state.graphs is not None:
            logits = device_state.graphs.logits(kv_len)
        else:
            logits = self._decode_logits(device_state, kv_len)
        tokens, logprobs = self._sample(logits, params, generator)
        live = device_state.live
        produced = _advance_slots(
            tokens, live, device_state.input_ids, device_state.positions, device_state.remaining, state.stop_ids
        )
        state.position_bound += maybe_live
        host_tokens, host_logprobs, host_live = device_state.staging[state.parity]
        state.parity = 1 - state.parity
        host_tokens.copy_(produced, non_blocking=True)
        host_logprobs.copy_(logprobs, non_blocking=True)
        host_live.copy_(live, non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return _LaunchedStep(host_tokens, host_logprobs, host_live, ready)

    def _collect(self, step: _LaunchedStep, state: _DecodeState) -> None:
        """Read a launched step's outputs into the history and the host's view of live slots."""
        if step.ready is not None:
            step.ready.synchronize()
        state.history.append(step.tokens, step.logprobs)
        state.live_known.copy_(step.live)

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row; every TP rank continues with rank 0's."""
        tokens, logprobs = sample(logits, params, generator, self.cfg.filtered_sampler)
        if self.tp_group.size() > 1:
            dist.broadcast(tokens, src=self.tp_src, group=self.tp_group)
            dist.broadcast(logprobs, src=self.tp_src, group=self.tp_group)
        return tokens, logprobs

    def _decode_logits(self, slots: _Slots, kv_len: int) -> torch.Tensor:
        """(slots, V) logits of one decode step of the slots' current inputs (what graphs capture)."""
        return self._model_logits(slots.input_ids, slots.positions, slots.all_slots, slots.cache, kv_len=kv_len)

    def _model_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        *,
        last: torch.Tensor | None = None,
        kv_len: int | None = None,
        continued: bool = False,
    ) -> torch.Tensor:
        """Run the model over (b, sq) tokens at the given positions of the given cache slots; (b, V)
        logits (model dtype) of the token at index ``last[row]`` of each row.

        With ``last``: a prefill, every row from position 0, attending causally over its own
        tokens (``continued``: from its given positions, over its slot's cache as well). Without: a
        decode step, one token per slot (rows = all slots), attending over cache
        positions [0, kv_len). No host synchronisation: decode graphs capture this."""
        model, device = self.model, self.device
        input_ids, positions = input_ids.to(device), positions.to(device)
        cos, sin = rotary_tables(positions, model.rotary_pos_emb.inv_freq.to(device), model.config.params_dtype)
        prefill = last is not None
        step = DecodeStep(
            cache=cache,
            slots=slots,
            positions=positions,
            cos=cos,
            sin=sin,
            prefill=prefill,
            kv_len=kv_len,
            window=self.window,
            continued=continued,
        )
        for module in self.attention:
            module.kv_step = step
        try:
            hidden = model.embedding(input_ids=input_ids, position_ids=positions)  # (sq, b, h)
            if prefill or not self.fused_decode:
                hidden = model.decoder(hidden_states=hidden, attention_mask=None)
            else:
                hidden = _decode_layers(model.decoder, hidden, step, self.tp_group)
        finally:
            for module in self.attention:
                module.kv_step = None
        # (b, h): each sequence's last prompt position after a prefill, the one new position after a decode step
        final = (
            hidden[last.to(device), torch.arange(hidden.shape[1], device=device)] if last is not None else hidden[-1]
        )
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(final[None], weight=weight)  # (1, b, Vp / tp)
        logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
        return logits[0, :, : self.role.arch.vocab_size]


@gpu_fused
def _advance_slots(
    tokens: torch.Tensor,
    live: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    remaining: torch.Tensor,
    stop_ids: torch.Tensor,
) -> torch.Tensor:
    """The slots' device state after a decode step drew ``tokens`` (slots,), in place: a live slot
    takes its token as the next input, moves one position, spends one token of its budget, and
    dies on a stop token or an empty budget. Returns what each slot produced (-1 where it was not
    live). One compiled kernel or two on a GPU, where eager torch launched a dozen per step."""
    produced = torch.where(live, tokens, -1)
    input_ids.copy_(tokens[:, None])
    positions.add_(live[:, None])
    remaining.sub_(live.long())
    live &= (remaining > 0) & ~(tokens[:, None] == stop_ids[None, :]).any(dim=1)
    return produced


def _decode_fusable(decoder: TransformerBlock) -> bool:
    """Whether ``_decode_layers`` computes what the decoder's own forward does: pre-norm layers of
    torch RMSNorms (the TE-free spec without apex), megatron's own parallel linears without biases
    outside QKV, attention without Q/K norms over at least one KV group per TP rank, then a SwiGLU
    MLP; a final norm; no sequence parallelism."""
    layers = list(decoder.layers)
    config = decoder.config
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.pre_mlp_layernorm)] + [
        decoder.final_layernorm
    ]

    def plain(layer: TransformerLayer) -> bool:
        attention, mlp = layer.self_attention, layer.mlp
        return (
            isinstance(attention, CachedSelfAttention)
            and attention.q_layernorm is None
            and attention.k_layernorm is None
            and type(attention.linear_qkv) is ColumnParallelLinear
            and type(mlp.linear_fc1) is ColumnParallelLinear
            and type(attention.linear_proj) is RowParallelLinear
            and type(mlp.linear_fc2) is RowParallelLinear
            and config.num_query_groups >= attention.world_size
        )

    return (
        bool(layers)
        and all(type(n) is torch.nn.RMSNorm for n in norms)
        and all(plain(layer) for layer in layers)
        and config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and config.activation_func_clamp_value is None
        and config.glu_linear_offset == 0
        and not (
            config.apply_residual_connection_post_layernorm
            or config.fp32_residual_connection
            or config.num_moe_experts
            or config.sequence_parallel
        )
    )


def _decode_layers(
    decoder: TransformerBlock, hidden: torch.Tensor, step: DecodeStep, tp_group: dist.ProcessGroup
) -> torch.Tensor:
    """The decoder's forward for one decode step (one token per cache slot) in as few kernels as it
    takes. At a decode step's few rows each kernel costs its launch-bound microseconds whatever it
    does, so per layer: each residual add fused with the RMSNorm after it (``add_rms_norm``), the
    QKV bias in its GEMM, the QKV split, rotary, cache store and attention one kernel on a GPU
    (``rotate_store_attend``), the SwiGLU compiled; the row-parallel outputs summed over TP as
    megatron's ``RowParallelLinear`` sums them. megatron's modules add a separate bias kernel and a
    copy of the query, and run each add and norm on its own."""
    assert step.kv_len is not None, "a decode step attends over cache positions [0, kv_len)"
    delta = torch.zeros_like(hidden)
    for layer in decoder.layers:
        attention, mlp = layer.self_attention, layer.mlp
        hidden, normed = add_rms_norm(hidden, delta, layer.input_layernorm.weight, layer.input_layernorm.eps)
        mixed = F.linear(normed, attention.linear_qkv.weight, attention.linear_qkv.bias)
        heads_per_group = attention.num_attention_heads_per_partition // attention.num_query_groups_per_partition
        attended = rotate_store_attend(
            mixed,
            heads_per_group,
            step.cos,
            step.sin,
            step.cache.layer(attention.layer_number),
            step.slots,
            step.positions,
            step.kv_len,
            step.window,
            attention.core_attention.softmax_scale,
        )
        attended = reduce_from_tensor_model_parallel_region(F.linear(attended, attention.linear_proj.weight), tp_group)
        hidden, normed = add_rms_norm(hidden, attended, layer.pre_mlp_layernorm.weight, layer.pre_mlp_layernorm.eps)
        up = F.linear(normed, mlp.linear_fc1.weight)
        delta = reduce_from_tensor_model_parallel_region(F.linear(swiglu(up), mlp.linear_fc2.weight), tp_group)
    final = decoder.final_layernorm
    return add_rms_norm(hidden, delta, final.weight, final.eps)[1]


GROUP_SEED_STRIDE = 2**31 - 1
"""Seed offset between data-parallel generation groups (a prime, far from the trainer's per-step and
per-draw offsets)."""


def generate_data_parallel(
    engine: NativeEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    on_finished: Callable[[int], None] | None = None,
    agent: Agent | None = None,
) -> list[Completion]:
    """Generate over the engine's data-parallel groups: each takes every dp-th prompt; every rank
    of the world returns all completions, ordered by (prompt_index, sample_index). Collective.
    ``on_finished`` follows this rank's group (see ``NativeEngine.generate``); ``agent`` is asked
    for episodes by the prompts' indices in ``prompts``."""
    role = engine.role
    dp, dp_rank = role.groups.layout.dp, role.groups.dp_rank
    if dp == 1:  # every rank generated every prompt alike (TP ranks continue with rank 0's tokens)
        return engine.generate([list(p) for p in prompts], params, on_finished, agent)
    mine = list(range(dp_rank, len(prompts), dp))
    local_agent = _PromptsOf(agent, mine) if agent is not None else None
    # Each group draws from its own stream: with one seed, the groups' i-th slots drew the same numbers.
    group_params = dataclasses.replace(params, seed=params.seed + dp_rank * GROUP_SEED_STRIDE)
    completions = engine.generate([list(prompts[i]) for i in mine], group_params, on_finished, local_agent)
    for completion in completions:
        completion.prompt_index = mine[completion.prompt_index]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, completions if role.groups.tp_rank == 0 else [])
    return sorted((c for part in gathered for c in part), key=lambda c: (c.prompt_index, c.sample_index))


@dataclasses.dataclass
class _PromptsOf:
    """``agent`` seen from a data-parallel group that generates the prompts ``indices`` of the batch."""

    agent: Agent
    indices: list[int]

    def episode(self, prompt_index: int, sample_index: int) -> Episode:
        return self.agent.episode(self.indices[prompt_index], sample_index)


class _DecodeGraphs:
    """CUDA graphs of the decode step over every cache slot, one per KV-length bucket.

    A graph reads the slots' input buffers and the weights at ``weights`` (their addresses when
    this set was made) and writes static logits. Captured lazily, sharing one memory pool; each
    capture is counted on the engine. Sampling stays outside the graph.
    """

    def __init__(self, engine: NativeEngine, slots: _Slots) -> None:
        self.engine, self.slots = engine, slots
        self.weights = _weight_addresses(engine.model)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _bucket(self, kv_len: int) -> int:
        step = self.engine.cfg.graph_kv_bucket
        return min(-(-kv_len // step) * step, self.slots.cache.max_len)

    def _run(self, kv_len: int) -> torch.Tensor:
        return self.engine._decode_logits(self.slots, kv_len)

    def logits(self, kv_len: int) -> torch.Tensor:
        """(slots, V) logits of the decode step of the slots' current inputs."""
        bucket = self._bucket(kv_len)
        if bucket not in self.graphs:
            start = time.perf_counter()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph (compilation, library handles, allocator)
                    self._run(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._run(bucket)
            self.graphs[bucket] = (graph, out)
            torch.cuda.current_stream().synchronize()
            self.engine.graph_captures += 1
            self.engine.graph_capture_seconds += time.perf_counter() - start
        graph, out = self.graphs[bucket]
        graph.replay()
        return out


def _weight_addresses(model: torch.nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())
