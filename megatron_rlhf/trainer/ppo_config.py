"""``megatron-rlhf ppo``'s configuration and its up-front checks.

The run's settings are the four models of ``ModelsConfig``, the loop's (``LoopConfig``), and the
sections below; sampling and engine settings are the rollout's own dataclasses, held as
``rollout.sampling`` and ``rollout.engine``. ``check_ppo_config`` reports every problem at once:
each dataclass's own field checks plus the rules that span sections (layouts against the models,
batch divisibility by each model's data-parallel size, lengths against the model's positions, a
reference that follows the actor against the actor).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rlhf.agent.config import MultiTurnConfig
from megatron_rlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig
from megatron_rlhf.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS, KLControllerConfig
from megatron_rlhf.algorithms.losses import AGG_MODES
from megatron_rlhf.checkpoint.sources import ModelsConfig, role_errors
from megatron_rlhf.config.fields import at_least
from megatron_rlhf.config.loader import config_errors, raise_if_errors
from megatron_rlhf.data.builtin import data_path_errors
from megatron_rlhf.data.config import ChatDataConfig
from megatron_rlhf.hybrid.config import HybridConfig, ReferenceConfig
from megatron_rlhf.models.architecture import Architecture, matching_vocab_pad_multiple, padded_vocab_size
from megatron_rlhf.parallel.layout import Layout, layout_errors
from megatron_rlhf.rewards.config import ScoringConfig, scoring_errors
from megatron_rlhf.rewards.custom import CustomRewardFunction
from megatron_rlhf.rewards.rules import RewardRule
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams, stop_ids_errors
from megatron_rlhf.trainer.health import SIGNALS, Signal
from megatron_rlhf.trainer.loop_config import LoopConfig, eval_every_errors
from megatron_rlhf.training.config import OptimConfig, PPOLossConfig


@dataclasses.dataclass(kw_only=True)
class PromptDataConfig(ChatDataConfig):
    """RL prompts (``train`` may also name built-in sets, e.g. builtin:lowercase-prompts)."""

    validation: list[str] = dataclasses.field(default_factory=list)
    """Validation prompts, same formats (e.g. [builtin:arithmetic-test]); empty: no validation."""
    extra_keys: list[str] = dataclasses.field(default_factory=list)
    """Columns passed to reward rules with each sample (e.g. [answer]); a row whose value is null or
    blank is invalid (``on_invalid``)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer rows follow ``on_overlong``."""

    def errors(self) -> list[str]:
        return super().errors() + at_least(self, 1, "max_prompt_length")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """Generation in the hybrid engine: its layout, how to sample, and the engine's settings."""

    tp: int = 0
    """Tensor-parallel size of generation (0: the actor's); PP is collapsed, the rest of the world is DP."""
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    """How responses are sampled (n per prompt, temperature, top-k/top-p, max_new_tokens, stops)."""
    engine: NativeEngineConfig = dataclasses.field(default_factory=NativeEngineConfig)
    """The native engine: KV-cache slots, CUDA graphs."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop groups whose raw scores all match (no signal for a group-relative
    advantage) and sample more prompts until the batch is full."""
    max_sample_batches: int = 4
    """With filter_groups: at most this many sample batches per step (0: no limit); a batch still
    short is filled with dropped groups and the shortfall reported."""
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls: the tools, the call format, the limits of a trajectory."""

    def errors(self) -> list[str]:
        return at_least(self, 0, "tp", "max_sample_batches")


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    advantage_estimator: str = "gae"
    """gae (needs the critic), grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline."""
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    kl_penalty: KLControllerConfig = dataclasses.field(default_factory=lambda: KLControllerConfig(coef=0.0))
    """KL to the reference as a per-token reward penalty (coef 0: off; adaptive: Ziegler et al.)."""
    kl_penalty_estimator: str = "k1"
    """KL estimator of the reward penalty."""
    loss: PPOLossConfig = dataclasses.field(default_factory=PPOLossConfig)
    """Actor and critic losses (clip ranges, entropy bonus, KL loss, aggregation)."""
    recompute_old_logprobs: Literal["auto", "always"] = "auto"
    """The actor's log-probs before its update (the PPO ratio's denominator): always, a forward pass
    of their own (timing_s/old_log_prob); auto, that pass only where the update's own forward cannot
    supply them, i.e. unless the rollout feeds exactly one optimizer step (ppo_epochs=1, one
    mini-batch) with no KL penalty in the reward (it reads them before the advantages). Printed at
    start-up."""

    def errors(self) -> list[str]:
        errors = ADVANTAGE_ESTIMATORS.field_errors("advantage_estimator", self.advantage_estimator)
        return errors + KL_ESTIMATORS.field_errors("kl_penalty_estimator", self.kl_penalty_estimator)


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    """Validation of the policy on ``data.validation``: a greedy response per prompt, and optionally
    ``n`` samples at ``temperature`` for pass@n, all scored as in training (raw score)."""

    n: int = 0
    """Samples per prompt for pass@n and the sampled mean reward; 0: greedy only."""
    temperature: float = 1.0
    """Sampling temperature of those samples."""
    correct_score: float = 1.0
    """A response counts as correct when its score reaches this (1.0: a 0/1 rule's right answer)."""
    judged_by: str = ""
    """The scoring part whose own (unweighted) score decides correctness: a rule's name,
    reward_model or custom_function; empty: the raw score (all parts, weighted). Name the rule when
    a reward model's score is mixed in: accuracy should not move with the reward model."""
    samples: int = 4
    """Validation responses written to samples.jsonl (split validation) at each evaluation."""

    def errors(self) -> list[str]:
        errors = at_least(self, 0, "n", "samples")
        return errors + ([f"temperature={self.temperature} must be > 0"] if not self.temperature > 0 else [])

    @property
    def figures(self) -> list[str]:
        """The figures an evaluation reports (``ppo.validate``; each also per data_source)."""
        return ["greedy_accuracy", "greedy_reward"] + (["sampled_reward", f"pass_at_{self.n}"] if self.n else [])


@dataclasses.dataclass(kw_only=True)
class PPOConfig(LoopConfig, ModelsConfig):
    """``megatron-rlhf ppo``: the four models, the loop, and data, rollout, scoring and algorithm."""

    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
    """The reference model, and whether it follows the actor (``update``)."""
    data: PromptDataConfig = dataclasses.field(default_factory=PromptDataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    hybrid: HybridConfig = dataclasses.field(default_factory=HybridConfig)
    scoring: ScoringConfig = dataclasses.field(default_factory=ScoringConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    actor_optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    prompts_per_step: int = 16
    """Prompts per RL step (the rollout holds prompts_per_step x rollout.sampling.n sequences)."""
    mini_batch_size: int = 0
    """Sequences per optimizer step; 0: the whole rollout (one actor/critic step per epoch)."""
    ppo_epochs: int = 1
    """Passes over each rollout."""
    samples_per_step: int = 4
    """Rollouts written to output_dir/samples.jsonl each step (prompt, response, reward); 0: none."""
    samples_token_ids: bool = False
    """Also write each of those rollouts' response token ids (``response_ids``: every token sampled,
    a final stop token included), for debugging what a tokenizer made of them."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    eval_every: int = 0
    """With data.validation: evaluate every this many steps (and always at the end)."""
    eval_before_train: bool = True
    """With data.validation: also evaluate before the first step (logged as step 0)."""
    warmup: Literal["auto", "always", "never"] = "auto"
    """Run every phase of a step once at start-up, keeping nothing (``trainer/ppo.py::warm_up``), so
    that kernel compilation, decode-graph capture and allocator growth are paid before step 1:
    auto (on a GPU), always, never."""

    def errors(self) -> list[str]:
        return (
            super().errors()
            + at_least(self, 1, "prompts_per_step", "ppo_epochs")
            + at_least(self, 0, "mini_batch_size", "samples_per_step", "eval_every")
        )

    def optimizers(self) -> dict[str, OptimConfig]:
        return {"actor_optim": self.actor_optim} | (
            {"critic_optim": self.critic_optim} if "critic" in models_used(self) else {}
        )

    def optimizer_steps_per_step(self) -> int:
        rows = self.prompts_per_step * self.rollout.sampling.n
        return self.ppo_epochs * -(-rows // (self.mini_batch_size or rows))  # trainer/ppo.py::update

    def without_effect(self) -> dict[str, str]:
        unread = super().without_effect()
        algo, roles = self.algorithm, models_used(self)
        no_model = {
            "critic": f"algorithm.advantage_estimator={algo.advantage_estimator!r} uses no critic",
            "reference": "algorithm.kl_penalty.coef and algorithm.loss.kl_loss_coef are 0: no reference is built",
            "reward": "scoring.use_reward_model=false: no reward model is built",
        }
        unread |= {role: why for role, why in no_model.items() if role not in roles}
        if "critic" not in roles:
            unread["critic_optim"] = unread["algorithm.loss.value_clip"] = no_model["critic"]
        if algo.advantage_estimator in ADVANTAGE_ESTIMATORS:
            reads = ADVANTAGE_ESTIMATORS.info(algo.advantage_estimator).reads
            if reads is not None:
                unread |= {
                    f"algorithm.advantage.{field.name}": f"the {algo.advantage_estimator} estimator does not read it"
                    for field in dataclasses.fields(algo.advantage)
                    if field.name not in reads
                }
        if not AGG_MODES.info(algo.loss.agg_mode).scale_factor:
            unread["algorithm.loss.loss_scale_factor"] = (
                f"algorithm.loss.agg_mode={algo.loss.agg_mode!r} does not read it"
            )
        if algo.loss.kl_loss_coef == 0:
            unread["algorithm.loss.kl_estimator"] = "algorithm.loss.kl_loss_coef=0: no KL loss"
        penalty = algo.kl_penalty
        settings = {field.name for field in dataclasses.fields(penalty)} - {"coef"}
        if penalty.coef == 0:  # the coef is the switch: all else of the penalty
            unread |= dict.fromkeys(
                (f"algorithm.kl_penalty.{name}" for name in settings), "algorithm.kl_penalty.coef=0: no KL penalty"
            )
        else:
            unread |= {
                f"algorithm.kl_penalty.{name}": f"algorithm.kl_penalty.type={penalty.type!r} does not read it"
                for name in settings - {"type"} - KL_CONTROLLERS.info(penalty.type)
            }
        if "reference" not in roles:  # with a reference, it measures the logged KL (and health.max_kl's)
            unread["algorithm.kl_penalty_estimator"] = no_model["reference"]
        if not self.rollout.filter_groups:
            unread["rollout.max_sample_batches"] = "rollout.filter_groups=false"
        if not self.data.validation:
            unread["eval"] = unread["eval_before_train"] = "data.validation is empty: no evaluation"
        if self.scoring.overlong.buffer == 0:
            unread["scoring.overlong.penalty"] = "scoring.overlong.buffer=0 turns the over-long penalty off"
        if not self.scoring.custom_function.path:
            unread["scoring.custom_function.name"] = "scoring.custom_function.path is empty: no custom function"
        reference = self.reference
        if reference.update != "periodic":
            unread["reference.update_every"] = f"reference.update={reference.update!r}: only periodic reads it"
        if reference.update != "ema":
            unread["reference.ema_decay"] = f"reference.update={reference.update!r}: only ema reads it"
        return unread

    @property
    def longest_sequence(self) -> int:
        """Tokens of a rollout's longest sequence: the longest prompt and the longest response."""
        return self.data.max_prompt_length + self.rollout.sampling.max_new_tokens


def models_used(cfg: PPOConfig) -> list[str]:
    """The roles the configured algorithm uses (the actor always; others as the algorithm needs)."""
    algo = cfg.algorithm
    estimator = algo.advantage_estimator
    critic = estimator in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.info(estimator).critic
    reference = algo.kl_penalty.coef > 0 or algo.loss.kl_loss_coef > 0
    return ["actor"] + [
        role
        for role, used in (("critic", critic), ("reference", reference), ("reward", cfg.scoring.use_reward_model))
        if used
    ]


def old_logprob_pass(cfg: PPOConfig) -> tuple[bool, str]:
    """Whether a step runs the actor's log-probs before the update as a pass of their own, and why.

    Skipped only where it is provably redundant: a rollout that feeds exactly one optimizer step
    (one epoch, one mini-batch; the weights do not change between its micro-batches) is trained by
    the policy that would recompute them, so the update's forward computes the same quantity, and
    nothing reads them before the update (a KL penalty in the reward does, for the advantages).
    """
    rows = cfg.prompts_per_step * cfg.rollout.sampling.n
    why_not = [
        reason
        for reason, holds in (
            (f"ppo_epochs={cfg.ppo_epochs}", cfg.ppo_epochs > 1),
            (f"mini_batch_size={cfg.mini_batch_size} < {rows} rollout sequences", 0 < cfg.mini_batch_size < rows),
            (
                f"algorithm.kl_penalty.coef={cfg.algorithm.kl_penalty.coef} reads them before the advantages",
                cfg.algorithm.kl_penalty.coef > 0,
            ),
            ("algorithm.recompute_old_logprobs=always", cfg.algorithm.recompute_old_logprobs == "always"),
        )
        if holds
    ]
    if why_not:
        return True, "old log-probs: a forward pass of their own (" + "; ".join(why_not) + ")"
    return False, (
        "old log-probs: no pass of their own; one optimizer step per rollout, so the update's forward "
        "supplies them (algorithm.recompute_old_logprobs=auto)"
    )


def _scoring_limit_errors(cfg: PPOConfig, world_size: int) -> list[str]:
    """Scoring's and the tools' limits against the run's: the over-long ramp within a response, and
    the timeout of a rule's, the custom function's or a tool's call within the collectives' (where
    other ranks wait)."""
    errors = []
    buffer, longest = cfg.scoring.overlong.buffer, cfg.rollout.sampling.max_new_tokens
    if buffer >= longest:
        errors.append(
            f"scoring.overlong.buffer={buffer} must be below rollout.sampling.max_new_tokens={longest}: the "
            f"penalty starts {buffer} tokens before the longest response, so every response would be penalised"
        )
    timeout, calls = cfg.scoring.timeout_s, cfg.scoring.rules or cfg.scoring.custom_function.path
    if calls and world_size > 1 and timeout >= cfg.dist_timeout_s:
        errors.append(
            f"scoring.timeout_s={timeout} must be below dist_timeout_s={cfg.dist_timeout_s}: the other ranks "
            "wait that long for a rank's scores, and would time out first, without naming the reward call"
        )
    multi_turn = cfg.rollout.multi_turn
    if multi_turn.enable and world_size > 1 and multi_turn.tool_timeout_s >= cfg.dist_timeout_s:
        errors.append(
            f"rollout.multi_turn.tool_timeout_s={multi_turn.tool_timeout_s} must be below dist_timeout_s="
            f"{cfg.dist_timeout_s}: the other ranks wait that long for this rank's rollouts, and would time "
            "out first, without naming the tool"
        )
    return errors


@dataclasses.dataclass
class CheckedConfig:
    """What checking loaded: the used models' architectures, the rules and the reward function."""

    archs: dict[str, Architecture]
    rules: dict[str, RewardRule]
    function: CustomRewardFunction | None


def check_ppo_config(cfg: PPOConfig, world_size: int) -> CheckedConfig:
    """Every problem at once (``ConfigError``); returns what the checks loaded."""
    roles = models_used(cfg)
    unused = [role for role in ("critic", "reference", "reward") if role not in roles]
    errors = config_errors(cfg, unused=unused + (["critic_optim"] if "critic" not in roles else []))
    errors += cfg.output_dir_errors()
    found, archs = role_errors(cfg, roles, world_size)
    errors += found + _reference_update_errors(cfg, roles, archs) + _lora_errors(cfg, roles)
    algo, rollout, data, sampling = cfg.algorithm, cfg.rollout, cfg.data, cfg.rollout.sampling
    if (
        algo.advantage_estimator in ADVANTAGE_ESTIMATORS
        and ADVANTAGE_ESTIMATORS.info(algo.advantage_estimator).groups
        and sampling.n < 2
    ):
        errors.append(
            f"rollout.sampling.n={sampling.n}: the {algo.advantage_estimator} estimator compares the "
            "samples of a prompt with each other; it needs rollout.sampling.n >= 2"
        )
    if rollout.filter_groups and sampling.n < 2:
        errors.append(
            f"rollout.filter_groups compares the samples of a prompt: it needs rollout.sampling.n >= 2 "
            f"(got {sampling.n})"
        )
    found, rules, function = scoring_errors(cfg.scoring)
    errors += found + _scoring_limit_errors(cfg, world_size)
    if cfg.eval.judged_by and cfg.eval.judged_by not in cfg.scoring.parts():
        errors.append(
            f"eval.judged_by={cfg.eval.judged_by!r} is not a scoring part; the parts are {cfg.scoring.parts()}"
        )
    if not data.train:
        errors.append(
            "data.train is empty: give prompt files, e.g. data.train=[prompts.jsonl] (or builtin:lowercase-prompts)"
        )
    errors += data_path_errors("data.train", data.train) + data_path_errors("data.validation", data.validation)
    errors += cfg.health.validation_errors(data.validation, cfg.eval_every, cfg.eval.figures, per_source=True)
    errors += cfg.health.reach_errors(*_watched(cfg, roles))
    errors += _length_watch_errors(cfg)
    if "critic" not in roles and cfg.critic.lora.rank > 0:
        errors.append(
            f"critic.lora.rank={cfg.critic.lora.rank}: this run builds no critic "
            f"(algorithm.advantage_estimator={algo.advantage_estimator!r}); remove the critic's LoRA settings"
        )
    errors += eval_every_errors(cfg.eval_every, data.validation)
    errors += rollout.multi_turn.offered_tools_errors(data.tools_file)
    if not sampling.temperature > 0:
        errors.append(f"rollout.sampling.temperature={sampling.temperature} must be > 0: RL samples its responses")
    longest = cfg.longest_sequence
    errors += cfg.length_errors(longest, "data.max_prompt_length + rollout.sampling.max_new_tokens")
    if rollout.engine.max_seq_len < longest:
        errors.append(
            f"rollout.engine.max_seq_len={rollout.engine.max_seq_len} is shorter than data.max_prompt_length "
            f"+ rollout.sampling.max_new_tokens = {longest}"
        )
    if "actor" in archs:
        limit = archs["actor"].hf_config.get("max_position_embeddings")
        if limit is not None and longest > limit:
            errors.append(
                f"data.max_prompt_length + rollout.sampling.max_new_tokens = {longest} exceeds the actor's "
                f"max_position_embeddings={limit}: lower one of them"
            )
        vocab = archs["actor"].vocab_size
        errors += [
            f"{role}.path={cfg.role(role).path!r} has vocab_size={arch.vocab_size}, the actor's is {vocab}: "
            "all models must read the same token ids"
            for role, arch in archs.items()
            if arch.vocab_size != vocab
        ]
        errors += stop_ids_errors(sampling.stop_token_ids, rollout.engine.eos_token_ids, vocab, "the actor's")
        errors += [
            f"{e} (generation layout of {cfg.actor.path})"
            for e in layout_errors("rollout", rollout.tp or cfg.actor.tp, 1, archs["actor"], world_size, pipeline=False)
        ]
        if not errors:
            errors += _batch_errors(cfg, world_size, roles)
    raise_if_errors(errors)
    return CheckedConfig(archs, rules, function)


def _watched(cfg: PPOConfig, roles: list[str]) -> tuple[list[Signal], list[str]]:
    """The health signals a step of this run can fire, and its phases (``ppo_step``'s, those of the
    models and passes it has). No KL without a reference, and no uniform groups of one sample."""
    signals = [
        s
        for s in SIGNALS
        if (s != "kl_blowup" or "reference" in roles) and (s != "uniform_groups" or cfg.rollout.sampling.n > 1)
    ]
    phases = ["gen", "reward", "adv", "update_actor"]
    phases += ["ref"] if "reference" in roles else []
    phases += ["old_log_prob"] if old_logprob_pass(cfg)[0] else []
    phases += ["values", "update_critic"] if "critic" in roles else []
    phases += ["update_ref"] if cfg.reference.update != "none" else []
    return signals, phases


def _length_watch_errors(cfg: PPOConfig) -> list[str]:
    """Response-length signals that every step would fire, or none could: a response is at most
    ``rollout.sampling.max_new_tokens`` long."""
    longest, health = cfg.rollout.sampling.max_new_tokens, cfg.health
    errors = []
    if health.min_response_length >= longest:
        errors.append(
            f"health.min_response_length={health.min_response_length} is not below rollout.sampling.max_new_tokens="
            f"{longest}: every step would fire length_collapse"
        )
    if health.max_response_length >= longest:
        errors.append(
            f"health.max_response_length={health.max_response_length} is not below rollout.sampling.max_new_tokens="
            f"{longest}: length_blowup could never fire"
        )
    return errors


def _batch_errors(cfg: PPOConfig, world_size: int, roles: list[str]) -> list[str]:
    """Divisibility of the rollout and its mini-batches by each model's data-parallel size."""
    errors = []
    rows = cfg.prompts_per_step * cfg.rollout.sampling.n
    mini = cfg.mini_batch_size or rows
    if rows % mini:
        errors.append(
            f"mini_batch_size={mini} must divide the rollout's prompts_per_step x rollout.sampling.n = {rows} sequences"
        )
    for role in roles:
        model = cfg.role(role)
        dp = Layout.for_world(model.tp, model.pp, world_size).dp
        if rows % dp:
            errors.append(
                f"the rollout's {rows} sequences (prompts_per_step x rollout.sampling.n) must split evenly "
                f"over the {role}'s dp={dp} data-parallel ranks"
            )
        if role in ("actor", "critic") and mini % dp:
            errors.append(f"mini_batch_size={mini} must be divisible by the {role}'s dp={dp}")
    return errors


def _lora_errors(cfg: PPOConfig, roles: list[str]) -> list[str]:
    """LoRA where ppo cannot use it: the reference and the reward model never train; dropout, which
    makes the trained forward differ from the one that made the rollout's figures; a LoRA actor's
    reference cannot follow it (the reference's copy of the actor would need the adapters merged)."""
    why = {
        "reference": "the reference never trains",
        "reward": "the reward model never trains in ppo (train it with LoRA in rm)",
    }
    errors = [
        f"{role}.lora.rank={cfg.role(role).lora.rank} must be 0: {reason}"
        for role, reason in why.items()
        if cfg.role(role).lora.rank > 0
    ]
    errors += [
        f"{role}.lora.dropout={cfg.role(role).lora.dropout} must be 0 in ppo: dropout acts in the update's "
        "forward only (train mode), not in the rollout's, the old log-probs', the old values' or the "
        "reference's, so the update starts from a ratio away from 1 and its clip cuts noise (an adapter "
        "trained with dropout loads with 0)"
        for role in ("actor", "critic")
        if role in roles and cfg.role(role).lora.enabled and cfg.role(role).lora.dropout > 0
    ]
    lora = cfg.actor.lora
    if not lora.enabled:
        return errors
    if cfg.reference.update != "none" and "reference" in roles:
        errors.append(
            f"reference.update={cfg.reference.update!r} with actor.lora.rank={lora.rank}: a reference that "
            "follows a LoRA actor is not supported yet (its copy of the actor leaves the adapters out); "
            "use reference.update=none (the reference is then the actor's base, for free)"
        )
    return errors


def reference_from_actor(cfg: PPOConfig) -> bool:
    """Whether the reference's log-probs come from the actor with its adapters off, no reference
    model built: a LoRA actor (its base is frozen, so with the adapters off it is the model it was
    loaded as) whose path is the reference's (an empty reference.path is the actor's), a fixed
    reference (reference.update=none), and an algorithm that uses the reference."""
    return (
        cfg.actor.lora.enabled
        and cfg.reference.update == "none"
        and cfg.role("reference").path == cfg.actor.path
        and cfg.reference.lora.rank == 0
        and "reference" in models_used(cfg)
    )


def _reference_update_errors(cfg: PPOConfig, roles: list[str], archs: dict[str, Architecture]) -> list[str]:
    """A reference that follows the actor must be used, be the actor's architecture, and hold the
    actor's padded vocabulary in its own layout."""
    ref = cfg.reference
    if ref.update == "none":
        return []
    if "reference" not in roles:
        return [
            (
                f"reference.update={ref.update!r} refreshes a reference that nothing uses: set "
                "algorithm.kl_penalty.coef > 0 or algorithm.loss.kl_loss_coef > 0, or reference.update=none"
            )
        ]
    if "actor" not in archs or "reference" not in archs:
        return []  # an unreadable path is reported already
    actor, reference = archs["actor"], archs["reference"]
    differ = [
        f"{f.name} {getattr(reference, f.name)} vs {getattr(actor, f.name)}"
        for f in dataclasses.fields(actor)
        if f.compare and getattr(reference, f.name) != getattr(actor, f.name)
    ]
    if differ:
        return [
            (
                f"reference.path={cfg.role('reference').path!r} is not the architecture of "
                f"actor.path={cfg.actor.path!r} "
                f"({', '.join(differ)}): reference.update={ref.update!r} copies the actor's weights into the reference"
            )
        ]
    try:
        matching_vocab_pad_multiple(actor.vocab_size, padded_vocab_size(actor.vocab_size, cfg.actor.tp), ref.tp)
    except ValueError as err:
        return [f"reference.{err} (reference.update={ref.update!r} copies the actor's weights into the reference)"]
    return []
