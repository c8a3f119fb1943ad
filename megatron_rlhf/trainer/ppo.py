"""``megatron-rlhf ppo``: RL from prompts (PPO with a critic, or GRPO-style group baselines).

One SPMD program: every rank holds its shards of the models the algorithm needs, each in its own
layout. One step, on every rank, top to bottom in ``ppo_step``:

  1. rollout      the hybrid engine frees the actor's training memory, builds the generation
                  weights (zero copy, or resharded), samples ``rollout.n`` responses per prompt
                  and restores training memory; every rank gets every completion;
  2. rewards      rule functions (split over ranks) plus the reward model's score at the last token;
  3. reference    reference log-probs (when a KL term is on), the actor's own log-probs before the
     / old / values  update (the exact quantity the loss recomputes), the critic's values (GAE);
  4. advantages   sequence score at the last response token, minus the KL penalty per token, then
                  the configured estimator (GAE, GRPO, RLOO, ...);
  5. updates      ``ppo_epochs`` passes of the actor (clipped policy loss) and the critic (clipped
                  value loss) over the rollout in shuffled mini-batches of ``mini_batch_size``.

Each phase is timed. Metrics go to stdout, ``metrics.jsonl`` and TensorBoard; the actor is saved as
an HF checkpoint at the end.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, compute_advantages
from megatron_rlhf.algorithms.kl import (
    KL_ESTIMATORS,
    KLController,
    KLControllerConfig,
    apply_kl_penalty,
    build_kl_controller,
)
from megatron_rlhf.algorithms.losses import AGG_MODES
from megatron_rlhf.algorithms.utils import masked_mean
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.config.schema import RunConfig
from megatron_rlhf.config.validate import layout_errors, validate_roles
from megatron_rlhf.data import PromptDataset, SFTExample, epoch_batches, load_prompt_dataset, num_steps, pack_batch
from megatron_rlhf.data.builtin import resolve_data_paths
from megatron_rlhf.data.tokenizer import Tokenizer, resolve_tokenizer
from megatron_rlhf.engine.objectives import PPOLossConfig, critic_loss, logprobs_output, ppo_actor_loss, token_values_output, values_output
from megatron_rlhf.engine.optim import OptimConfig, TrainState, make_train_state
from megatron_rlhf.engine.schedule import Batch, LossFn
from megatron_rlhf.engine.train import forward_all_rows, train_step
from megatron_rlhf.hybrid.engine import HybridEngine
from megatron_rlhf.metrics.log import format_eta, log, timed
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builder import resolve_dtype
from megatron_rlhf.models.roles import RoleModel, build_role
from megatron_rlhf.models.sources import local_dir
from megatron_rlhf.parallel.distributed import DistEnv, seed_everything
from megatron_rlhf.rewards import RewardRule, Sample, resolve_rule, rule_scores
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.rollout.native import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams
from megatron_rlhf.trainer.common import MetricsSink, finish, on_problem_errors, with_token_ids, write_run_files

# --------------------------------------------------------------------------- config


@dataclasses.dataclass(kw_only=True)
class PromptDataConfig:
    train: list[str] = dataclasses.field(default_factory=list)
    """Prompt files (.jsonl/.parquet, or directories of them) or built-in sets (builtin:lowercase-prompts)."""
    prompt_key: str = "prompt"
    """Column of the prompt text (or pre-tokenized ``<key>_ids``)."""
    extra_keys: list[str] = dataclasses.field(default_factory=list)
    """Columns passed to reward rules with each sample (e.g. [answer])."""
    max_prompt_length: int = 256
    """Longest prompt in tokens; longer rows follow ``on_overlong``."""
    on_overlong: str = "error"
    """error: stop naming the file and row; skip: drop such rows and count them."""
    on_invalid: str = "error"
    """The same for rows with a bad value (null, empty, wrong type, token id out of range)."""
    add_bos: bool = False
    """Prepend the tokenizer's BOS id to every prompt."""


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    tp: int = 0
    """Tensor-parallel size of generation (0: the actor's); PP is collapsed, the rest of the world is DP."""
    n: int = 4
    """Responses sampled per prompt (a group, for GRPO-style estimators)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs are recomputed at it."""
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    max_batch_size: int = 256
    """KV-cache slots per generation group (sequences decoded together)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs on GPU."""


@dataclasses.dataclass(kw_only=True)
class ScoringConfig:
    """How a response's scalar reward is made: the sum of the reward model's score and every rule's."""

    use_reward_model: bool = True
    """Score with the reward model (``reward.path``); false: rules only, no reward model is built."""
    rules: list[str] = dataclasses.field(default_factory=list)
    """Rule names (exact_answer, lowercase_fraction) or import paths ``package.module:function``."""


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    advantage_estimator: str = "gae"
    """gae (needs the critic), grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    kl_penalty: KLControllerConfig = dataclasses.field(default_factory=lambda: KLControllerConfig(coef=0.0))
    """KL to the reference as a per-token reward penalty (coef 0: off; adaptive: Ziegler et al.)."""
    kl_penalty_estimator: str = "k1"
    loss: PPOLossConfig = dataclasses.field(default_factory=PPOLossConfig)
    """Actor and critic losses (clip ranges, entropy bonus, KL loss, aggregation)."""


@dataclasses.dataclass(kw_only=True)
class PPOConfig(RunConfig):
    """``megatron-rlhf ppo``: the four models of ``RunConfig`` plus data, rollout, scoring and algorithm."""

    output_dir: str = "runs/ppo"
    data: PromptDataConfig = dataclasses.field(default_factory=PromptDataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    scoring: ScoringConfig = dataclasses.field(default_factory=ScoringConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    actor_optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=5e-6))
    prompts_per_step: int = 16
    """Prompts per RL step (the rollout holds prompts_per_step x rollout.n sequences)."""
    mini_batch_size: int = 0
    """Sequences per optimizer step; 0: the whole rollout (one actor/critic step per epoch)."""
    ppo_epochs: int = 1
    """Passes over each rollout."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch in forward passes and updates."""
    num_epochs: int = 1
    """Passes over the prompts (used when max_steps is 0)."""
    max_steps: int = 0
    """If > 0: exactly this many RL steps."""
    log_every: int = 1
    """Print a progress line every this many steps (and at the first and last)."""
    samples_per_step: int = 4
    """Rollouts written to output_dir/samples.jsonl each step (prompt, response, reward); 0: none."""
    save_hf: bool = True
    """Write the trained actor to output_dir/hf as an HF checkpoint."""


@dataclasses.dataclass
class Needs:
    """Which of the optional models the configured algorithm uses."""

    critic: bool
    reference: bool
    reward: bool


def needs_of(cfg: PPOConfig) -> Needs:
    algo = cfg.algorithm
    return Needs(
        critic=algo.advantage_estimator == "gae",
        reference=algo.kl_penalty.coef > 0 or algo.loss.kl_loss_coef > 0,
        reward=cfg.scoring.use_reward_model,
    )


def check_ppo_config(cfg: PPOConfig, world_size: int) -> tuple[dict[str, Architecture], dict[str, RewardRule]]:
    """Every problem at once (``ConfigError``); returns the used models' architectures and the rules."""
    needs = needs_of(cfg)
    roles = ["actor"] + [r for r, used in (("critic", needs.critic), ("reference", needs.reference),
                                            ("reward", needs.reward)) if used]  # fmt: skip
    errors, archs = validate_roles(cfg, world_size, roles)
    algo, rollout, data = cfg.algorithm, cfg.rollout, cfg.data
    if algo.advantage_estimator not in ADVANTAGE_ESTIMATORS:
        errors.append(f"algorithm.advantage_estimator={algo.advantage_estimator!r} must be one of "
                      f"{list(ADVANTAGE_ESTIMATORS.names())}")  # fmt: skip
    elif algo.advantage_estimator != "gae" and rollout.n < 2:
        errors.append(f"rollout.n={rollout.n}: the {algo.advantage_estimator} estimator compares the samples of a "
                      "prompt with each other; it needs rollout.n >= 2")  # fmt: skip
    for key, name in (("kl_penalty_estimator", algo.kl_penalty_estimator), ("loss.kl_estimator", algo.loss.kl_estimator)):
        if name not in KL_ESTIMATORS:
            errors.append(f"algorithm.{key}={name!r} must be one of {list(KL_ESTIMATORS.names())}")
    if algo.loss.agg_mode not in AGG_MODES:
        errors.append(f"algorithm.loss.agg_mode={algo.loss.agg_mode!r} must be one of {list(AGG_MODES.names())}")
    try:
        build_kl_controller(algo.kl_penalty)
    except ValueError as err:
        errors.append(f"algorithm.kl_penalty: {err}")
    if not cfg.scoring.use_reward_model and not cfg.scoring.rules:
        errors.append("nothing scores the responses: set scoring.use_reward_model=true or give scoring.rules=[...]")
    rules: dict[str, RewardRule] = {}
    for name in cfg.scoring.rules:
        try:
            rules[name] = resolve_rule(name)
        except ValueError as err:
            errors.append(f"scoring.rules: {err}")
    if not data.train:
        errors.append("data.train is empty: give prompt files, e.g. data.train=[prompts.jsonl] (or builtin:lowercase-prompts)")
    errors += on_problem_errors(data)
    if not rollout.temperature > 0:
        errors.append(f"rollout.temperature={rollout.temperature} must be > 0: RL samples its responses")
    for name, value, low in (("rollout.n", rollout.n, 1), ("rollout.max_new_tokens", rollout.max_new_tokens, 1),
                             ("rollout.max_batch_size", rollout.max_batch_size, 1), ("data.max_prompt_length", data.max_prompt_length, 1),
                             ("prompts_per_step", cfg.prompts_per_step, 1), ("ppo_epochs", cfg.ppo_epochs, 1),
                             ("max_tokens_per_micro_batch", cfg.max_tokens_per_micro_batch, 1), ("num_epochs", cfg.num_epochs, 1),
                             ("log_every", cfg.log_every, 1), ("mini_batch_size", cfg.mini_batch_size, 0),
                             ("max_steps", cfg.max_steps, 0), ("rollout.tp", rollout.tp, 0),
                             ("samples_per_step", cfg.samples_per_step, 0)):  # fmt: skip
        if value < low:
            errors.append(f"{name}={value} must be >= {low}")
    if "actor" in archs:
        longest = data.max_prompt_length + rollout.max_new_tokens
        limit = archs["actor"].hf_config.get("max_position_embeddings")
        if limit is not None and longest > limit:
            errors.append(f"data.max_prompt_length + rollout.max_new_tokens = {longest} exceeds the actor's "
                          f"max_position_embeddings={limit}")  # fmt: skip
        vocab = archs["actor"].vocab_size
        errors += [f"{role}.path={cfg.role(role).path!r} has vocab_size={arch.vocab_size}, the actor's is {vocab}: "
                   "all models must read the same token ids" for role, arch in archs.items() if arch.vocab_size != vocab]  # fmt: skip
        generation_tp = rollout.tp or cfg.actor.tp
        errors += [f"{e} (generation layout of {cfg.actor.path})" for e in
                   layout_errors("rollout", generation_tp, 1, archs["actor"], world_size)]  # fmt: skip
        if not errors:
            errors += _batch_errors(cfg, world_size, roles)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return archs, rules


def _batch_errors(cfg: PPOConfig, world_size: int, roles: list[str]) -> list[str]:
    """Divisibility of the rollout and its mini-batches by each model's data-parallel size."""
    errors = []
    rows = cfg.prompts_per_step * cfg.rollout.n
    mini = cfg.mini_batch_size or rows
    if rows % mini:
        errors.append(f"mini_batch_size={mini} must divide the rollout's prompts_per_step x rollout.n = {rows} sequences")
    for role in roles:
        model = cfg.role(role)
        dp = world_size // (model.tp * model.pp)
        if rows % dp:
            errors.append(f"the rollout's {rows} sequences (prompts_per_step x rollout.n) must split evenly over "
                          f"the {role}'s dp={dp} data-parallel ranks")  # fmt: skip
        if role in ("actor", "critic") and mini % dp:
            errors.append(f"mini_batch_size={mini} must be divisible by the {role}'s dp={dp}")
    return errors


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass
class PPORun:
    """Everything a step uses, built once."""

    cfg: PPOConfig
    device: torch.device
    tokenizer: Tokenizer
    prompts: PromptDataset
    actor: TrainState
    critic: TrainState | None
    reference: RoleModel | None
    reward_model: RoleModel | None
    rules: dict[str, RewardRule]
    hybrid: HybridEngine
    kl_controller: KLController


def set_up_ppo(cfg: PPOConfig, env: DistEnv) -> PPORun:
    archs, rules = check_ppo_config(cfg, env.world_size)
    needs = needs_of(cfg)
    seed_everything(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)
    write_run_files(cfg, Path(cfg.output_dir))
    log(f"ppo: world {env.world_size} on {env.device.type}, dtype {str(dtype).removeprefix('torch.')}, "
        f"advantages {cfg.algorithm.advantage_estimator}, models: "
        + ", ".join(f"{role} {cfg.role(role).path} (tp {cfg.role(role).tp}, pp {cfg.role(role).pp})" for role in archs))  # fmt: skip
    tokenizer = resolve_tokenizer(local_dir(cfg.actor.path), archs["actor"], cfg.actor.path)
    data = cfg.data
    prompts, report = load_prompt_dataset(
        resolve_data_paths(data.train), tokenizer, max_length=data.max_prompt_length, on_overlong=data.on_overlong,
        on_invalid=data.on_invalid, prompt_key=data.prompt_key, extra_keys=data.extra_keys, add_bos=data.add_bos,
    )  # fmt: skip
    log(f"prompts: {report.summary()}")

    def build(role: str) -> RoleModel:
        with timed(f"{role}: build+load", env.device):
            return build_role(role, cfg.role(role), archs[role], world_size=env.world_size, dtype=dtype, device=env.device)

    actor = make_train_state(build("actor"), cfg.actor_optim)
    critic = make_train_state(build("critic"), cfg.critic_optim) if needs.critic else None
    reference = build("reference") if needs.reference else None
    reward_model = build("reward") if needs.reward else None
    rollout = cfg.rollout
    engine_cfg = NativeEngineConfig(
        max_batch_size=rollout.max_batch_size, max_seq_len=data.max_prompt_length + rollout.max_new_tokens,
        eos_token_ids=tuple(tokenizer.stop_ids), cuda_graphs=rollout.cuda_graphs,
    )  # fmt: skip
    hybrid = HybridEngine(actor, rollout.tp or cfg.actor.tp, engine_cfg)
    return PPORun(cfg, env.device, tokenizer, prompts, actor, critic, reference, reward_model, rules, hybrid,
                  build_kl_controller(cfg.algorithm.kl_penalty))  # fmt: skip


def run_ppo(cfg: PPOConfig, env: DistEnv) -> dict[str, Any]:
    """Train for the configured steps; returns a summary (first and last mean reward, timings)."""
    run = set_up_ppo(cfg, env)
    out_dir = Path(cfg.output_dir)
    per_epoch = num_steps(len(run.prompts), cfg.prompts_per_step, drop_last=True)
    if per_epoch == 0:
        raise ConfigError(f"data.train holds {len(run.prompts)} prompts, fewer than prompts_per_step={cfg.prompts_per_step}")
    total = cfg.max_steps or cfg.num_epochs * per_epoch
    log(f"ppo: {len(run.prompts)} prompts, {cfg.prompts_per_step} per step x {cfg.rollout.n} samples: "
        f"{per_epoch} steps per epoch, {total} steps")  # fmt: skip
    sink = MetricsSink(out_dir)
    summary: dict[str, Any] = {"steps": total}
    start = time.perf_counter()
    step = 0
    try:
        for epoch in range(-(-total // per_epoch)):
            for indices in epoch_batches(len(run.prompts), cfg.prompts_per_step, 0, 1, cfg.seed, epoch, True):
                if step == total:
                    break
                step += 1
                metrics, samples = ppo_step(run, step, indices)
                sink.write("train", step, {"epoch": epoch, **metrics})
                sink.write_rows("samples", [{"step": step, **sample} for sample in samples])
                summary.setdefault("first_reward_mean", metrics["reward/mean"])
                summary["last_reward_mean"] = metrics["reward/mean"]
                if step % cfg.log_every == 0 or step in (1, total):
                    eta = (time.perf_counter() - start) / step * (total - step)
                    log(_progress_line(step, total, metrics) + f" | eta {format_eta(eta)}")
    finally:
        sink.close()
    summary["train_seconds"] = time.perf_counter() - start
    finish(cfg, run.actor.role, with_token_ids(run.actor.role.arch, run.tokenizer), out_dir, summary)
    log(f"ppo done: mean reward {summary['first_reward_mean']:.4f} (step 1) -> {summary['last_reward_mean']:.4f} "
        f"(step {total}); {out_dir}")  # fmt: skip
    return summary


def ppo_step(run: PPORun, step: int, indices: list[int]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One RL step (see the module docstring); returns its metrics, identical on every rank, and
    the first ``samples_per_step`` rollouts as text with their reward."""
    cfg, algo, device = run.cfg, run.cfg.algorithm, run.device
    times: dict[str, float] = {}
    temperature = cfg.rollout.temperature

    with timed("rollout", device, times, quiet=True):
        params = SamplingParams(
            temperature=temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, n=cfg.rollout.n,
            max_new_tokens=cfg.rollout.max_new_tokens, seed=_step_seed(cfg, step),
        )  # fmt: skip
        completions, switch_reports = run.hybrid.generate([run.prompts[i].prompt_ids.tolist() for i in indices], params)
    batch = rollout_batch(completions, run.tokenizer.pad_id)
    mask = batch["response_mask"]

    with timed("rewards", device, times, quiet=True):
        scores, score_metrics = score_rollout(run, batch, completions, [run.prompts[i].extras for i in indices])

    ref_logprobs = values = None
    if run.reference is not None:
        with timed("reference log-probs", device, times, quiet=True):
            ref_logprobs = forward_all_rows(run.reference, batch, logprobs_output(run.reference, temperature=temperature),
                                            max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)  # fmt: skip
    with timed("old log-probs", device, times, quiet=True):
        old_logprobs = forward_all_rows(run.actor.role, batch, logprobs_output(run.actor.role, temperature=temperature),
                                        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)  # fmt: skip
    if run.critic is not None:
        with timed("values", device, times, quiet=True):
            values = forward_all_rows(run.critic.role, batch, token_values_output(),
                                      max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)  # fmt: skip

    with timed("advantages", device, times, quiet=True):
        token_rewards = torch.zeros_like(old_logprobs)
        token_rewards[torch.arange(len(scores)), batch["lengths"] - 1] = scores
        kl = None
        if ref_logprobs is not None:
            kl = torch.where(mask, KL_ESTIMATORS.get(algo.kl_penalty_estimator)(old_logprobs, ref_logprobs), 0.0)
            if algo.kl_penalty.coef > 0:
                token_rewards = apply_kl_penalty(token_rewards, kl, run.kl_controller.value, mask)
        advantages, returns = compute_advantages(
            algo.advantage_estimator, token_rewards=token_rewards, response_mask=mask, values=values,
            group_index=batch["prompt_index"], config=algo.advantage,
        )  # fmt: skip

    with timed("actor update", device, times, quiet=True):
        actor_batch = {**_model_inputs(batch), "old_logprobs": old_logprobs, "advantages": advantages}
        if ref_logprobs is not None:
            actor_batch["ref_logprobs"] = ref_logprobs
        actor_metrics = update(run, run.actor, actor_batch, ppo_actor_loss(run.actor.role, algo.loss, temperature=temperature), step)
    critic_metrics: dict[str, float] = {}
    if run.critic is not None:
        with timed("critic update", device, times, quiet=True):
            critic_batch = {**_model_inputs(batch), "old_values": values, "returns": returns}
            critic_metrics = update(run, run.critic, critic_batch, critic_loss(algo.loss), step)

    kl_per_sequence = float(kl.sum(1).mean()) if kl is not None else 0.0  # kl is 0 off the response
    kl_coef = run.kl_controller.value
    if kl is not None:
        run.kl_controller.update(kl_per_sequence, n_steps=len(scores))
    lengths = mask.sum(1).float()
    rollout_logprobs = _rollout_logprobs(completions, mask)
    metrics = {
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        **score_metrics,
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/stopped_fraction": sum(c.finish_reason == "stop" for c in completions) / len(completions),
        "kl/per_sequence": kl_per_sequence, "kl/coef": kl_coef,
        "advantages/mean": float(masked_mean(advantages, mask)), "returns/mean": float(masked_mean(returns, mask)),
        # The engine's sampling log-probs against the trainer's recomputation: 0 up to numerics.
        "rollout/logprob_max_abs_diff": float(((rollout_logprobs - old_logprobs).abs() * mask).max()),
        **_prefixed("actor/", actor_metrics), **_prefixed("critic/", critic_metrics),
        **{f"time/{phase}": seconds for phase, seconds in times.items()},
        **{f"time/rollout: {r.phase}": r.seconds for r in switch_reports},
        "throughput/generated_tokens_per_s": float(lengths.sum()) / max(times["rollout"], 1e-9),
    }  # fmt: skip
    if values is not None:
        metrics["values/mean"] = float(masked_mean(values, mask))
    decode = run.tokenizer.decode
    samples = [{"prompt": decode(c.prompt_ids), "response": decode(c.token_ids), "finish_reason": c.finish_reason,
                "reward": float(score)} for c, score in zip(completions[: cfg.samples_per_step], scores)]  # fmt: skip
    return metrics, samples


# --------------------------------------------------------------------------- step helpers


def _step_seed(cfg: PPOConfig, step: int) -> int:
    """The seed of a step's sampling and mini-batch shuffle: distinct per (seed, step)."""
    return cfg.seed * 100_003 + step


def rollout_batch(completions: list[Completion], pad_id: int) -> Batch:
    """Completions -> right-padded rows ``prompt + response``: input_ids, attention_mask, lengths,
    response_mask (True on response tokens) and prompt_index (the group of each row)."""
    examples = [SFTExample(input_ids=torch.tensor(c.prompt_ids + c.token_ids),
                           loss_mask=torch.tensor([False] * len(c.prompt_ids) + [True] * len(c.token_ids)))
                for c in completions]  # fmt: skip
    batch = pack_batch(examples, pad_id)
    batch["response_mask"] = batch.pop("loss_mask")
    batch["prompt_index"] = torch.tensor([c.prompt_index for c in completions])
    return batch


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    """``train_step``'s own metrics (loss, grad_norm, lr) under the model's prefix; the loss
    function's carry it already."""
    return {name if name.startswith(prefix) else prefix + name: value for name, value in metrics.items()}


def _model_inputs(batch: Batch) -> Batch:
    return {key: batch[key] for key in ("input_ids", "attention_mask", "response_mask")}


def score_rollout(run: PPORun, batch: Batch, completions: list[Completion], extras: list[dict[str, Any]]
                  ) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """(B,) sequence rewards: the reward model's score at each row's last token plus every rule's
    score; and the mean of each part. Rules run on a 1/world share of the samples per rank."""
    parts: dict[str, torch.Tensor] = {}
    if run.reward_model is not None:
        scores = forward_all_rows(run.reward_model, {k: batch[k] for k in ("input_ids", "attention_mask")}, values_output(),
                                  max_tokens_per_micro_batch=run.cfg.max_tokens_per_micro_batch)  # fmt: skip
        parts["reward_model"] = scores[torch.arange(len(completions)), batch["lengths"] - 1]
    if run.rules:
        rank, world = dist.get_rank(), dist.get_world_size()
        decode = run.tokenizer.decode
        mine = [Sample(c.prompt_ids, c.token_ids, decode(c.prompt_ids), decode(c.token_ids), c.finish_reason,
                       extras[c.prompt_index]) for c in completions[rank::world]]  # fmt: skip
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rule_scores(run.rules, mine))
        for name in run.rules:
            column = torch.empty(len(completions))
            for r, part in enumerate(gathered):
                column[r::world] = torch.tensor(part[name])
            parts[f"rule/{name}"] = column
    total = torch.stack(list(parts.values())).sum(0)
    return total, {f"reward/{name}": float(value.mean()) for name, value in parts.items()}


def _rollout_logprobs(completions: list[Completion], mask: torch.Tensor) -> torch.Tensor:
    """The engine's per-token log-probs in the batch's token-aligned layout."""
    out = torch.zeros(mask.shape)
    for row, c in enumerate(completions):
        start = len(c.prompt_ids)
        out[row, start : start + len(c.logprobs)] = torch.tensor(c.logprobs)
    return out


def update(run: PPORun, state: TrainState, batch: Batch, loss_fn: LossFn, step: int) -> dict[str, float]:
    """``ppo_epochs`` passes over the rollout in shuffled mini-batches, one optimizer step each;
    this rank trains on its DP share of every mini-batch. Returns the metrics averaged over steps."""
    cfg = run.cfg
    rows = batch["input_ids"].shape[0]
    mini = cfg.mini_batch_size or rows
    groups = state.role.groups
    dp, dp_rank = groups.layout.dp, groups.dp_rank
    share = mini // dp
    generator = torch.Generator().manual_seed(_step_seed(cfg, step))
    totals: dict[str, float] = {}
    count = 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(rows, generator=generator)
        for start in range(0, rows, mini):
            local = order[start + dp_rank * share : start + (dp_rank + 1) * share]
            metrics = train_step(state, {k: v[local] for k, v in batch.items()}, loss_fn,
                                 max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)  # fmt: skip
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value
            count += 1
    return {name: value / count for name, value in totals.items()}


def _progress_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step}/{total}", f"reward {m['reward/mean']:.4f}", f"len {m['response/length_mean']:.1f}",
             f"actor loss {m['actor/loss']:.4f}"]  # fmt: skip
    if "critic/loss" in m:
        parts.append(f"critic loss {m['critic/loss']:.4f}")
    if m["kl/per_sequence"]:
        parts.append(f"kl {m['kl/per_sequence']:.4f}")
    # The step's phases in the order they ran (the rollout's own sub-phases, "rollout: ...", left out).
    phases = [key.removeprefix("time/") for key in m if key.startswith("time/") and ":" not in key]
    parts.append("time " + " ".join(f"{p.split()[0]} {m[f'time/{p}']:.2f}s" for p in phases))
    parts.append(f"{m['throughput/generated_tokens_per_s']:,.0f} gen tok/s")
    return " | ".join(parts)
