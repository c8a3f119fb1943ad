"""Per-model parallel layouts in one world, through megatron-core's explicit process groups.

Every rank holds a shard of each of the four models (actor, critic, reference, reward), and each
model has its own (tp, pp) layout; dp = world_size / (tp * pp). Groups are built with
``HyperCommGrid`` (rank order tp -> cp -> dp -> pp, megatron's default) and handed to the model as
a ``ProcessGroupCollection``, never through megatron's global ``parallel_state``. Layouts that are
equal share one set of groups, and groups are created once per process: switching models or
phases never creates new ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from megatron_rlhf.parallel.distributed import dist_timeout

if TYPE_CHECKING:  # imported where groups are made: a config's layout checks import no megatron
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclasses.dataclass(frozen=True)
class Layout:
    """A model's parallel layout. ``dp`` is derived from the world size."""

    tp: int
    pp: int
    dp: int

    @classmethod
    def for_world(cls, tp: int, pp: int, world_size: int) -> Layout:
        if tp < 1 or pp < 1:
            raise ValueError(f"tp={tp} and pp={pp} must both be >= 1")
        if world_size % (tp * pp):
            raise ValueError(f"tp*pp={tp * pp} must divide the world size {world_size}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    def __str__(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp}"


class ModelShape(Protocol):
    """The sizes a layout must divide (``models.architecture.Architecture`` has them), read-only:
    the frozen ``Architecture`` matches."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_query_groups(self) -> int: ...

    @property
    def ffn_hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...


def layout_errors(
    key: str, tp: int, pp: int, shape: ModelShape, world_size: int, *, pipeline: bool = True
) -> list[str]:
    """Rules a (tp, pp) layout must satisfy for a model of ``shape`` in a world of ``world_size`` ranks.

    Messages name the settings ``key.tp``/``key.pp``, or ``tp``/``pp`` when ``key`` is empty (top-level
    settings, ``convert``'s). ``pipeline=False`` is a layout that has no pipeline setting (generation:
    ``pp`` is 1 and only ``key.tp`` is named).
    """
    tp_name, pp_name = (f"{key}.tp", f"{key}.pp") if key else ("tp", "pp")
    if not pipeline:
        if tp < 1:
            return [f"{tp_name}={tp} must be >= 1"]
    elif tp < 1 or pp < 1:
        return [f"{tp_name}={tp} and {pp_name}={pp} must both be >= 1"]
    errors = []
    if world_size % (tp * pp):
        product = f"{tp_name}*{pp_name}" if pipeline else tp_name
        errors.append(f"{product}={tp * pp} must divide the world size {world_size}")
    for field, value in (
        ("num_attention_heads", shape.num_attention_heads),
        ("num_key_value_heads", shape.num_query_groups),
        ("intermediate_size", shape.ffn_hidden_size),
    ):
        if value % tp:
            errors.append(f"{tp_name}={tp} must divide {field}={value}")
    if shape.num_layers % pp:
        errors.append(f"{pp_name}={pp} must divide num_hidden_layers={shape.num_layers}")
    return errors


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one layout, and this rank's coordinates in it."""

    layout: Layout
    pg_collection: ProcessGroupCollection
    grid: HyperCommGrid

    @property
    def tp_rank(self) -> int:
        return self.pg_collection.tp.rank()

    @property
    def pp_rank(self) -> int:
        return self.pg_collection.pp.rank()

    @property
    def dp_rank(self) -> int:
        return self.pg_collection.dp.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


_GROUPS_BY_LAYOUT: dict[Layout, ParallelGroups] = {}
_SINGLETON: list[dist.ProcessGroup] = []


def _singleton_group() -> dist.ProcessGroup:
    """This rank alone (created once, collectively, on first use)."""
    if not _SINGLETON:
        group, _ = dist.new_subgroups_by_enumeration(
            [[rank] for rank in range(dist.get_world_size())], timeout=dist_timeout()
        )
        _SINGLETON.append(group)
    return _SINGLETON[0]


def _embedding_groups(grid: HyperCommGrid) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Groups of the first and last pipeline stage (tied embeddings) and of the first stage."""
    pp_rank_lists = grid.get_rank_enum("pp")
    embd, _ = dist.new_subgroups_by_enumeration(
        [sorted({ranks[0], ranks[-1]}) for ranks in pp_rank_lists], timeout=dist_timeout()
    )
    pos_embd, _ = dist.new_subgroups_by_enumeration([[ranks[0]] for ranks in pp_rank_lists], timeout=dist_timeout())
    return embd, pos_embd


def parallel_groups(layout: Layout) -> ParallelGroups:
    """The groups for ``layout``, created collectively on first use and cached.

    Must be called on every rank in the same order (group creation is collective).
    """
    if layout in _GROUPS_BY_LAYOUT:
        return _GROUPS_BY_LAYOUT[layout]
    if dist.get_world_size() != layout.tp * layout.pp * layout.dp:
        raise ValueError(f"layout {layout} does not match the world size {dist.get_world_size()}")
    from megatron.core import parallel_state
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([layout.tp, 1, layout.dp, layout.pp], ["tp", "cp", "dp", "pp"])
    create = functools.partial(grid.create_pg, timeout=dist_timeout())
    groups = {
        "tp": create("tp"),
        "cp": create("cp"),
        "dp": create("dp"),
        "pp": create("pp"),
        "mp": create(["tp", "pp"]),
        "tp_cp": create(["tp", "cp"]),
        "dp_cp": create(["cp", "dp"]),
        "tp_dp_cp": create(["tp", "cp", "dp"]),
    }
    groups["embd"], groups["pos_embd"] = _embedding_groups(grid)
    # Dense models have no experts: expert parallelism is 1, and the expert groups megatron's DDP and
    # optimizer code asks for are the dense ones. One distributed-optimizer instance spans dp_cp.
    groups["ep"] = _singleton_group()
    groups["expt_tp"] = groups["tp"]
    groups["expt_dp"] = groups["dp"]
    groups["tp_ep_pp"] = groups["mp"]
    groups["intra_dp_cp"] = groups["dp_cp"]
    # The distributed optimizer's gradient-norm group spans every rank of the (single) optimizer
    # instance: all of tp x cp x dp x pp.
    groups["intra_dist_opt"] = create(["tp", "cp", "dp", "pp"])
    pg_collection = ProcessGroupCollection(**groups)
    result = ParallelGroups(layout=layout, pg_collection=pg_collection, grid=grid)
    _GROUPS_BY_LAYOUT[layout] = result
    # The local attention/TP mappings allocate from megatron's global scratch buffer even when
    # process groups are explicit.
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    return result
