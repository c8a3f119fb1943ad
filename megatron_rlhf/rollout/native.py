"""The native generation engine: megatron-core model + preallocated KV cache, continuous batching.

Flow of ``generate``: prompts (x n samples) wait in a queue; free cache slots take waiting prompts
(one batched, right-padded prefill), then every running sequence advances one token per decode
step; a finished sequence frees its slot for the next waiting prompt at once. TP-aware: each rank
computes its attention heads and vocabulary shard; the sampled tokens are broadcast from TP rank 0
so that all ranks continue with identical sequences. Pipeline parallelism is collapsed (pp=1).

Shapes: prefill input (b, W) right-padded; decode input (b, 1); logits (b, V) over the real vocab.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_rlhf.models.attention import CachedSelfAttention
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.rollout.kv_cache import DecodeStep, KVCache
from megatron_rlhf.rollout.sampling import SamplingParams, sample

LONG_PROMPT_POLICIES = ("error", "truncate")


@dataclasses.dataclass(kw_only=True)
class NativeEngineConfig:
    max_batch_size: int = 64
    """KV-cache slots: sequences decoded together."""
    max_seq_len: int = 2048
    """Prompt + response tokens per sequence (the cache length)."""
    on_long_prompt: str = "error"
    """A prompt with no room for one new token: error, or truncate (drop its oldest tokens, counted)."""
    eos_token_ids: tuple[int, ...] = ()
    """End-of-sequence ids of the tokenizer; generation stops on them unless ignore_eos."""
    cuda_graphs: bool = True
    """On GPU, replay decode steps as CUDA graphs (one per KV-length bucket), removing per-step
    launch overhead; prefill stays eager. Ignored on CPU."""
    graph_kv_bucket: int = 128
    """Decode graphs attend over the cache rounded up to a multiple of this many positions."""

    def __post_init__(self) -> None:
        if self.on_long_prompt not in LONG_PROMPT_POLICIES:
            raise ValueError(f"on_long_prompt={self.on_long_prompt!r} must be one of {list(LONG_PROMPT_POLICIES)}")
        if self.graph_kv_bucket < 1:
            raise ValueError(f"graph_kv_bucket={self.graph_kv_bucket} must be >= 1")
        if self.max_batch_size < 1 or self.max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {self.max_batch_size}, {self.max_seq_len}")


class PromptTooLongError(ValueError):
    pass


@dataclasses.dataclass
class _Sequence:
    completion: Completion
    slot: int = -1

    @property
    def length(self) -> int:
        return len(self.completion.prompt_ids) + len(self.completion.token_ids)


class NativeEngine:
    def __init__(self, role: RoleModel, cfg: NativeEngineConfig) -> None:
        if role.groups.layout.pp != 1:
            raise ValueError(f"the generation layout must have pp=1 (got {role.groups.layout}): PP is collapsed for decoding")
        if role.arch.score_head:
            raise ValueError(f"cannot generate with a {role.arch.hf_class_name}: it has no LM head")
        self.role, self.cfg = role, cfg
        self.model = role.model
        self.device = next(self.model.parameters()).device
        self.attention = [m for m in self.model.modules() if isinstance(m, CachedSelfAttention)]
        tp_group = role.groups.pg_collection.tp
        self.tp_group = tp_group
        self.tp_src = dist.get_global_rank(tp_group, 0)

    # ------------------------------------------------------------------ public

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        waiting = collections.deque(
            _Sequence(self._completion(i, j, list(prompt), params)) for i, prompt in enumerate(prompts) for j in range(params.n)
        )  # fmt: skip
        if not waiting:
            return []
        arch = self.role.arch
        tp = self.role.groups.layout.tp
        cache = KVCache(
            num_layers=len(self.attention), slots=min(self.cfg.max_batch_size, len(waiting)), max_len=self.cfg.max_seq_len,
            groups=arch.num_query_groups // tp, head_dim=arch.head_dim, dtype=self.model.config.params_dtype, device=self.device,
        )  # fmt: skip
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.cfg.eos_token_ids))
        free = list(range(cache.keys.shape[1]))
        graphs = _DecodeGraphs(self, cache) if self.cfg.cuda_graphs and self.device.type == "cuda" else None
        running: list[_Sequence] = []
        finished: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                while waiting or running:
                    if waiting and free:
                        admitted = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                        for seq in admitted:
                            seq.slot = free.pop(0)
                        self._prefill(admitted, cache, params, generator)
                        running += admitted
                    else:
                        self._decode(running, cache, params, generator, graphs)
                    still_running = []
                    for seq in running:
                        if self._is_done(seq, params, stop_ids):
                            finished.append(seq.completion)
                            free.append(seq.slot)
                        else:
                            still_running.append(seq)
                    running = still_running
                    free.sort()
        finally:
            self.model.train(was_training)
        return sorted(finished, key=lambda c: (c.prompt_index, c.sample_index))

    # ------------------------------------------------------------------ steps

    def _completion(self, prompt_index: int, sample_index: int, prompt: list[int], params: SamplingParams) -> Completion:
        if not prompt:
            raise ValueError(f"prompt {prompt_index} is empty")
        room = self.cfg.max_seq_len - 1  # at least one new token must fit
        dropped = max(len(prompt) - room, 0)
        if dropped and self.cfg.on_long_prompt == "error":
            raise PromptTooLongError(
                f"prompt {prompt_index} has {len(prompt)} tokens; max_seq_len={self.cfg.max_seq_len} leaves room "
                f"for at most {room} (set on_long_prompt=truncate to drop the oldest tokens instead)"
            )
        return Completion(prompt_index, sample_index, prompt[dropped:], [], [], prompt_tokens_dropped=dropped)

    def _is_done(self, seq: _Sequence, params: SamplingParams, stop_ids: set[int]) -> bool:
        completion = seq.completion
        if completion.token_ids and completion.token_ids[-1] in stop_ids:
            completion.finish_reason = "stop"
            return True
        if len(completion.token_ids) >= params.max_new_tokens or seq.length >= self.cfg.max_seq_len:
            completion.finish_reason = "length"
            return True
        return False

    def _prefill(self, seqs: list[_Sequence], cache: KVCache, params: SamplingParams, generator: torch.Generator) -> None:
        lengths = [len(s.completion.prompt_ids) for s in seqs]
        width = max(lengths)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, seq in enumerate(seqs):
            input_ids[row, : lengths[row]] = torch.tensor(seq.completion.prompt_ids)
        positions = torch.arange(width).expand(len(seqs), width)
        last = torch.tensor(lengths) - 1
        logits = self._model_logits(input_ids, positions, self._slots(seqs), width, cache, last)
        self._append_samples(seqs, logits, params, generator)

    def _decode(
        self, seqs: list[_Sequence], cache: KVCache, params: SamplingParams, generator: torch.Generator,
        graphs: "_DecodeGraphs | None",
    ) -> None:  # fmt: skip
        input_ids = torch.tensor([[s.completion.token_ids[-1]] for s in seqs])
        positions = torch.tensor([[s.length - 1] for s in seqs])
        kv_len = max(s.length for s in seqs)
        if graphs is not None:
            logits = graphs.logits(input_ids, positions, [s.slot for s in seqs], kv_len)
        else:
            last = torch.zeros(len(seqs), dtype=torch.long)
            logits = self._model_logits(input_ids, positions, self._slots(seqs), kv_len, cache, last)
        self._append_samples(seqs, logits, params, generator)

    def _slots(self, seqs: list[_Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], device=self.device)

    def _append_samples(
        self, seqs: list[_Sequence], logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> None:
        tokens, logprobs = sample(logits, params, generator)
        if self.tp_group.size() > 1:  # every TP rank continues with rank 0's tokens
            dist.broadcast(tokens, src=self.tp_src, group=self.tp_group)
            dist.broadcast(logprobs, src=self.tp_src, group=self.tp_group)
        for seq, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.completion.token_ids.append(token)
            seq.completion.logprobs.append(logprob)

    def _model_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int, cache: KVCache,
        last: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Run the model over (b, sq) tokens at the given positions of the given cache slots,
        attending over cache positions [0, kv_len); (b, V) float32 logits of the token at index
        ``last[row]`` of each row. No host synchronisation: decode graphs capture this."""
        model, device = self.model, self.device
        input_ids, positions, last = input_ids.to(device), positions.to(device), last.to(device)
        inv_freq = model.rotary_pos_emb.inv_freq.to(device)
        angles = positions.t().float()[..., None] * inv_freq  # (sq, b, rotary_dim / 2)
        step = DecodeStep(
            cache=cache,
            slots=slots,
            positions=positions,
            rotary_freqs=torch.cat([angles, angles], dim=-1)[:, :, None, :],
            kv_len=kv_len,
        )
        for module in self.attention:
            module.kv_step = step
        try:
            hidden = model.embedding(input_ids=input_ids, position_ids=positions)  # (sq, b, h)
            hidden = model.decoder(hidden_states=hidden, attention_mask=None)
        finally:
            for module in self.attention:
                module.kv_step = None
        final = hidden[last, torch.arange(hidden.shape[1], device=device)]  # (b, h)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(final[None], weight=weight)  # (1, b, Vp / tp)
        logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
        return logits[0, :, : self.role.arch.vocab_size].float()


def generate_data_parallel(
    role: RoleModel, cfg: NativeEngineConfig, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[Completion]:
    """Generate over the role's data-parallel groups: each takes every dp-th prompt; every rank of
    the world returns all completions, ordered by (prompt_index, sample_index). Collective."""
    dp, dp_rank = role.groups.layout.dp, role.groups.dp_rank
    mine = list(range(dp_rank, len(prompts), dp))
    completions = NativeEngine(role, cfg).generate([list(prompts[i]) for i in mine], params)
    for completion in completions:
        completion.prompt_index = mine[completion.prompt_index]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, completions if role.groups.tp_rank == 0 else [])
    return sorted((c for part in gathered for c in part), key=lambda c: (c.prompt_index, c.sample_index))


class _DecodeGraphs:
    """CUDA graphs of the decode step over every cache slot, one per KV-length bucket.

    A graph reads static input buffers (one row per slot; rows of idle slots decode a dummy token
    at position 0, harmless: a slot's next prefill overwrites its cache) and writes static logits.
    Captured lazily, sharing one memory pool. Sampling stays outside the graph.
    """

    def __init__(self, engine: NativeEngine, cache: KVCache) -> None:
        self.engine, self.cache = engine, cache
        slots = cache.keys.shape[1]
        device = engine.device
        self.input_ids = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.slots = torch.arange(slots, device=device)
        self.last = torch.zeros(slots, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _bucket(self, kv_len: int) -> int:
        step = self.engine.cfg.graph_kv_bucket
        return min(-(-kv_len // step) * step, self.cache.max_len)

    def _run(self, kv_len: int) -> torch.Tensor:
        return self.engine._model_logits(self.input_ids, self.positions, self.slots, kv_len, self.cache, self.last)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: list[int], kv_len: int) -> torch.Tensor:
        index = torch.tensor(slots, device=self.slots.device)
        self.input_ids.zero_()
        self.positions.zero_()
        self.input_ids[index] = input_ids.to(self.input_ids.device)
        self.positions[index] = positions.to(self.positions.device)
        bucket = self._bucket(kv_len)
        if bucket not in self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph (library handles, allocator)
                    self._run(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._run(bucket)
            self.graphs[bucket] = (graph, out)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[index]
