"""verl's config keys and this project's: one table, read by the loader and written into the docs.

A verl user types verl's keys (``actor_rollout_ref.rollout.n=4``, ``trainer.total_epochs=1``). The
loader answers an unknown key that is verl's with this project's name for it (``verl_key_hint``),
and ``docs/migrating-from-verl.md``'s "Config keys" tables are rendered from ``VERL_NAMES``
(``megatron_rlhf/docs.py``; a unit test checks that the page is up to date and that every key named here
exists).

Keys are verl's full dotted keys, as in its ``ppo_trainer.yaml`` / ``ppo_megatron_trainer.yaml``;
a key ending in ``.*`` stands for its whole section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection


@dataclasses.dataclass(frozen=True)
class VerlName:
    verl: str
    """verl's dotted key (``.*``: the section)."""
    here: tuple[str, ...]
    """This project's keys for it; empty: no counterpart (the note says what happens instead)."""
    note: str = ""


def _rows(*rows: tuple[str, tuple[str, ...] | str, str] | tuple[str, tuple[str, ...] | str]) -> tuple[VerlName, ...]:
    return tuple(VerlName(row[0], (row[1],) if isinstance(row[1], str) else row[1], *row[2:]) for row in rows)


AR = "actor_rollout_ref"
VERL_NAMES: dict[str, tuple[VerlName, ...]] = {
    "`data.*`": _rows(
        ("data.train_files", "data.train", "list of .jsonl/.parquet files or directories"),
        ("data.val_files", "data.validation", "evaluated every `eval_every` steps and at the end"),
        (
            "data.prompt_key",
            "data.prompt_key",
            "text, a list of `{role, content}` chat messages (rendered with the "
            "model's chat template, `data.apply_chat_template`), or `<key>_ids` token ids",
        ),
        ("data.max_prompt_length", "data.max_prompt_length", "512 in both"),
        ("data.max_response_length", "rollout.sampling.max_new_tokens", "512 in both"),
        ("data.train_batch_size", "prompts_per_step", "prompts per RL step, as in verl (**verl 1024, here 16**)"),
        (
            "data.filter_overlong_prompts",
            "data.on_overlong",
            "`true` is `data.on_overlong=skip`; skipped rows are counted in the start-up report",
        ),
        (
            "data.truncation",
            "data.on_overlong",
            "`error` is `data.on_overlong=error`; left/right/middle truncation: none",
        ),
        (
            "data.filter_overlong_prompts_workers",
            "data.num_workers",
            "processes that read and tokenize every row at "
            "start-up (0: the trainer's own process); same dataset either way",
        ),
        (
            "data.dataloader_num_workers",
            (),
            "nothing is loaded per step: a step's batch is an index into the rows tokenized at start-up",
        ),
        ("data.shuffle", (), "prompts are always shuffled, per epoch, from `seed`"),
        ("data.seed", "seed", "one seed for the run"),
        (
            "data.reward_fn_key",
            (),
            "verl reads the reward function's `data_source` argument from this column; here it is always the "
            "`data_source` column (rename yours to it). Other columns a reward rule reads: `data.extra_keys`",
        ),
        (
            "data.return_raw_chat",
            "data.apply_chat_template",
            "chat prompts are rendered here, once, with the generation prompt appended",
        ),
        (
            "data.apply_chat_template_kwargs",
            "data.chat_template_kwargs",
            "passed to the chat template, e.g. `{enable_thinking: false}`",
        ),
    ),
    "`actor_rollout_ref.model.*`, `.actor.*`, `.ref.*`": _rows(
        (
            f"{AR}.model.path",
            "actor.path",
            "the critic and the reference start from it unless `critic.path` / "
            "`reference.path` say otherwise, as in verl",
        ),
        (
            f"{AR}.model.use_remove_padding",
            "pack_sequences",
            "on by default: sequences share rows of a micro-batch, each attending only to itself",
        ),
        (
            f"{AR}.model.lora_rank",
            "actor.lora.rank",
            "0 (off) in both; the reference can be the LoRA actor's base (sft: `model.lora.rank`)",
        ),
        (f"{AR}.model.lora_alpha", "actor.lora.alpha", "16 in both"),
        (
            f"{AR}.model.target_modules",
            "actor.lora.target_modules",
            "PEFT names; a list here, `[all-linear]` by default",
        ),
        (
            f"{AR}.model.lora_adapter_path",
            "actor.lora.adapter_path",
            "verl takes r, alpha and targets from the adapter; here they must equal `actor.lora.*` (a mismatch "
            "is refused at start-up, naming the overrides); the reference is the base without it in both",
        ),
        (
            f"{AR}.model.enable_gradient_checkpointing",
            (),
            "activations are kept, not recomputed; a smaller `max_tokens_per_micro_batch` needs less memory",
        ),
        (f"{AR}.actor.strategy", (), "always megatron-core, in the layouts `actor.tp` / `actor.pp` name"),
        (
            f"{AR}.actor.fsdp_config.param_offload",
            (),
            "weights stay on the GPU; `hybrid.offload` moves the optimizer state and gradients off it while generating",
        ),
        (
            f"{AR}.actor.fsdp_config.optimizer_offload",
            "actor_optim.cpu_offload_fraction",
            "`1` keeps the whole optimizer state on the host (verl's `true`); a fraction keeps that share",
        ),
        (f"{AR}.ref.fsdp_config.param_offload", (), "the reference's weights stay on the GPU"),
        (f"{AR}.actor.megatron.tensor_model_parallel_size", "actor.tp"),
        (f"{AR}.actor.megatron.pipeline_model_parallel_size", "actor.pp"),
        (f"{AR}.ref.megatron.tensor_model_parallel_size", "reference.tp"),
        (f"{AR}.ref.megatron.pipeline_model_parallel_size", "reference.pp"),
        (f"{AR}.actor.megatron.context_parallel_size", ()),
        (f"{AR}.actor.megatron.expert_model_parallel_size", ()),
        (f"{AR}.actor.megatron.sequence_parallel", ()),
        (f"{AR}.actor.megatron.dtype", "dtype", "one dtype for all models (`auto`: bf16 on GPU)"),
        (f"{AR}.actor.fsdp_config.dtype", "dtype", "one dtype for all models (`auto`: bf16 on GPU)"),
        (f"{AR}.actor.megatron.use_distributed_optimizer", "actor_optim.distributed_optimizer", "true in both"),
        (
            f"{AR}.actor.ppo_mini_batch_size",
            "mini_batch_size",
            "**counts sequences here, prompts in verl**: set "
            "`ppo_mini_batch_size x rollout.n` (see below); 0 = the whole rollout",
        ),
        (
            f"{AR}.actor.ppo_micro_batch_size_per_gpu",
            "max_tokens_per_micro_batch",
            "micro-batches are always cut by a token budget",
        ),
        (f"{AR}.actor.use_dynamic_bsz", "max_tokens_per_micro_batch", "always on"),
        (f"{AR}.actor.ppo_max_token_len_per_gpu", "max_tokens_per_micro_batch"),
        (
            f"{AR}.ref.log_prob_micro_batch_size_per_gpu",
            "max_tokens_per_micro_batch",
            "the same budget for every forward pass",
        ),
        (f"{AR}.actor.ppo_epochs", "ppo_epochs", "shared by actor and critic"),
        (f"{AR}.actor.shuffle", (), "each epoch takes a fresh permutation of the rollout"),
        (
            f"{AR}.actor.clip_ratio",
            ("algorithm.loss.clip_low", "algorithm.loss.clip_high"),
            "set both to the same value; 0.2 in both",
        ),
        (f"{AR}.actor.clip_ratio_low", "algorithm.loss.clip_low"),
        (f"{AR}.actor.clip_ratio_high", "algorithm.loss.clip_high"),
        (
            f"{AR}.actor.clip_ratio_c",
            "algorithm.loss.dual_clip_c",
            "default 3.0 in both; `null` turns it off (verl cannot)",
        ),
        (
            f"{AR}.actor.loss_agg_mode",
            "algorithm.loss.agg_mode",
            "`token-mean`, `seq-mean-token-sum`, "
            "`seq-mean-token-sum-norm`, `seq-mean-token-mean`; verl's newer `token-sum` does not exist here",
        ),
        (
            f"{AR}.actor.loss_scale_factor",
            "algorithm.loss.loss_scale_factor",
            "required with `seq-mean-token-sum-norm` (see below)",
        ),
        (f"{AR}.actor.entropy_coeff", "algorithm.loss.entropy_coef", "0 in both"),
        (
            f"{AR}.actor.use_kl_loss",
            "algorithm.loss.kl_loss_coef",
            "no switch: a coefficient > 0 is the KL loss; 0 (the default) = none, as verl's `use_kl_loss=false`",
        ),
        (f"{AR}.actor.kl_loss_coef", "algorithm.loss.kl_loss_coef", "verl's 0.001 applies only with `use_kl_loss`"),
        (f"{AR}.actor.kl_loss_type", "algorithm.loss.kl_estimator", "same names, including `k3+` etc. (see below)"),
        (
            f"{AR}.actor.policy_loss.loss_mode",
            (),
            "always `vanilla`; gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, bypass_mode: none",
        ),
        (f"{AR}.actor.optim.lr", "actor_optim.lr", "1e-6 in both"),
        (f"{AR}.actor.optim.weight_decay", "actor_optim.weight_decay", "0.01 in both"),
        (f"{AR}.actor.optim.betas", ("actor_optim.adam_beta1", "actor_optim.adam_beta2"), "(0.9, 0.999) in both"),
        (f"{AR}.actor.optim.clip_grad", "actor_optim.clip_grad", "1.0 in both; 0 disables"),
        (f"{AR}.actor.grad_clip", "actor_optim.clip_grad", "1.0 in both; 0 disables"),
        (f"{AR}.actor.optim.lr_warmup_steps", "actor_optim.warmup_steps", "verl's -1 (none) is 0 here"),
        (
            f"{AR}.actor.optim.lr_warmup_steps_ratio",
            "actor_optim.warmup_steps",
            "multiply by the number of optimizer steps yourself",
        ),
        (f"{AR}.actor.optim.lr_decay_style", "actor_optim.decay_style", "constant, cosine or linear"),
        (f"{AR}.actor.optim.lr_scheduler_type", "actor_optim.decay_style", "constant, cosine or linear"),
        (
            f"{AR}.actor.optim.lr_decay_steps",
            "actor_optim.decay_steps",
            "default (null): the run's optimizer steps, as verl's",
        ),
        (f"{AR}.actor.optim.total_training_steps", "actor_optim.decay_steps", "null derives it from the run's length"),
        (f"{AR}.actor.optim.min_lr", "actor_optim.min_lr", "an absolute rate"),
        (f"{AR}.actor.optim.min_lr_ratio", "actor_optim.min_lr", "an absolute rate: `min_lr_ratio x lr`"),
    ),
    "`actor_rollout_ref.rollout.*`": _rows(
        (f"{AR}.rollout.name", (), "the built-in engine generates from the training weights (vllm, sglang: none)"),
        (f"{AR}.rollout.n", "rollout.sampling.n", "1 in both; the group estimators (grpo, rloo, ...) need >= 2"),
        (
            f"{AR}.rollout.temperature",
            "rollout.sampling.temperature",
            "must be > 0; log-probs are recomputed at it, as in verl",
        ),
        (f"{AR}.rollout.top_k", "rollout.sampling.top_k", "off is **-1 in verl, 0 here**"),
        (f"{AR}.rollout.top_p", "rollout.sampling.top_p"),
        (f"{AR}.rollout.response_length", "rollout.sampling.max_new_tokens"),
        (f"{AR}.rollout.prompt_length", "data.max_prompt_length"),
        (f"{AR}.rollout.tensor_model_parallel_size", "rollout.tp", "0 = the actor's TP"),
        (f"{AR}.rollout.max_num_seqs", "rollout.engine.max_batch_size", "sequences decoded together"),
        (f"{AR}.rollout.enforce_eager", "rollout.engine.cuda_graphs", "`enforce_eager=true` is `cuda_graphs=false`"),
        (
            f"{AR}.rollout.max_num_batched_tokens",
            "rollout.engine.max_batch_size",
            "vLLM's prefill budget; the built-in engine bounds the sequences decoded together",
        ),
        (f"{AR}.rollout.enable_chunked_prefill", (), "the built-in engine prefills each prompt whole"),
        (
            f"{AR}.rollout.gpu_memory_utilization",
            "hybrid.offload",
            "`auto` moves the actor's optimizer state off the "
            "GPU while generating only when the KV cache and generation weights would not fit beside it; `always`, "
            "`never`",
        ),
        (f"{AR}.rollout.free_cache_engine", "hybrid.offload"),
        (
            f"{AR}.rollout.log_prob_micro_batch_size_per_gpu",
            "max_tokens_per_micro_batch",
            "the same budget for every forward pass",
        ),
        (
            f"{AR}.rollout.calculate_log_probs",
            (),
            "the engine's log-probs are always compared with the trainer's (`rollout/logprob_max_abs_diff`)",
        ),
        (f"{AR}.rollout.multi_turn.enable", "rollout.multi_turn.enable", "false in both"),
        (
            f"{AR}.rollout.multi_turn.tool_config_path",
            "rollout.multi_turn.tool_config_path",
            "the agent runs its tools and the prompts offer their schemas (see below); also `builtin:calculator`, "
            "`builtin:python`",
        ),
        (f"{AR}.rollout.multi_turn.max_assistant_turns", "rollout.multi_turn.max_assistant_turns", "`null` is 0"),
        (
            f"{AR}.rollout.multi_turn.max_user_turns",
            "rollout.multi_turn.max_user_turns",
            "`null` is 0; tool and interaction turns together, as in verl",
        ),
        (
            f"{AR}.rollout.multi_turn.interaction_config_path",
            "rollout.multi_turn.interaction_config_path",
            "the same YAML and class shape; the conversation an interaction is given starts after the prompt "
            "(see below)",
        ),
        (f"{AR}.rollout.multi_turn.format", "rollout.multi_turn.format", "`hermes` in both"),
        (f"{AR}.rollout.multi_turn.max_parallel_calls", "rollout.multi_turn.max_parallel_calls", "1 in both"),
        (
            f"{AR}.rollout.multi_turn.max_tool_response_length",
            "rollout.multi_turn.max_tool_response_length",
            "256 in both",
        ),
        (
            f"{AR}.rollout.multi_turn.tool_response_truncate_side",
            (),
            "`middle` (verl's default) only",
        ),
        (
            f"{AR}.rollout.multi_turn.*",
            (),
            "no tokenization sanity check: the engine extends each trajectory in place with the chat template's tokens",
        ),
        (f"{AR}.rollout.agent.*", ()),
        (
            f"{AR}.rollout.val_kwargs.*",
            "eval",
            "validation: a greedy response per prompt, and `eval.n` samples at `eval.temperature`",
        ),
    ),
    "`critic.*`, `reward_model.*`, `custom_reward_function.*`": _rows(
        (
            "critic.model.path",
            "critic.path",
            "empty: the actor's path, given a new value head (verl loads a causal "
            "LM as a one-label token classifier the same way)",
        ),
        ("critic.model.lora_rank", "critic.lora.rank", "0 (off) in both"),
        ("critic.model.lora_alpha", "critic.lora.alpha", "16 in both"),
        ("critic.model.target_modules", "critic.lora.target_modules", "as for the actor"),
        ("critic.megatron.tensor_model_parallel_size", "critic.tp"),
        ("critic.megatron.pipeline_model_parallel_size", "critic.pp"),
        ("critic.optim.lr", "critic_optim.lr", "1e-5 in both"),
        ("critic.optim.*", "critic_optim", "as for the actor"),
        ("critic.cliprange_value", "algorithm.loss.value_clip", "0.5 in both; `null` turns it off (verl cannot)"),
        ("critic.ppo_mini_batch_size", "mini_batch_size", "shared with the actor"),
        ("critic.ppo_micro_batch_size_per_gpu", "max_tokens_per_micro_batch", "the same budget for every pass"),
        ("critic.ppo_epochs", "ppo_epochs", "shared with the actor"),
        ("critic.loss_agg_mode", "algorithm.loss.agg_mode", "shared with the actor"),
        ("reward_model.enable", "scoring.use_reward_model", "false in both"),
        (
            "reward_model.reward_manager",
            (),
            "one scorer: the reward model, `scoring.rules` and `scoring.custom_function`, weighted by "
            "`scoring.weights`",
        ),
        ("reward_model.model.path", "reward.path"),
        ("reward_model.megatron.*", ("reward.tp", "reward.pp")),
        ("reward_model.overlong_buffer.enable", "scoring.overlong.buffer", "DAPO; `buffer=0` is off"),
        ("reward_model.overlong_buffer.len", "scoring.overlong.buffer"),
        ("reward_model.overlong_buffer.penalty_factor", "scoring.overlong.penalty"),
        (
            "custom_reward_function.path",
            "scoring.custom_function.path",
            "the same file, unchanged: "
            "`compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`, returning a number or a dict "
            "with `score` (other numeric keys are logged as `reward/custom/<key>`); `solution_str` is decoded with "
            "special tokens skipped, as in verl; a signature that cannot take those keywords is refused at start-up, "
            "and a call is limited to `scoring.timeout_s`",
        ),
        ("custom_reward_function.name", "scoring.custom_function.name", "`compute_score` in both"),
    ),
    "`algorithm.*`": _rows(
        (
            "algorithm.adv_estimator",
            "algorithm.advantage_estimator",
            "`gae` (default in both), `grpo`, `rloo`; verl "
            "`reinforce_plus_plus` = `reinforce_pp`, `reinforce_plus_plus_baseline` = `reinforce_pp_baseline`; verl "
            "`grpo` with `norm_adv_by_std_in_grpo=false` = `dr_grpo`. remax, opo, gpg, grpo_passk, gdpo, "
            "optimal_token_baseline: none",
        ),
        ("algorithm.gamma", "algorithm.advantage.gamma", "1.0 in both"),
        ("algorithm.lam", "algorithm.advantage.lam", "1.0 in both"),
        ("algorithm.norm_adv_by_std_in_grpo", "algorithm.advantage.norm_by_std"),
        (
            "algorithm.use_kl_in_reward",
            "algorithm.kl_penalty.coef",
            "no switch: a coefficient > 0 is the penalty; 0 (the default) = none, as verl's `use_kl_in_reward=false`",
        ),
        ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_penalty.coef", "verl's 0.001 applies only with `use_kl_in_reward`"),
        ("algorithm.kl_penalty", "algorithm.kl_penalty_estimator", "`kl`/`k1` in both by default"),
        ("algorithm.kl_ctrl.type", "algorithm.kl_penalty.type", "fixed or adaptive"),
        ("algorithm.kl_ctrl.target_kl", "algorithm.kl_penalty.target_kl", "0.1 in both"),
        ("algorithm.kl_ctrl.horizon", "algorithm.kl_penalty.horizon", "10000 in both"),
        (
            "algorithm.filter_groups.enable",
            "rollout.filter_groups",
            "DAPO; filters on the weighted score before the over-long penalty and KL",
        ),
        (
            "algorithm.filter_groups.max_num_gen_batches",
            "rollout.max_sample_batches",
            "a batch still short after the "
            "last sample batch is filled with dropped groups and reported (`rollout/groups_short`), where verl raises",
        ),
        ("algorithm.filter_groups.metric", (), "always the weighted score"),
        ("algorithm.rollout_correction.*", ()),
        ("algorithm.use_pf_ppo", ()),
    ),
    "`trainer.*`": _rows(
        ("trainer.total_epochs", "num_epochs", "**verl 30, here 1**"),
        ("trainer.total_training_steps", "max_steps"),
        ("trainer.default_local_dir", "output_dir"),
        (
            "trainer.default_hdfs_dir",
            "remote_dir",
            "any fsspec URL (`s3://`, `gs://`, `hdfs://`, `file://`); a trailing slash changes nothing, and a run "
            "whose output_dir holds no checkpoint, or an older one, resumes from it",
        ),
        ("trainer.project_name", "wandb.project"),
        ("trainer.experiment_name", "wandb.name"),
        (
            "trainer.logger",
            "loggers",
            "`[console, jsonl, tensorboard]` by default; add `wandb` (only global rank 0 logs)",
        ),
        ("trainer.nnodes", (), "`launch/torchrun.sh --nnodes N`: one torchrun program, no Ray"),
        ("trainer.n_gpus_per_node", (), "`launch/torchrun.sh --nproc N`"),
        ("trainer.device", "device"),
        (
            "trainer.save_freq",
            ("save_every", "save_final"),
            "verl's -1 (never) is `save_every=0 save_final=false`; "
            "`save_every=0` alone still saves when the run completes. The HF export is `save_hf`",
        ),
        ("trainer.resume_mode", "resume", "`auto`, `never`, or a checkpoint path (verl's `resume_path`)"),
        ("trainer.resume_from_path", "resume"),
        ("trainer.max_actor_ckpt_to_keep", "keep_last", "**verl keeps all (null), here 2**; `keep_last=0` keeps all"),
        ("trainer.max_critic_ckpt_to_keep", "keep_last", "one setting for the whole run checkpoint"),
        ("trainer.test_freq", "eval_every", "with `data.validation`"),
        ("trainer.val_before_train", "eval_before_train", "true in both"),
        ("trainer.critic_warmup", ()),
        ("trainer.balance_batch", (), "micro-batches are packed to a token budget instead"),
    ),
}

_VERL_SECTIONS = (
    "actor_rollout_ref.",
    "trainer.",
    "custom_reward_function.",
    "reward_model.",
    "critic.model.",
    "critic.optim.",
    "critic.megatron.",
)
"""Key prefixes only verl has: an unknown key under one of them is named as verl's."""


def _lookup(key: str) -> VerlName | None:
    rows = [row for section in VERL_NAMES.values() for row in section]
    exact = next((row for row in rows if row.verl == key), None)
    if exact is not None:
        return exact
    sections = [row for row in rows if row.verl.endswith(".*") and key.startswith(row.verl[:-1])]
    return max(sections, key=lambda row: len(row.verl), default=None)


def verl_key_hint(key: str, known: Collection[str] | None = None) -> str | None:
    """What to say about ``key`` when it is verl's (None: it is not). ``known``: the keys of the
    command's config; a row whose keys here are not among them is another command's (the table is
    ``ppo``'s), and says nothing."""
    row = _lookup(key)
    if (
        row is not None
        and known is not None
        and not all(k in known or any(x.startswith(k + ".") for x in known) for k in row.here)
    ):
        return None
    if row is None:
        if key.startswith(_VERL_SECTIONS):
            return "this is a verl key with no counterpart here (docs/migrating-from-verl.md lists verl's keys)"
        return None
    where = f"verl's {row.verl}" if row.verl.endswith(".*") else "verl's name"
    note = f" ({row.note.replace('**', '')})" if row.note else ""  # the docs' bold is no use on a console
    if not row.here:
        return f"this is {where}; it has no counterpart here{note}"
    return f"this is {where}; here it is {' and '.join(row.here)}{note}"
