"""The memory plan of a run: each model's layout and the per-GPU memory, before launching it
(what ``megatron-rlhf plan`` prints).

Everything comes from the resolved config and each model's ``Architecture`` (a ``config.json``, or a
built-in's): no weights are read, no model is built, no GPU or process group is touched. The
command's own up-front checks run first, for the given world size, so a config the run would
refuse is refused here with the same messages.

Per rank, for each model the command uses, in the largest of its pipeline stages:
* weights: the parameters of the rank's TP slice (vocabulary padded as the builder pads it; a tied
  output layer is a second copy on the last stage when PP > 1), in the run's dtype;
* gradients: megatron DDP's buffer, fp32 (``grad_reduce_in_fp32``), one value per local parameter;
* optimizer state: Adam's two fp32 moments, plus fp32 main parameters unless the parameters are
  fp32 themselves (then the main parameters are the parameters), sharded over DP by the
  distributed optimizer; the ``cpu_offload_fraction`` share of it lives in host memory instead;
* activations of a training pass (``activation_bytes``) and of a forward-only pass, and the
  optimizer step's workspace: none for torch's fused Adam (``training.optim.fuse_device_adam``), but
  with a host share (megatron's ``HybridDeviceOptimizer``, whose device share steps on torch's
  multi-tensor path) one fp32 temporary of the main-parameter shard, which stays allocated through
  the update phase, so the next mini-batch's activations come on top of it (docs/benchmarks.md, memory
  plan against measured peaks).
Generation adds the KV cache (``hybrid.memory.kv_cache_bytes``), the resharded generation copy
when the generation layout differs from the actor's (else, for a LoRA actor, its adapted base
weights kept while the adapters are merged into them), the decode CUDA graphs' static logits (one
(slots, Vp/tp) tensor per KV-length bucket), and the prefill and sampling workspace. A LoRA actor's
reference that is its own base (``ppo_config.reference_from_actor``) holds no weights: the plan
leaves the reference out and says what it saves.

The phase peaks follow ``hybrid.offload``: without offloading, the KV cache and the generation copy
stay allocated through training; with it, the actor's gradient buffers and optimizer state leave
the device while generating (the generation phase still starts with them on the device). Alignment
padding (up to 64 elements a tensor in the DDP buffers), the resharding copy's temporaries, the
CUDA context and the allocator's fragmentation are not counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_rlhf.checkpoint.sources import ModelConfig
from megatron_rlhf.config.run import resolve_dtype
from megatron_rlhf.hybrid.memory import GIB, HEADROOM_FRACTION, decide_offload, generation_bytes, kv_cache_bytes
from megatron_rlhf.hybrid.reshard import generation_layout
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builder import padded_vocab_size
from megatron_rlhf.models.lora_config import TARGET_LINEARS, LoraConfig, target_shapes
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config, reference_from_actor
from megatron_rlhf.trainer.supervised import SupervisedConfig, check_config
from megatron_rlhf.training.optim import OptimConfig

LOGIT_COPIES_TRAINING = 1
"""(b, s, Vp/tp) tensors alive at once in a training pass: the LM head's logits at the scored
positions (ppo and sft run it there only, with no transposed copy). Their gradient is written over
them (``token_logprobs_and_entropy``'s ``overwrite_logits``) and is already contiguous for the
output layer's weight gradient. Counted at every position of the micro-batch, the prompts' too."""
LOGIT_COPIES_FORWARD = 2
"""In a forward pass: the output layer's (s, b, Vp/tp) logits and megatron's (b, s, Vp/tp) copy."""
SAMPLING_COPIES = 4
"""fp32 (rows, Vp/tp) tensors of the sampler (scaled logits, probabilities, their sort and sums)."""


def stage_parameters(arch: Architecture, layout: Layout, padded_vocab: int) -> int:
    """Parameters of one rank of the largest pipeline stage (megatron's local layer spec): per
    layer two norms, QKV (with bias for Qwen2, q/k norms for Qwen3), the output projection and the
    SwiGLU MLP, TP-split except the norms; the embedding on the first stage; the final norm and the
    LM head (or the score head, replicated) on the last."""
    tp, hidden = layout.tp, arch.hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    qkv = (q + 2 * kv) // tp
    layer = 2 * hidden + qkv * hidden + (qkv if arch.qkv_bias else 0) + (2 * arch.head_dim if arch.qk_norm else 0)
    layer += hidden * q // tp + 3 * hidden * arch.ffn_hidden_size // tp
    layers = arch.num_layers // layout.pp * layer
    embedding = padded_vocab // tp * hidden
    if arch.score_head:
        head = arch.num_labels * hidden
    else:
        head = 0 if arch.tie_word_embeddings and layout.pp == 1 else embedding
    if layout.pp == 1:
        return embedding + layers + hidden + head
    return max(embedding + layers, layers + hidden + head)


def stage_adapter_parameters(arch: Architecture, layout: Layout, lora: LoraConfig) -> int:
    """Trained parameters of one rank of a pipeline stage with LoRA (``models/lora.py``): per adapted
    module A (rank x in) and B (out x rank), the split one divided by tp (B on QKV and gate/up, A on
    o_proj and down_proj), plus a score head; the base is frozen."""
    tp, shapes = layout.tp, target_shapes(arch)
    layer = 0
    for name in lora.targets():
        inputs, outputs = shapes[name].in_features, shapes[name].out_features
        layer += lora.rank * (inputs // tp + outputs if shapes[name].input_split else inputs + outputs // tp)
    head = arch.num_labels * arch.hidden_size if arch.score_head else 0
    return arch.num_layers // layout.pp * layer + head


def stage_adapted_weights(arch: Architecture, layout: Layout, lora: LoraConfig) -> int:
    """Base weight elements of the linears LoRA adapts, on one rank of a pipeline stage: what a LoRA
    actor generating in its own layout keeps while its adapters are merged (``hybrid/reshard.py``).
    A fused linear (q/k/v, gate/up) is kept whole when any of its parts is adapted."""
    adapted = {TARGET_LINEARS[name] for name in lora.targets()}
    shapes = target_shapes(arch)
    per_layer = sum(
        shape.in_features * shape.out_features // layout.tp
        for name, shape in shapes.items()
        if TARGET_LINEARS[name] in adapted
    )
    return arch.num_layers // layout.pp * per_layer


def micro_batch_tokens(budget: int, rows: int, longest: int) -> int:
    """The most tokens (rows x longest row) a micro-batch of ``engine.microbatch`` holds when
    ``rows`` sequences of up to ``longest`` tokens are cut by a budget of ``budget``. Packed
    micro-batches (``pack_sequences``) are no larger: bins hold no more than ``longest`` tokens and
    there are no more bins than sequences. Their attention mask, (b, s, s) per micro-batch, and
    what SDPA keeps of it per layer on the GPU are not counted (not measured yet)."""
    return min(rows, max(1, budget // longest)) * longest


def forward_layer_bytes(arch: Architecture, tp: int, tokens: int, element: int) -> int:
    """One layer's working set in a pass without gradients (nothing is kept for a backward): its
    input and norm output (2h), and split over TP the QKV output (q + 2kv) and the MLP's fc1 and
    SwiGLU outputs (3f)."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    return tokens * (2 * arch.hidden_size + (q + 2 * kv + 3 * arch.ffn_hidden_size) // tp) * element


def activation_bytes(
    arch: Architecture, layout: Layout, padded_vocab: int, tokens: int, element: int, *, training: bool
) -> int:
    """Activation memory of one pass over micro-batches of ``tokens`` tokens on the busiest rank.

    Training (no activation recompute: the trainer has none) keeps, per token and layer, what the
    backward reads: the two norms' inputs and outputs (4h, not TP-split without sequence
    parallelism), and split over TP the fused QKV output (q + 2kv, alive through the value view the
    attention saves), the rotated q and k (q + kv), the attention output and its reshaped copy (2q),
    the MLP's fc1 output (2f) and SwiGLU output (f): ``4h + (4q + 3kv + 3f) / tp`` elements. The
    first pipeline stage holds up to ``pp`` micro-batches in flight (1F1B), the last one plus the
    logits: ``LOGIT_COPIES_TRAINING`` (b, s, Vp/tp) tensors in the model dtype (log-probs and
    entropy are computed in fp32 inside fused kernels, per token, with no fp32 vocabulary tensor).
    A forward-only pass keeps ``forward_layer_bytes`` and ``LOGIT_COPIES_FORWARD`` logits tensors.
    A score head's (b, s, 1) output is negligible.
    """
    tp, pp = layout.tp, layout.pp
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    logits = 0 if arch.score_head else tokens * (padded_vocab // tp) * element
    if not training:
        return forward_layer_bytes(arch, tp, tokens, element) + LOGIT_COPIES_FORWARD * logits
    per_token_layer = 4 * arch.hidden_size + (4 * q + 3 * kv + 3 * arch.ffn_hidden_size) // tp
    per_micro_batch = arch.num_layers // pp * tokens * per_token_layer * element
    return max(pp * per_micro_batch, per_micro_batch + LOGIT_COPIES_TRAINING * logits)


@dataclasses.dataclass(frozen=True)
class ModelMemory:
    """One model's bytes on the busiest rank of its layout."""

    role: str
    path: str
    layout: Layout
    parameters: int
    """Of the whole model (TP x PP shards together), padding included."""
    weights: int
    grads: int
    optimizer: int
    training_activations: int
    """0 for a model that is not trained."""
    forward_activations: int
    step_workspace: int

    @property
    def transient(self) -> int:
        """The largest of what one pass or step adds to the model's lasting memory."""
        return max(self.training_activations, self.forward_activations, self.step_workspace)


@dataclasses.dataclass(frozen=True)
class PhasePeaks:
    training: int
    generation: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    command: str
    world_size: int
    dtype: str
    gpu_memory: int
    models: list[ModelMemory]
    generation: Layout | None = None
    kv_cache: int = 0
    kv_slots: int = 0
    kv_len: int = 0
    generation_copy: int = 0
    graph_outputs: int = 0
    generation_workspace: int = 0
    lora_base: int = 0
    """A LoRA actor generating in its own layout: its adapted base weights, kept while merged."""
    reference_saved: int = 0
    """The weights per rank a reference model would hold, not built: the reference is the LoRA
    actor's base, its adapters off (``ppo_config.reference_from_actor``)."""
    offload_mode: str = "never"
    auto_offload: bool = False
    """What ``hybrid.offload=auto`` decides on a device of ``gpu_memory``."""
    auto_reason: str = ""
    peaks: dict[str, PhasePeaks] = dataclasses.field(default_factory=dict)
    """Per-rank peaks with (``offload``) and without (``keep``) offloading."""

    @property
    def offload(self) -> bool:
        """Whether the run offloads (``hybrid.offload``, with ``auto`` decided as above)."""
        return self.auto_offload if self.offload_mode == "auto" else self.offload_mode == "always"

    @property
    def peak(self) -> PhasePeaks:
        """The peaks of the run as configured."""
        return self.peaks["offload" if self.offload else "keep"]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for model, data in zip(self.models, out["models"], strict=True):
            data["layout"] = str(model.layout)
        out["generation"] = str(self.generation) if self.generation else None
        out["offload"] = self.offload
        return out


def _model_memory(
    role: str,
    model: ModelConfig,
    arch: Architecture,
    world_size: int,
    dtype: torch.dtype,
    *,
    optim: OptimConfig | None,
    tokens: int,
    forward_tokens: int,
    padded_vocab: int | None = None,
) -> ModelMemory:
    layout = Layout.for_world(model.tp, model.pp, world_size)
    vocab = padded_vocab or padded_vocab_size(arch.vocab_size, layout.tp)
    element = torch.empty((), dtype=dtype).element_size()
    local = stage_parameters(arch, layout, vocab)
    whole = stage_parameters(arch, Layout(1, 1, 1), vocab)
    grads = optimizer = training = step = 0
    if optim is not None:
        trained = stage_adapter_parameters(arch, layout, model.lora) if model.lora.enabled else local
        grads = 4 * trained
        per_param = 8 + (0 if dtype == torch.float32 else 4)
        shard = -(-trained // layout.dp) if optim.distributed_optimizer else trained
        optimizer = round(per_param * shard * (1 - optim.cpu_offload_fraction))
        training = activation_bytes(arch, layout, vocab, tokens, element, training=True)
        if optim.cpu_offload_fraction > 0:  # the step's workspace, which outlives the step (module docstring)
            step = 4 * shard
            training += step
    forward = activation_bytes(arch, layout, vocab, forward_tokens, element, training=False)
    return ModelMemory(role, model.path, layout, whole, local * element, grads, optimizer, training, forward, step)


def _run_dtype(name: str, device: str) -> torch.dtype:
    """The dtype the run will use; ``device=auto`` is planned as a GPU run (no GPU is looked for)."""
    return resolve_dtype(name, torch.device("cpu" if device == "cpu" else "cuda"))


def plan_ppo(
    cfg: PPOConfig, world_size: int, gpu_memory: int, archs: dict[str, Architecture] | None = None
) -> MemoryPlan:
    """The plan of ``megatron-rlhf ppo`` (``ConfigError`` for a config the run would refuse)."""
    archs = archs if archs is not None else check_ppo_config(cfg, world_size).archs  # a run has checked
    dtype = _run_dtype(cfg.dtype, cfg.device)
    data, rollout = cfg.data, cfg.rollout
    longest = cfg.longest_sequence
    rows = cfg.prompts_per_step * rollout.sampling.n
    budget = cfg.max_tokens_per_micro_batch
    actor_vocab = padded_vocab_size(archs["actor"].vocab_size, cfg.actor.tp)
    optims = {"actor": cfg.actor_optim, "critic": cfg.critic_optim}
    models = []
    reference_saved = 0
    for role, arch in archs.items():
        model = cfg.role(role)
        dp = Layout.for_world(model.tp, model.pp, world_size).dp
        follows = role == "reference" and cfg.reference.update != "none"
        memory = _model_memory(
            role,
            model,
            arch,
            world_size,
            dtype,
            optim=optims.get(role),
            tokens=micro_batch_tokens(budget, (cfg.mini_batch_size or rows) // dp, longest),
            forward_tokens=micro_batch_tokens(budget, rows // dp, longest),
            padded_vocab=actor_vocab if follows else None,
        )
        if role == "reference" and reference_from_actor(cfg):
            reference_saved = memory.weights  # its forward pass runs on the actor instead
            continue
        models.append(memory)
    actor, arch = models[0], archs["actor"]
    generation_tp = rollout.tp or cfg.actor.tp
    generation = generation_layout(actor.layout, generation_tp, world_size)
    element = torch.empty((), dtype=dtype).element_size()
    sequences = -(-cfg.prompts_per_step // generation.dp) * rollout.sampling.n
    slots = min(rollout.engine.max_batch_size, sequences)
    kv_len = min(rollout.engine.max_seq_len, longest)
    kv = kv_cache_bytes(arch, generation_tp=generation_tp, slots=slots, max_len=kv_len, dtype=dtype)
    lora_base = 0
    if cfg.actor.lora.enabled and generation == actor.layout:
        lora_base = stage_adapted_weights(arch, actor.layout, cfg.actor.lora) * element
    copy = (
        generation_bytes(
            arch,
            train=actor.layout,
            generation_tp=generation_tp,
            weight_bytes=actor.weights,
            slots=slots,
            max_len=kv_len,
            dtype=dtype,
        )
        - kv
    )
    engine = rollout.engine
    buckets = -(-kv_len // engine.graph_kv_bucket) if engine.cuda_graphs and cfg.device != "cpu" else 0
    graphs = buckets * slots * (actor_vocab // generation_tp) * element
    # One prefill of every slot's prompt (no grad: one layer's working set), then sampling over the vocabulary.
    workspace = (
        forward_layer_bytes(arch, generation_tp, slots * data.max_prompt_length, element)
        + SAMPLING_COPIES * slots * (actor_vocab // generation_tp) * 4
    )

    weights = sum(m.weights for m in models)
    state = sum(m.grads + m.optimizer for m in models)
    transient = max(m.transient for m in models)
    # The trainer decides from the memory free at set-up, less the Adam moments to come (ppo._decide_offload).
    auto, reason = decide_offload(
        "auto", generation_needs=kv + copy + lora_base, free=gpu_memory - weights - state, total=gpu_memory
    )
    offloaded = actor.grads + actor.optimizer
    kept = kv + copy + graphs  # what generation holds until the next rollout unless offloading
    peaks = {
        "keep": PhasePeaks(
            training=weights + state + kept + transient, generation=weights + state + kept + lora_base + workspace
        ),
        "offload": PhasePeaks(
            training=weights + state + transient,
            generation=max(weights + state, weights + state - offloaded + kept + lora_base + workspace),
        ),
    }
    return MemoryPlan(
        "ppo",
        world_size,
        str(dtype).removeprefix("torch."),
        gpu_memory,
        models,
        generation,
        kv,
        slots,
        kv_len,
        copy,
        graphs,
        workspace,
        lora_base,
        reference_saved,
        cfg.hybrid.offload,
        auto,
        reason,
        peaks,
    )


def plan_supervised(cfg: SupervisedConfig, world_size: int, gpu_memory: int, *, score_head: bool) -> MemoryPlan:
    """The plan of ``megatron-rlhf sft`` (``score_head=False``) or ``rm``: one trained model."""
    arch = check_config(cfg, world_size, score_head=score_head)
    dtype = _run_dtype(cfg.dtype, cfg.device)
    dp = Layout.for_world(cfg.model.tp, cfg.model.pp, world_size).dp
    rows = cfg.global_batch_size // dp * (2 if score_head else 1)  # rm: a chosen and a rejected row per pair
    tokens = micro_batch_tokens(cfg.max_tokens_per_micro_batch, rows, cfg.data.max_length)  # type: ignore[attr-defined]
    model = _model_memory(
        "model", cfg.model, arch, world_size, dtype, optim=cfg.optim, tokens=tokens, forward_tokens=tokens
    )
    peak = model.weights + model.grads + model.optimizer + model.transient
    command = "rm" if score_head else "sft"
    return MemoryPlan(
        command,
        world_size,
        str(dtype).removeprefix("torch."),
        gpu_memory,
        [model],
        peaks={"keep": PhasePeaks(training=peak, generation=0)},
    )


def plan_errors(plan: MemoryPlan) -> list[str]:
    """The phases whose estimated peak exceeds the device less a headroom (``HEADROOM_FRACTION``: what
    the estimate leaves out, the CUDA context, the libraries' workspaces and the allocator's
    fragmentation; about 6 GiB of an H100 in the 1.5B preset's run, which died at a 74.3 GiB
    estimate of 79.2), with the settings that would lower it."""
    errors = []
    usable = plan.gpu_memory * (1 - HEADROOM_FRACTION)
    limit = (
        f"{usable / GIB:.1f} GiB (plan.gpu_memory_gib={plan.gpu_memory / GIB:g} less a {HEADROOM_FRACTION:.0%} "
        "headroom for what the estimate leaves out)"
    )
    peak = plan.peak
    prefix = "actor" if plan.command == "ppo" else "model"
    if peak.training > usable:
        errors.append(
            f"the training phase needs about {peak.training / GIB:.1f} GiB per GPU, more than {limit}: lower "
            f"max_tokens_per_micro_batch, raise {prefix}.tp or {prefix}.pp, or use more GPUs (the world size)"
            + (
                ""
                if plan.command != "ppo" or plan.offload
                else "; hybrid.offload=always frees generation's memory during training"
            )
        )
    if plan.command == "ppo" and peak.generation > usable:
        errors.append(
            f"the generation phase needs about {peak.generation / GIB:.1f} GiB per GPU, more than {limit}: "
            + ("" if plan.offload else "set hybrid.offload=always, ")
            + "lower rollout.engine.max_batch_size, or raise rollout.tp or actor.tp"
        )
    return errors


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a readable table (GiB per GPU)."""

    def gib(value: int) -> str:
        return f"{value / GIB:9.2f}" if value else f"{'-':>9}"

    lines = [
        f"megatron-rlhf {plan.command} on {plan.world_size} GPU(s), {plan.dtype}, "
        f"checked against {plan.gpu_memory / GIB:g} GiB per GPU",
        "",
        "layouts:",
    ]
    for m in plan.models:
        lines.append(f"  {m.role:<11}{m.layout!s:<14}{m.parameters / 1e9:7.3f} B parameters   {m.path}")
    if plan.generation is not None:
        actor = plan.models[0].layout
        how = "zero copy of the actor" if plan.generation_copy == 0 else f"resharded from the actor's {actor}"
        lines.append(
            f"  {'generation':<11}{plan.generation!s:<14}{how}; "
            f"KV cache {plan.kv_slots} slots x {plan.kv_len} positions"
        )
    if plan.reference_saved:
        lines.append(
            f"  {'reference':<11}the actor's base, its LoRA adapters off: no reference model "
            f"(saves {plan.reference_saved / GIB:.2f} GiB of weights per GPU)"
        )
    lines += [
        "",
        "per-GPU memory, GiB (busiest rank of each layout):",
        f"  {'':<11}{'weights':>9}{'grads':>9}{'optimizer':>10}{'train act':>10}{'fwd act':>9}{'adam tmp':>9}",
    ]
    for m in plan.models:
        lines.append(
            f"  {m.role:<11}{gib(m.weights)}{gib(m.grads)} {gib(m.optimizer)} {gib(m.training_activations)}"
            f"{gib(m.forward_activations)}{gib(m.step_workspace)}"
        )
    if plan.generation is not None:
        lines.append(
            f"  generation: KV cache {plan.kv_cache / GIB:.2f}, generation copy {plan.generation_copy / GIB:.2f}, "
            f"graph logits {plan.graph_outputs / GIB:.2f}, "
            f"prefill + sampling workspace {plan.generation_workspace / GIB:.2f}"
            + (f", LoRA base weights kept while merged {plan.lora_base / GIB:.2f}" if plan.lora_base else "")
        )
        lines += ["", "peak per GPU, GiB:", f"  {'':<11}{'keep':>9}{'offload':>9}"]
        for phase in ("training", "generation"):
            lines.append(f"  {phase:<11}" + "".join(gib(getattr(plan.peaks[k], phase)) for k in ("keep", "offload")))
        lines += [
            "",
            f"hybrid.offload={plan.offload_mode}: the run "
            + ("offloads" if plan.offload else "keeps the training state on the GPU while generating")
            + f" (peaks: {'offload' if plan.offload else 'keep'})",
            f"  auto would decide: {plan.auto_reason}",
        ]
    else:
        lines += ["", f"peak per GPU: training {plan.peak.training / GIB:.2f} GiB"]
    return "\n".join(lines)
