"""The four models of a run (actor, critic, reference, reward) and what one built model bundles.

A ``RoleModel`` holds what every later stage needs of one model: its architecture, its process
groups and this rank's shard. It is made by ``checkpoint.sources.build_role``, which reads the
weights too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.parallel.layout import ParallelGroups

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

ROLES = ("actor", "critic", "reference", "reward")
NEEDS_SCORE_HEAD = {"actor": False, "reference": False, "critic": True, "reward": True}
"""Which head each role needs: the policy-like roles generate tokens, the others score them."""
HEAD_FROM_LM = frozenset({"critic"})
"""Roles that may start from a causal LM with a new score head (the critic from the SFT policy, as
usual); the reward model may not: an untrained head would score at random."""


@dataclasses.dataclass
class RoleModel:
    role: str
    arch: Architecture
    groups: ParallelGroups
    model: GPTModel
    source: Path
    """The local directory the weights were read from (tokenizer files live there too)."""
    hub_id: str | None = None
    """The Hugging Face hub id whose cached snapshot ``source`` is (None: a directory or builtin
    model): what a LoRA adapter's export names as its base, which a cache path on this machine
    would not be on another."""

    @property
    def padded_vocab_size(self) -> int:
        return self.model.vocab_size
