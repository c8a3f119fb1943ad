"""``megatron-rlhf smoke``'s configuration and its check, apart from the run (``smoke.py``) so that
reading and checking a config imports no megatron-core."""

from __future__ import annotations

import dataclasses

from megatron_rlhf.checkpoint.sources import ModelsConfig, role_errors
from megatron_rlhf.config.loader import config_errors, raise_if_errors
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.roles import ROLES


@dataclasses.dataclass(kw_only=True)
class SmokeConfig(ModelsConfig):
    """``megatron-rlhf smoke``: the four models and their layouts."""


def check_smoke_config(cfg: SmokeConfig, world_size: int) -> dict[str, Architecture]:
    """Every problem at once (``ConfigError``); returns the four models' architectures."""
    errors, archs = role_errors(cfg, ROLES, world_size)
    raise_if_errors(config_errors(cfg) + cfg.output_dir_errors() + errors)
    return archs
