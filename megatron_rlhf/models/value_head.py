"""Value head: hidden -> num_labels per token, for critics and reward models.

It takes the place of the LM output layer inside megatron's model, so the model's forward returns
(b, s, num_labels) instead of logits. The weight is small and replicated on every TP rank (the
final hidden states are identical across TP ranks without sequence parallelism), and maps 1:1 to
HF ``*ForSequenceClassification.score``.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed import ProcessGroup


class ValueHead(MegatronModule):
    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup, num_labels: int = 1) -> None:
        super().__init__(config=config)
        self.tp_group = tp_group  # checkpointing marks the replicated weight's copies by TP rank
        self.weight = torch.nn.Parameter(torch.empty(num_labels, config.hidden_size, dtype=config.params_dtype))
        if config.perform_initialization:
            config.init_method(self.weight)

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        """(s, b, h) -> ((s, b, num_labels), None), the output-layer calling convention."""
        return hidden_states @ self.weight.t(), None
