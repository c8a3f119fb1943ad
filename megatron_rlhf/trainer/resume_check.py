"""What a resumed run may change from the config of the checkpoint it continues.

Every leaf key of a trainer's config is classified once, in ``RULES``, by the dataclass that
declares it (so ``actor_optim.lr``, ``critic_optim.lr`` and ``optim.lr`` share ``OptimConfig.lr``):

* ``MAY_CHANGE``: the new value applies from the first resumed step (learning rates and schedules,
  clipping, KL and loss coefficients, sampling, the run's length, evaluation, saving, loggers).
* ``FIXED``: what the checkpoint's state means depends on it: the dtype, the seed and how the data
  is read that make the step the data position (columns, lengths, batch size), the optimizer's kind.
* ``DATA``: the training files may change name (a copy on a node's own disk): what may not is the
  examples' content (``content_digest``, which each checkpoint records; an older checkpoint's
  files may not change).
* ``LAYOUT``: where things run (TP/PP, device): checkpoints reshard on load, so it may change.
* ``MODEL``: a model's ``path`` may change (a moved directory); what may not is the architecture
  and tokenizer behind it, compared with the ones the checkpoint records, nor which models the run
  uses (a critic or reference appearing or disappearing; a reward model may: ``SCORERS``).
* The dtype is compared as resolved (``auto``: bf16 on a GPU, fp32 on CPU), which each checkpoint
  records.

A unit test checks that every leaf of PPOConfig, SFTConfig and RMConfig has a rule, and that every
rule is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import yaml

from megatron_rlhf.checkpoint.sources import FOLLOW_ACTOR
from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.config.run import DTYPES
from megatron_rlhf.data import Tokenizer
from megatron_rlhf.data.tokenizer import PROBE_TEXT
from megatron_rlhf.models.architecture import Architecture, architecture_from_hf_config

MAY_CHANGE, FIXED, LAYOUT, MODEL, DATA = "may change", "may not change", "layout", "model", "data"

RULES: dict[str, dict[str, str]] = {
    "DeviceConfig": {"device": LAYOUT, "dtype": FIXED},
    "RunConfig": {
        "seed": FIXED,
        "output_dir": MAY_CHANGE,
        "dist_timeout_s": MAY_CHANGE,
        "host_threads": MAY_CHANGE,
    },
    "ModelConfig": {"path": MODEL, "tp": LAYOUT, "pp": LAYOUT},
    # rank, alpha and the targets shape the adapters and what a step means; dropout only regularises;
    # the adapter path is only a start (a resumed run takes its checkpoint's adapters).
    "LoraConfig": {
        "rank": FIXED,
        "alpha": FIXED,
        "dropout": MAY_CHANGE,
        "target_modules": FIXED,
        "adapter_path": MAY_CHANGE,
    },
    # none <-> periodic/ema decides whether the checkpoint holds the reference's weights.
    "ReferenceConfig": {"update": FIXED, "update_every": MAY_CHANGE, "ema_decay": MAY_CHANGE},
    "LoopConfig": {
        key: MAY_CHANGE
        for key in (
            "max_tokens_per_micro_batch",
            "pack_sequences",
            "num_epochs",
            "max_steps",
            "log_every",
            "loggers",
            "save_hf",
            "save_every",
            "save_final",
            "keep_last",
            "async_save",
            "resume",
            "overwrite",
            "profile_steps",
            "max_bad_steps",
            "trust_unverified_checkpoint",
            "remote_dir",
        )
    },
    "HealthConfig": {
        key: MAY_CHANGE
        for key in (
            "val_patience",
            "val_metric",
            "val_mode",
            "max_rollbacks",
            "lr_factor",
            "kl_coef_factor",
            "min_entropy",
            "min_response_length",
            "max_response_length",
            "max_uniform_group_fraction",
            "max_kl",
            "max_phase_s",
            "max_phase_std_s",
            "signal_steps",
            "roll_back_on",
        )
    },
    "WandbConfig": {"project": MAY_CHANGE, "name": MAY_CHANGE, "mode": MAY_CHANGE},
    # What the examples are and how many: the step is the data position.
    "TrainFilesConfig": {"train": DATA},
    "RowsConfig": {"prompt_key": FIXED, "on_invalid": FIXED, "add_bos": FIXED, "num_workers": MAY_CHANGE},
    "DataFilesConfig": {"on_overlong": FIXED},
    "PromptDataConfig": {
        "validation": MAY_CHANGE,
        "extra_keys": MAY_CHANGE,
        "max_prompt_length": FIXED,
    },
    "ChatOptionsConfig": {
        "apply_chat_template": FIXED,
        "chat_template_kwargs": FIXED,
        "tools_file": FIXED,
        "tools_key": FIXED,
    },
    "SupervisedDataConfig": {"validation": MAY_CHANGE, "max_length": FIXED},
    "SFTDataConfig": {"response_key": FIXED, "messages_key": FIXED},
    "PreferenceDataConfig": {"chosen_key": FIXED, "rejected_key": FIXED},
    "RolloutConfig": {"tp": LAYOUT, "filter_groups": MAY_CHANGE, "max_sample_batches": MAY_CHANGE},
    # What the policy learns to do (its tools, how it calls them) is fixed; the limits of a trajectory are not.
    "MultiTurnConfig": {
        "enable": FIXED,
        "tool_config_path": FIXED,
        "format": FIXED,
        "interaction_config_path": FIXED,
        **{
            key: MAY_CHANGE
            for key in (
                "max_assistant_turns",
                "max_user_turns",
                "max_parallel_calls",
                "tool_timeout_s",
                "max_tool_response_length",
                "tool_workers",
            )
        },
    },
    "SamplingParams": {
        key: MAY_CHANGE
        for key in ("temperature", "top_k", "top_p", "max_new_tokens", "n", "stop_token_ids", "ignore_eos", "seed")
    },
    "NativeEngineConfig": {
        key: MAY_CHANGE
        for key in (
            "max_batch_size",
            "max_seq_len",
            "on_long_prompt",
            "eos_token_ids",
            "cuda_graphs",
            "graph_kv_bucket",
            "filtered_sampler",
        )
    },
    "HybridConfig": {"offload": MAY_CHANGE},
    "ScoringConfig": {
        "use_reward_model": MAY_CHANGE,
        "rules": MAY_CHANGE,
        "weights": MAY_CHANGE,
        "timeout_s": MAY_CHANGE,
        "workers": MAY_CHANGE,
    },
    "CustomFunctionConfig": {"path": MAY_CHANGE, "name": MAY_CHANGE},
    "OverlongConfig": {"buffer": MAY_CHANGE, "penalty": MAY_CHANGE},
    # An estimator that needs a critic the checkpoint lacks is refused by the models' comparison.
    "AlgorithmConfig": {
        "advantage_estimator": MAY_CHANGE,
        "kl_penalty_estimator": MAY_CHANGE,
        "recompute_old_logprobs": MAY_CHANGE,
    },
    "AdvantageConfig": {
        key: MAY_CHANGE for key in ("gamma", "lam", "whiten", "eps", "norm_by_std", "reset_return_at_gaps")
    },
    "KLControllerConfig": {key: MAY_CHANGE for key in ("type", "coef", "target_kl", "horizon", "kl_measure")},
    "PPOLossConfig": {
        key: MAY_CHANGE
        for key in (
            "clip_low",
            "clip_high",
            "dual_clip_c",
            "value_clip",
            "entropy_coef",
            "kl_loss_coef",
            "kl_estimator",
            "agg_mode",
            "loss_scale_factor",
        )
    },
    # The optimizer's hyperparameters are applied after its state is loaded; its kind and where its
    # state lives decide the checkpoint's format.
    "OptimConfig": {
        **{
            key: MAY_CHANGE
            for key in (
                "lr",
                "min_lr",
                "weight_decay",
                "adam_beta1",
                "adam_beta2",
                "adam_eps",
                "clip_grad",
                "warmup_steps",
                "decay_style",
                "decay_steps",
            )
        },
        "distributed_optimizer": FIXED,
        "cpu_offload_fraction": FIXED,
    },
    "PPOConfig": {
        "prompts_per_step": FIXED,
        "mini_batch_size": MAY_CHANGE,
        "ppo_epochs": MAY_CHANGE,
        "samples_per_step": MAY_CHANGE,
        "samples_token_ids": MAY_CHANGE,
        "eval_every": MAY_CHANGE,
        "eval_before_train": MAY_CHANGE,
        "warmup": MAY_CHANGE,
    },
    "EvalConfig": {key: MAY_CHANGE for key in ("n", "temperature", "correct_score", "judged_by", "samples")},
    "SupervisedConfig": {"global_batch_size": FIXED, "eval_every": MAY_CHANGE, "eval_before_train": MAY_CHANGE},
}
"""Class name -> field -> rule: the one place that says what a resumed run may change."""

NOTES = {
    "KLControllerConfig.coef": "with type=adaptive this is only the starting value: the checkpoint's current "
    "coefficient continues (one a fixed controller saved does not); with type=fixed the new value applies",
    "ModelConfig.path": "compared by architecture and tokenizer, not by path",
    "TrainFilesConfig.train": "compared by the examples' content, not by file name",
    **dict.fromkeys(
        ("PPOConfig.ppo_epochs", "PPOConfig.mini_batch_size"),
        "the learning-rate schedules count optimizer steps, and this changes how many a step makes: a decay "
        "whose length was resolved from the run's (decay_steps null) now ends before or after the run does",
    ),
    "RowsConfig.add_bos": "as resolved: null follows the tokenizer's own encoding of text (checkpoints written "
    "before null was the default have false; data.add_bos=false continues such a run as it was)",
}
"""What a reported change means where the new value is not simply what the run uses."""


class ResumeRefused(ConfigError):
    """A resumed run's config changes what its checkpoint cannot follow (the message lists it)."""


def leaf_rules(cfg: Any) -> dict[str, tuple[str, str]]:
    """Every leaf key of a config (dotted) -> (its rule, ``Class.field`` of the dataclass declaring it).
    Raises ``KeyError`` naming a key that ``RULES`` does not classify."""
    found: dict[str, tuple[str, str]] = {}

    def walk(obj: Any, prefix: str) -> None:
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
                continue
            owner = next(c for c in type(obj).__mro__ if field.name in getattr(c, "__annotations__", {}))
            rule = RULES.get(owner.__name__, {}).get(field.name)
            if rule is None:
                raise KeyError(
                    f"{prefix}{field.name} ({owner.__name__}.{field.name}) has no rule in "
                    "trainer/resume_check.py RULES: classify it as may change, may not change or layout"
                )
            found[prefix + field.name] = (rule, f"{owner.__name__}.{field.name}")

    walk(cfg, "")
    return found


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """How a tokenizer behaves (a probe text's ids, its special ids and vocabulary size), not where
    it was read from: a moved model directory keeps its fingerprint."""
    ids = [
        tokenizer.encode(PROBE_TEXT),
        tokenizer.vocab_size,
        tokenizer.pad_id,
        tokenizer.bos_id,
        tokenizer.eos_id,
        sorted(tokenizer.stop_ids),
    ]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What each checkpoint records of the run that wrote it, and a resume compares
    (``resume_check.review_resume``)."""

    trainer: str
    """The command (ppo, sft, rm): a checkpoint continues only the trainer that wrote it."""
    examples: int
    """The training set's size: with another, a step is no longer the same data position."""
    models: dict[str, Architecture]
    """Role -> architecture of every model the run uses."""
    dtype: str
    """The parameters' dtype as resolved (``dtype=auto`` is bf16 on a GPU, fp32 on CPU): fp32, bf16, fp16."""
    data: str
    """The training examples' ``content_digest``: the data itself, wherever its files are."""


@dataclasses.dataclass(frozen=True)
class ResumeReview:
    """A resumed run's config against its checkpoint's: lines to report and changes refused."""

    changed: list[str]
    refused: list[str]


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    return {key: value for name, sub in tree.items() for key, value in _flat(sub, f"{prefix}{name}.").items()}


def review_resume(
    cfg: Any, new_yaml: str, old_yaml: str, run_state: dict[str, Any], facts: RunFacts, tokenizer: str
) -> ResumeReview:
    """Compare the resolved config (``new_yaml``) with the checkpoint's (``old_yaml``), and the run's
    facts (trainer, training set size, models) and ``tokenizer`` fingerprint with what the
    checkpoint's ``run_state`` records (a checkpoint written before a fact was recorded is not
    compared on it)."""
    if run_state.get("trainer") not in (None, facts.trainer):
        return ResumeReview(
            [],
            [
                f"the checkpoint was written by '{run_state['trainer']}', this run is '{facts.trainer}': a checkpoint "
                "continues the trainer that wrote it (start from its run's hf/ export instead)"
            ],
        )
    rules = leaf_rules(cfg)
    old, new = _flat(yaml.safe_load(old_yaml)), _flat(yaml.safe_load(new_yaml))
    for settings in (old, new):  # the model each role used, whether its config named it or left it to the actor
        for role in FOLLOW_ACTOR:
            if settings.get(f"{role}.path") == "":
                settings[f"{role}.path"] = settings["actor.path"]
    changed, refused = [], []
    # The dtype is compared as resolved (auto: bf16 on a GPU, fp32 on CPU), where the checkpoint
    # records it; an older checkpoint's setting is taken as resolved unless it was auto.
    recorded_dtype, requested = run_state.get("dtype", old.get("dtype")), new.get("dtype")
    if recorded_dtype in DTYPES:
        old.pop("dtype", None)
        new.pop("dtype", None)
        if recorded_dtype != facts.dtype:
            refused.append(
                f"dtype: the checkpoint's run trained in {recorded_dtype}, this one would in {facts.dtype} "
                f"(dtype={requested!r}; auto is bf16 on a GPU, fp32 on CPU)"
            )
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, "(not set)"), new.get(key, "(not a setting now)")
        if before == after:
            continue
        rule, owner = rules.get(key, (MAY_CHANGE, ""))
        note = NOTES.get(owner, "" if rule == MAY_CHANGE else rule)
        changed.append(f"{key}: {before!r} -> {after!r}" + (f" ({note})" if note else ""))
        if (rule == FIXED or (rule == DATA and "data" not in run_state)) and key in old and key in new:
            refused.append(f"{key}: {before!r} -> {after!r}")
        if rule == MODEL and "models" not in run_state:  # a checkpoint that records no architectures
            refused.append(f"{key}: {before!r} -> {after!r} (the checkpoint records no architectures to compare)")
    if run_state.get("examples") not in (None, facts.examples):
        refused.append(
            f"the training data now has {facts.examples} examples, the checkpoint's run had "
            f"{run_state['examples']} (same files, changed content?): a step is no longer the same data position"
        )
    elif run_state.get("data") not in (None, facts.data):
        refused.append(
            "the training examples' content differs from the checkpoint's run's (as many examples, other token "
            "ids: files rewritten under the same names?): a step is no longer the same data position"
        )
    saved = run_state.get("models")
    if saved is not None:
        refused += _model_changes(saved, facts.models)
        if run_state.get("tokenizer") not in (None, tokenizer):
            refused.append("the tokenizer encodes text differently from the checkpoint's")
    return ResumeReview(changed, refused)


SCORERS = frozenset({"reward"})
"""Models read from their path at every start, with nothing of theirs in a checkpoint: a resumed run
may add, drop or replace one (``scoring.use_reward_model`` may change), and scores with it from
its first step."""


def _model_changes(saved: dict[str, dict[str, Any]], models: dict[str, Architecture]) -> list[str]:
    """Models that appear, disappear or whose architecture differs from the checkpoint's (but
    ``SCORERS``)."""
    saved = {role: config for role, config in saved.items() if role not in SCORERS}
    models = {role: arch for role, arch in models.items() if role not in SCORERS}
    refused = [f"the run uses a {role} that the checkpoint's run did not" for role in models if role not in saved]
    refused += [f"the checkpoint's run used a {role} that this run does not" for role in saved if role not in models]
    for role in models.keys() & saved.keys():
        before, after = architecture_from_hf_config(saved[role], source=f"the checkpoint's {role}"), models[role]
        differ = [
            f"{f.name} {getattr(before, f.name)} -> {getattr(after, f.name)}"
            for f in dataclasses.fields(after)
            if f.compare and getattr(before, f.name) != getattr(after, f.name)
        ]
        if differ:
            refused.append(f"the {role}'s architecture: {', '.join(differ)}")
    return refused
