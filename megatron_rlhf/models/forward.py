"""Forward-only passes through megatron-core's pipeline schedules, for any TP/PP layout.

Shapes: input_ids (B, S); logits (B, S, V) over the real vocabulary (TP shards gathered, vocab
padding stripped); values (B, S, num_labels). Results exist on the last pipeline stage only; other
stages get None.
"""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_rlhf.models.roles import RoleModel


@torch.no_grad()
def forward_outputs(role_model: RoleModel, input_ids: torch.Tensor, micro_batch_size: int) -> torch.Tensor | None:
    """The model's outputs for every sequence: logits for LM heads, values for score heads."""
    model, groups, arch = role_model.model, role_model.groups, role_model.arch
    pg = groups.pg_collection
    batch, seq_len = input_ids.shape
    if batch % micro_batch_size:
        raise ValueError(f"batch size {batch} is not a multiple of micro_batch_size={micro_batch_size}")
    device = next(model.parameters()).device
    micro_batches = iter(input_ids.to(device).split(micro_batch_size))
    positions = torch.arange(seq_len, device=device).expand(micro_batch_size, seq_len)

    def forward_step(data_iterator, chunk):
        return chunk(next(data_iterator), positions, None), None

    was_training = model.training
    model.eval()
    outputs = get_forward_backward_func(pp_size=groups.layout.pp)(
        forward_step_func=forward_step,
        data_iterator=micro_batches,
        model=[model],
        num_microbatches=batch // micro_batch_size,
        seq_length=seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=True,
        p2p_communicator=P2PCommunicator(pp_group=pg.pp, config=model.config),
        pg_collection=pg,
    )
    model.train(was_training)
    if not groups.is_last_stage:
        return None
    out = torch.cat(outputs)
    if arch.score_head:
        return out
    return gather_from_tensor_model_parallel_region(out, group=pg.tp)[..., : arch.vocab_size]
