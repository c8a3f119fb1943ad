"""``megatron-rlhf ppo``: RL from prompts (PPO with a critic, or GRPO-style group baselines).

One SPMD program: every rank holds its shards of the models the algorithm needs, each in its own
layout. One step, on every rank, top to bottom in ``ppo_step``:

  1. rollout      the hybrid engine frees the actor's training memory, builds the generation
                  weights (zero copy, or resharded), samples ``rollout.sampling.n`` responses per prompt
                  and restores training memory; every rank gets every completion;
  2. rewards      rule functions (split over ranks) plus the reward model's score at the last token;
  3. reference    reference log-probs (when a KL term is on), the actor's own log-probs before the
     / old / values  update (the exact quantity the loss recomputes), the critic's values (GAE);
  4. advantages   sequence score at the last response token, minus the KL penalty per token, then
                  the configured estimator (GAE, GRPO, RLOO, ...);
  5. updates      ``ppo_epochs`` passes of the actor (clipped policy loss) and the critic (clipped
                  value loss) over the rollout in shuffled mini-batches of ``mini_batch_size``.

Each phase is timed. The loop around it (``trainer/loop.py``) writes the metrics to stdout,
``metrics.jsonl`` and TensorBoard and saves the actor as an HF checkpoint at the end; the settings
and their checks are in ``trainer/ppo_config.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.algorithms.advantages import compute_advantages
from megatron_rlhf.algorithms.kl import KL_ESTIMATORS, KLController, apply_kl_penalty, build_kl_controller
from megatron_rlhf.algorithms.utils import masked_mean
from megatron_rlhf.checkpoint.sources import build_role, local_dir
from megatron_rlhf.config.run import resolve_dtype
from megatron_rlhf.data import PromptDataset, SFTExample, load_prompt_dataset, pack_batch
from megatron_rlhf.data.builtin import resolve_data_paths
from megatron_rlhf.data.tokenizer import Tokenizer, resolve_tokenizer
from megatron_rlhf.engine.objectives import critic_loss, logprobs_output, ppo_actor_loss, token_values_output, values_output
from megatron_rlhf.engine.optim import TrainState, make_train_state
from megatron_rlhf.engine.schedule import Batch, LossFn
from megatron_rlhf.engine.train import forward_all_rows, train_step
from megatron_rlhf.hybrid.engine import HybridEngine
from megatron_rlhf.metrics.log import log, timed
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.parallel.distributed import DistEnv, seed_everything
from megatron_rlhf.rewards import RewardRule, Sample, rule_scores
from megatron_rlhf.rollout.engine import Completion
from megatron_rlhf.trainer.loop import StepRows, run_loop, write_run_files
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config

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
    seed_everything(cfg.seed)
    dtype = resolve_dtype(cfg.dtype, env.device)
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
    write_run_files(cfg, Path(cfg.output_dir))  # after the data: a run that fails on its data leaves none

    def build(role: str) -> RoleModel:
        with timed(f"{role}: build+load", env.device):
            return build_role(role, cfg.role(role), archs[role], world_size=env.world_size, dtype=dtype, device=env.device)

    actor = make_train_state(build("actor"), cfg.actor_optim)
    critic = make_train_state(build("critic"), cfg.critic_optim) if "critic" in archs else None
    reference = build("reference") if "reference" in archs else None
    reward_model = build("reward") if "reward" in archs else None
    # The engine never holds more than a rollout's longest sequence, and stops on the tokenizer's EOS
    # ids unless the config names its own.
    rollout = cfg.rollout
    longest = data.max_prompt_length + rollout.sampling.max_new_tokens
    engine_cfg = dataclasses.replace(rollout.engine.with_eos_of(tokenizer.stop_ids),
                                     max_seq_len=min(rollout.engine.max_seq_len, longest))  # fmt: skip
    hybrid = HybridEngine(actor, rollout.tp or cfg.actor.tp, engine_cfg)
    return PPORun(cfg, env.device, tokenizer, prompts, actor, critic, reference, reward_model, rules, hybrid,
                  build_kl_controller(cfg.algorithm.kl_penalty))  # fmt: skip


@dataclasses.dataclass
class PPOTask:
    """The loop's ``Task`` for RL: each step is ``ppo_step`` on the step's prompts."""

    run: PPORun
    name: str = "ppo"
    headline: tuple[str, str] = ("reward/mean", "mean reward")
    evaluate: None = None
    eval_every: int = 0

    @property
    def num_examples(self) -> int:
        return len(self.run.prompts)

    @property
    def batch_size(self) -> int:
        return self.run.cfg.prompts_per_step

    @property
    def batch_description(self) -> str:
        return f"prompts, {self.batch_size} per step x {self.run.cfg.rollout.sampling.n} samples"

    @property
    def export_role(self) -> RoleModel:
        return self.run.actor.role

    @property
    def tokenizer(self) -> Tokenizer:
        return self.run.tokenizer

    def step(self, step: int, epoch: int, indices: list[int]) -> tuple[dict[str, float], StepRows]:
        metrics, samples = ppo_step(self.run, step, indices)
        return metrics, {"samples": samples}

    def progress(self, metrics: dict[str, float]) -> str:
        return _progress_line(metrics)


def run_ppo(cfg: PPOConfig, env: DistEnv) -> dict[str, Any]:
    """Train for the configured steps; returns a summary (first and last mean reward, timings)."""
    return run_loop(cfg, PPOTask(set_up_ppo(cfg, env)))


def ppo_step(run: PPORun, step: int, indices: list[int]) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One RL step (see the module docstring); returns its metrics, identical on every rank, and
    the first ``samples_per_step`` rollouts as text with their reward."""
    cfg, algo, device = run.cfg, run.cfg.algorithm, run.device
    times: dict[str, float] = {}
    temperature = cfg.rollout.sampling.temperature

    with timed("rollout", device, times, quiet=True):
        params = dataclasses.replace(cfg.rollout.sampling, seed=_step_seed(cfg, step))
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
    """The seed of a step's sampling and mini-batch shuffle: distinct per (seed, step), offset by
    ``rollout.sampling.seed``."""
    return cfg.seed * 100_003 + step + cfg.rollout.sampling.seed


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


def _progress_line(m: dict[str, float]) -> str:
    parts = [f"reward {m['reward/mean']:.4f}", f"len {m['response/length_mean']:.1f}",
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
