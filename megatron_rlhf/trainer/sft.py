"""``megatron-rlhf sft``: supervised fine-tuning of a causal LM on prompt -> response rows, or on
conversations (``data.messages_key``).

The loss is the next-token NLL of the response tokens (and EOS), or of the assistant messages',
token-mean over the global batch (``sft_loss``); the prompt, and every other message, is context
only. Validation, when given, reports the same token-mean NLL (and its perplexity) over the whole
validation set.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rlhf.data import SFTDataset, Tokenizer, load_sft_dataset, pack_batch
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.roles import RoleModel
from megatron_rlhf.parallel.distributed import DistEnv
from megatron_rlhf.trainer.loop import run_loop
from megatron_rlhf.trainer.supervised import (
    SupervisedTask,
    dp_shard,
    reduce_over_model,
    set_up_run,
)
from megatron_rlhf.trainer.supervised_config import SFTConfig, SFTDataConfig
from megatron_rlhf.training.objectives import logprobs_output, sft_loss
from megatron_rlhf.training.schedule import logits_only_at
from megatron_rlhf.training.train import forward_pass


def _load(paths: list[str], tokenizer: Tokenizer, data: SFTDataConfig, what: str) -> SFTDataset:
    dataset, report = load_sft_dataset(
        paths,
        tokenizer,
        max_length=data.max_length,
        on_overlong=data.on_overlong,
        on_invalid=data.on_invalid,
        prompt_key=data.prompt_key,
        response_key=data.response_key,
        messages_key=data.messages_key,
        add_bos=data.add_bos,
        **data.chat_options(),
        num_workers=data.num_workers,
    )
    log(f"{what} data: {report.summary()}")
    return dataset


def validation_nll(
    role: RoleModel, dataset: SFTDataset, pad_id: int, *, chunk: int, max_tokens: int, pack: bool, device: torch.device
) -> dict[str, float]:
    """Token-mean NLL of the response tokens over the whole set (forward only, sharded over DP)."""
    indices, real = dp_shard(len(dataset), role.groups.dp_rank, role.groups.layout.dp)
    nll_sum, tokens = 0.0, 0.0
    for start in range(0, len(indices), chunk):
        part, keep = indices[start : start + chunk], real[start : start + chunk]
        batch = logits_only_at(pack_batch([dataset[i] for i in part], pad_id), "loss_mask")
        logprobs = forward_pass(
            role, batch, logprobs_output(role), max_tokens_per_micro_batch=max_tokens, pack_sequences=pack
        )
        if logprobs is None:
            continue
        mask = batch["loss_mask"].to(logprobs.device).float() * torch.tensor(keep, device=logprobs.device)[:, None]
        width = logprobs.shape[1]
        nll_sum += -(logprobs * mask[:, :width]).sum().item()
        tokens += mask.sum().item()
    nll_sum, tokens = reduce_over_model(role, [nll_sum, tokens], device)
    nll = nll_sum / max(tokens, 1.0)
    figures = (nll, math.exp(min(nll, 50.0)), int(tokens), len(dataset))
    return dict(zip(SFTConfig.VALIDATION_FIGURES, figures, strict=True))


def run_sft(cfg: SFTConfig, env: DistEnv, checked: Architecture | None = None) -> dict[str, Any]:
    """Train; returns the summary. ``checked``: what ``check_config`` returned for this config and
    world size, when the caller ran it (else set-up runs it)."""
    run = set_up_run(cfg, env, name="sft", role="actor", score_head=False, load=_load, arch=checked)
    role, train, validation, pad_id = run.role, run.train, run.validation, run.tokenizer.pad_id
    lengths = train.lengths
    per_rank = cfg.global_batch_size // role.groups.layout.dp

    def evaluate() -> dict[str, float]:
        assert validation is not None
        return validation_nll(
            role,
            validation,
            pad_id,
            chunk=per_rank,
            max_tokens=cfg.max_tokens_per_micro_batch,
            pack=cfg.pack_sequences,
            device=env.device,
        )

    task = SupervisedTask(
        name="sft",
        cfg=cfg,
        run=run,
        tokens_of=lambda idx: int(lengths[list(idx)].sum()),
        make_batch=lambda idx: logits_only_at(pack_batch([train[i] for i in idx], pad_id), "loss_mask"),
        loss_fn=sft_loss(role),
        group_size=1,
        figures=evaluate if validation is not None else None,
    )
    return run_loop(cfg, task, run.claim)
