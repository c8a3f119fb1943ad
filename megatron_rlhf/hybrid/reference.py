"""The reference model following the actor during RL (``reference.update``).

A fixed reference anchors the KL term to the initial policy for the whole run; refreshing it lets
the actor move further while the KL still keeps each stretch of the run close to a recent policy.
``ReferenceUpdater.after_step`` runs right after the actor's update of every RL step:

* ``none``: the reference keeps the weights it was loaded with (no updater is made).
* ``periodic``: after every ``update_every``-th step the reference becomes an exact copy of the
  actor; in between it does not change.
* ``ema``: after every step, ``ref <- ema_decay * ref + (1 - ema_decay) * actor``.

Precision: the reference keeps its own dtype (the run's). Each EMA step reads the reference's and
the actor's parameters as stored (the actor's model weights, not the optimizer's float32 main
copy), computes the mix in float32 and rounds it once to the reference's dtype. In float32 runs
that is the float32 recurrence. In bf16 runs the state itself is bf16: a weight whose change
``(1 - ema_decay) * (actor - ref)`` is below half a bf16 step of ``ref`` (about 2**-9 of its size)
does not move, so with ``ema_decay`` close to 1 the reference lags more than the exact recurrence
(there is no float32 shadow copy).

Layouts: when the reference's layout (``reference.tp/pp``) equals the actor's, each rank mixes
its own shards directly (no copy, no extra memory beyond float32 temporaries of one parameter).
Otherwise the actor's weights are first brought into the reference's layout by a ``LayoutCopy``
(``hybrid/reshard.py``, megatron's resharding): a scratch model of the reference's layout built
once, whose weights (the reference's bytes per rank) exist only during the update. The reference
is built with the actor's padded vocabulary (``reference_vocab_pad_multiple``) so that every shard
of the two has the same shape.
"""

from __future__ import annotations

import torch

from megatron_rlhf.hybrid.config import ReferenceConfig
from megatron_rlhf.hybrid.reshard import LayoutCopy
from megatron_rlhf.models.architecture import VOCAB_PAD_MULTIPLE, matching_vocab_pad_multiple
from megatron_rlhf.models.roles import RoleModel


def reference_vocab_pad_multiple(cfg: ReferenceConfig, actor: RoleModel) -> int:
    """The reference's vocabulary padding: the actor's padded size when it follows the actor (the
    copy needs equal shards in any layout), else the default one."""
    if cfg.update == "none":
        return VOCAB_PAD_MULTIPLE
    return matching_vocab_pad_multiple(actor.arch.vocab_size, actor.padded_vocab_size, cfg.tp)


class ReferenceUpdater:
    """Moves ``reference`` towards ``actor`` after each RL step, as ``cfg.update`` says.

    Collective: construct it, and call ``after_step``, on every rank in the same order.
    """

    def __init__(self, actor: RoleModel, reference: RoleModel, cfg: ReferenceConfig) -> None:
        if cfg.update not in ("periodic", "ema"):
            raise ValueError(f"reference.update={cfg.update!r}: only periodic and ema change the reference")
        if actor.arch != reference.arch or actor.padded_vocab_size != reference.padded_vocab_size:
            raise ValueError(
                f"the reference ({reference.arch.hf_class_name}, padded vocab {reference.padded_vocab_size}) "
                f"must have the actor's architecture and padded vocab ({actor.padded_vocab_size}) "
                "to follow it"
            )
        self.cfg = cfg
        self.actor_copy = LayoutCopy(actor, reference.groups.layout)
        ours = list(reference.model.named_parameters())
        theirs = list(self.actor_copy.target.model.named_parameters())
        if [(n, p.shape) for n, p in ours] != [(n, p.shape) for n, p in theirs]:
            raise ValueError("the reference's parameters do not match the actor's in the reference's layout")
        self._pairs = [(ref, act) for (_, ref), (_, act) in zip(ours, theirs, strict=True)]

    def after_step(self, step: int) -> bool:
        """Update the reference after the actor update of RL step ``step`` (1-based); returns
        whether it changed it."""
        if self.cfg.update == "periodic" and step % self.cfg.update_every:
            return False
        self.actor_copy.refresh()
        decay = self.cfg.ema_decay
        with torch.no_grad():
            for ref, actor in self._pairs:
                if self.cfg.update == "periodic":
                    ref.copy_(actor)
                else:
                    mixed = ref.float() * decay
                    ref.copy_(mixed.add_(actor.float(), alpha=1 - decay))
        self.actor_copy.release()
        return True

    @property
    def description(self) -> str:
        """How the reference follows the actor, for the run's log."""
        how = (
            f"every {self.cfg.update_every} steps"
            if self.cfg.update == "periodic"
            else f"ema decay {self.cfg.ema_decay}"
        )
        layout = self.actor_copy.layout
        where = "same layout as the actor" if self.actor_copy.zero_copy else f"actor resharded into {layout}"
        return f"reference update: {self.cfg.update}, {how} ({where})"
