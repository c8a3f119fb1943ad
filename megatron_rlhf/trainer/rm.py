"""``megatron-rlhf rm``: reward-model training on preference pairs (Bradley-Terry).

The model is a ``*ForSequenceClassification`` (score head); the reward of a sequence is the score
at its last real token (the EOS the data loader appends, or a conversation's last stop token).
The loss is -log sigmoid(r_chosen - r_rejected), mean over the pairs of the global batch.
Validation reports preference accuracy (r_chosen > r_rejected; ties count as wrong), the mean loss
and the mean margin over the whole validation set.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rlhf.checkpoint.export import with_token_ids
from megatron_rlhf.data import PreferenceDataset, Tokenizer, load_preference_dataset, pack_batch
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
from megatron_rlhf.trainer.supervised_config import PreferenceDataConfig, RMConfig
from megatron_rlhf.training.objectives import bradley_terry_loss, score_positions, values_output
from megatron_rlhf.training.schedule import Batch
from megatron_rlhf.training.train import forward_pass


def _load(paths: list[str], tokenizer: Tokenizer, data: PreferenceDataConfig, what: str) -> PreferenceDataset:
    dataset, report = load_preference_dataset(
        paths,
        tokenizer,
        max_length=data.max_length,
        on_overlong=data.on_overlong,
        on_invalid=data.on_invalid,
        prompt_key=data.prompt_key,
        chosen_key=data.chosen_key,
        rejected_key=data.rejected_key,
        add_bos=data.add_bos,
        **data.chat_options(),
        num_workers=data.num_workers,
    )
    log(f"{what} data: {report.summary()}")
    return dataset


def adjacent_pairs(batch: Batch) -> Batch:
    """``pack_batch``'s preference layout (all chosen rows, then all rejected rows) -> rows ordered
    chosen, rejected, chosen, rejected, ... as ``bradley_terry_loss`` and ``group_size=2`` expect."""
    n = batch["input_ids"].shape[0] // 2
    order = torch.stack([torch.arange(n), torch.arange(n) + n], dim=1).reshape(-1)
    paired = {key: value[order] for key, value in batch.items()}
    if not (
        bool(paired["is_chosen"][0::2].all())
        and not bool(paired["is_chosen"][1::2].any())
        and torch.equal(paired["pair_index"][0::2], paired["pair_index"][1::2])
    ):
        raise AssertionError("internal error: pack_batch's preference layout is not chosen rows then rejected rows")
    return paired


def preference_accuracy(
    role: RoleModel,
    dataset: PreferenceDataset,
    pad_id: int,
    score_pad_id: int,
    *,
    chunk: int,
    max_tokens: int,
    pack: bool,
    device: torch.device,
) -> dict[str, float]:
    """Accuracy, Bradley-Terry loss and margin over the whole set (forward only, sharded over DP); rows
    padded with ``pad_id``, scored as ``bradley_terry_loss(score_pad_id)`` scores them."""
    indices, real = dp_shard(len(dataset), role.groups.dp_rank, role.groups.layout.dp)
    correct = loss = margin = count = 0.0
    for start in range(0, len(indices), chunk):
        part, keep = indices[start : start + chunk], real[start : start + chunk]
        batch = pack_batch([dataset[i] for i in part], pad_id)  # rows: chosen..., rejected...
        scores = forward_pass(role, batch, values_output(), max_tokens_per_micro_batch=max_tokens, pack_sequences=pack)
        if scores is None:  # not the last pipeline stage
            continue
        last = score_positions(batch["input_ids"], batch["attention_mask"].sum(dim=1), score_pad_id).to(scores.device)
        rewards = scores[torch.arange(scores.shape[0], device=scores.device), last].double()
        n = len(part)
        diff = rewards[:n] - rewards[n:]
        weight = torch.tensor(keep, dtype=torch.float64, device=diff.device)
        correct += ((diff > 0).double() * weight).sum().item()
        loss += (-F.logsigmoid(diff) * weight).sum().item()
        margin += (diff * weight).sum().item()
        count += weight.sum().item()
    correct, loss, margin, count = reduce_over_model(role, [correct, loss, margin, count], device)
    count = max(count, 1.0)
    figures = (correct / count, loss / count, margin / count, int(count))
    return dict(zip(RMConfig.VALIDATION_FIGURES, figures, strict=True))


def run_rm(cfg: RMConfig, env: DistEnv, checked: Architecture | None = None) -> dict[str, Any]:
    """Train; returns the summary. ``checked``: what ``check_config`` returned for this config and
    world size, when the caller ran it (else set-up runs it)."""
    run = set_up_run(cfg, env, name="rm", role="reward", score_head=True, load=_load, arch=checked)
    role, train, validation, pad_id = run.role, run.train, run.validation, run.tokenizer.pad_id
    # The pad id the export writes (export.with_token_ids): the model is trained where transformers
    # will read its score.
    score_pad_id = int(with_token_ids(role.arch, run.tokenizer)[0].hf_config["pad_token_id"])
    if score_pad_id == run.tokenizer.eos_id:
        log(
            f"the reward model's pad id {score_pad_id} is its EOS (the tokenizer has no pad token of its own): a row "
            "is scored at its last token before a closing EOS, where transformers reads a model with that pad id"
        )
    lengths = train.lengths  # (N, 2)
    per_rank = cfg.global_batch_size // role.groups.layout.dp

    def evaluate() -> dict[str, float]:
        assert validation is not None
        return preference_accuracy(
            role,
            validation,
            pad_id,
            score_pad_id,
            chunk=per_rank,
            max_tokens=cfg.max_tokens_per_micro_batch,
            pack=cfg.pack_sequences,
            device=env.device,
        )

    task = SupervisedTask(
        name="rm",
        cfg=cfg,
        run=run,
        tokens_of=lambda idx: int(lengths[list(idx)].sum()),
        make_batch=lambda idx: adjacent_pairs(pack_batch([train[i] for i in idx], pad_id)),
        loss_fn=bradley_terry_loss(score_pad_id),
        group_size=2,
        figures=evaluate if validation is not None else None,
        extra_headline=("accuracy", "margin"),
    )
    return run_loop(cfg, task, run.claim)
