"""A save's in-place ``fully_reshardable`` optimizer state (data-parallel group of one) describes the
same checkpoint tensors as megatron's gathered one: same keys, sharding, replica ids, dtype and values."""

from __future__ import annotations

import pytest
import torch


def tiny_train_state(dtype: torch.dtype, tie: bool):
    """A 2-layer Llama's train state that has made no update (no Adam state yet)."""
    from megatron_rlhf.models.architecture import architecture_from_hf_config
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.roles import RoleModel
    from megatron_rlhf.parallel.layout import Layout, parallel_groups
    from megatron_rlhf.training.optim import OptimConfig, make_train_state

    arch = architecture_from_hf_config(
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": tie,
            "vocab_size": 97,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
        }
    )
    groups = parallel_groups(Layout.for_world(1, 1, 1))
    model = build_model(arch, groups, dtype=dtype, device=torch.device("cpu"))
    return make_train_state(
        RoleModel(role="actor", arch=arch, groups=groups, model=model, source=None), OptimConfig(lr=1e-3)
    )


def _train_state(dtype: torch.dtype, tie: bool):
    """``tiny_train_state`` with random parameters and Adam moments."""
    from megatron_rlhf.checkpoint.train_state import _allocate_adam_state

    state = tiny_train_state(dtype, tie)
    _allocate_adam_state(state.optimizer)
    generator = torch.Generator().manual_seed(0)
    for inner in state.optimizer.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                param.data.copy_(torch.randn(param.shape, generator=generator))
                for key in ("exp_avg", "exp_avg_sq"):
                    inner.optimizer.state[param][key].copy_(torch.randn(param.shape, generator=generator))
    return state


@pytest.mark.parametrize("dtype, tie", [(torch.float32, False), (torch.bfloat16, True)])
def test_in_place_state_matches_megatrons(world_of_one, dtype: torch.dtype, tie: bool) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_rlhf.checkpoint.mcore import global_dp_rank_of
    from megatron_rlhf.checkpoint.train_state import OPTIMIZER_FORMAT, _in_place_fully_reshardable

    state = _train_state(dtype, tie)
    (optimizer,) = state.optimizer.chained_optimizers
    assert isinstance(optimizer, DistributedOptimizer)
    metadata = {"dp_cp_group": state.role.groups.pg_collection.dp_cp, **OPTIMIZER_FORMAT}
    with global_dp_rank_of(state.role.groups):
        model_sd = state.role.model.sharded_state_dict(metadata=metadata)
    megatrons = optimizer.sharded_param_state_fully_reshardable(model_sd, is_loading=False, metadata=metadata)
    in_place = _in_place_fully_reshardable(optimizer, model_sd)
    assert in_place is not None and list(in_place) == list(megatrons)
    checked = 0
    for idx, tensors in megatrons.items():
        assert list(in_place[idx]) == list(tensors)
        for key, theirs in tensors.items():
            ours = in_place[idx][key]
            assert type(ours) is type(theirs), theirs.key
            if isinstance(theirs, ShardedTensorFactory):  # e.g. the SwiGLU fc1: compare what it builds
                assert (ours.key, ours.replica_id) == (theirs.key, theirs.replica_id)
                ours, theirs = list(nested_values(ours.build())), list(nested_values(theirs.build()))
            else:
                ours, theirs = [ours], [theirs]
            assert len(ours) == len(theirs)
            for one, other in zip(ours, theirs, strict=True):
                assert isinstance(one, ShardedTensor)
                for field in (
                    "key",
                    "dtype",
                    "local_shape",
                    "global_shape",
                    "global_offset",
                    "axis_fragmentations",
                    "replica_id",
                    "prepend_axis_num",
                    "flattened_range",
                ):
                    assert getattr(one, field) == getattr(other, field), (other.key, field)
                assert torch.equal(one.data, other.data), other.key
                checked += 1
    assert checked >= 3 * len(megatrons)
    # In place: the optimizer's own fp32 main params, no copy.
    main = optimizer.optimizer.param_groups[0]["params"][0]
    assert any(ours["param"].data.data_ptr() == main.data_ptr() for ours in in_place.values())
