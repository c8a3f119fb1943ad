"""Up-front checks of a ``RunConfig`` against the world size and the models it names.

Every problem is reported at start-up, all at once, as ``key=value`` and the rule it breaks,
instead of surfacing later as a stack trace deep inside megatron.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.config.schema import ROLES, RunConfig
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builder import DTYPES
from megatron_rlhf.models.sources import architecture_of
from megatron_rlhf.parallel.distributed import DEVICES

# Which head each role needs: the policy-like roles generate tokens, the others score them.
_NEEDS_SCORE_HEAD = {"actor": False, "reference": False, "critic": True, "reward": True}


def layout_errors(
    key: str, tp: int, pp: int, arch: Architecture, world_size: int, *, as_flags: bool = False
) -> list[str]:
    """Rules a (tp, pp) layout must satisfy for ``arch`` in a world of ``world_size`` ranks.

    Messages name the settings ``key.tp``/``key.pp``, or ``--tp``/``--pp`` for command-line flags.
    """
    tp_name, pp_name = ("--tp", "--pp") if as_flags else (f"{key}.tp", f"{key}.pp")
    errors = []
    if tp < 1 or pp < 1:
        return [f"{tp_name}={tp} and {pp_name}={pp} must both be >= 1"]
    if world_size % (tp * pp):
        errors.append(f"{tp_name}*{pp_name}={tp * pp} must divide the world size {world_size}")
    for field, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_query_groups),
        ("intermediate_size", arch.ffn_hidden_size),
    ):
        if value % tp:
            errors.append(f"{tp_name}={tp} must divide {field}={value}")
    if arch.num_layers % pp:
        errors.append(f"{pp_name}={pp} must divide num_hidden_layers={arch.num_layers}")
    return errors


def validate_roles(cfg: RunConfig, world_size: int, roles: Sequence[str] = ROLES) -> tuple[list[str], dict[str, Architecture]]:
    """The problems of the run-wide fields and of the models ``roles``, and those models' architectures."""
    errors: list[str] = []
    if cfg.device not in DEVICES:
        errors.append(f"device={cfg.device!r} must be one of {list(DEVICES)}")
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        errors.append(f"dtype={cfg.dtype!r} must be one of {['auto', *DTYPES]}")
    archs: dict[str, Architecture] = {}
    for role in roles:
        model = cfg.role(role)
        try:
            arch = architecture_of(model.path)
        except (ValueError, FileNotFoundError) as err:
            errors.append(f"{role}.path={model.path!r}: {err}")
            continue
        archs[role] = arch
        errors += [f"{e} (model {model.path})" for e in layout_errors(role, model.tp, model.pp, arch, world_size)]
        if arch.score_head != _NEEDS_SCORE_HEAD[role]:
            need = "a *ForSequenceClassification (score head)" if _NEEDS_SCORE_HEAD[role] else "a *ForCausalLM"
            errors.append(f"{role}.path={model.path!r} is a {arch.hf_class_name}; the {role} needs {need} model")
    return errors, archs


def validate(cfg: RunConfig, world_size: int) -> dict[str, Architecture]:
    """Check ``cfg``; returns each role's architecture. Raises ``ConfigError`` listing every problem."""
    errors, archs = validate_roles(cfg, world_size)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return archs
