"""YAML presets + dotlist overrides -> a typed ``RunConfig``, with errors that name the key.

Unknown keys are refused with the closest valid key suggested; values of the wrong type name the
key, the value and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megatron_rlhf.config.schema import RunConfig

PRESET_DIR = Path(__file__).parent / "presets"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the rule."""


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _resolve_preset(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        return path
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if not preset.is_file():
        raise ConfigError(f"unknown preset '{name_or_path}'; available presets: {presets()} (or pass a .yaml path)")
    return preset


def _fields_at(dotted_key: str, schema: type) -> list[str]:
    """Valid field names of the dataclass that ``dotted_key``'s last component belongs to."""
    cls: Any = schema
    for part in dotted_key.split(".")[:-1]:
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return []
        cls = hints[part]
    return [f.name for f in dataclasses.fields(cls)]


def _unknown_key_error(full_key: str, origin: str, schema: type) -> ConfigError:
    parent, _, leaf = full_key.rpartition(".")
    valid = _fields_at(full_key, schema)
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f"; did you mean '{parent + '.' if parent else ''}{close[0]}'?" if close else ""
    return ConfigError(f"{origin}: unknown key '{full_key}'{hint} (valid keys here: {valid})")


def _merge(base: Any, update: Any, origin: str, schema: type) -> Any:
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as err:
        raise _unknown_key_error(err.full_key or str(err.key), origin, schema) from None
    except ValidationError as err:
        reason = (err.msg or str(err)).splitlines()[0]
        raise ConfigError(f"{origin}: {err.full_key}={err.value!r} is not valid: {reason}") from None
    except (OmegaConfBaseException, TypeError) as err:  # TypeError: e.g. a YAML list at the top level
        raise ConfigError(f"{origin}: {str(err).splitlines()[0]}") from None


def load_config(
    preset: str | None = None, overrides: list[str] | tuple[str, ...] = (), schema: type[T] = RunConfig
) -> T:
    """Schema defaults <- preset or YAML file <- dotlist overrides, in that order.

    ``schema`` is the dataclass of the command (the RLHF run by default; SFT and RM have their own).
    """
    merged = OmegaConf.structured(schema)
    if preset is not None:
        path = _resolve_preset(preset)
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as err:  # yaml errors come in several types
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        merged = _merge(merged, file_cfg, str(path), schema)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        merged = _merge(merged, OmegaConf.from_dotlist([item]), f"override '{item}'", schema)
    try:
        return OmegaConf.to_object(merged)
    except ValueError as err:  # a component's own check in __post_init__ (e.g. optim.lr <= 0)
        raise ConfigError(f"invalid configuration: {err}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
