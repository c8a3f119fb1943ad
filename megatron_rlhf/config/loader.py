"""YAML presets + dotlist overrides -> a command's typed config, with errors that name the key.

Unknown keys are refused with the closest valid key suggested: a key of the same name in another
section (``actor.lr`` -> ``actor_optim.lr``), else a near spelling, and verl's names with this
project's (``config/verl_names.py``); values of the wrong type name the key, the value and the
expected type (a list given without brackets gets the bracketed spelling), and a value outside a
``Literal`` field's choices names the choices and the closest one. Advice is written as the
``key=value`` settings of the command line. Values are then checked by the command:
``config_errors`` collects every dataclass's own ``errors()`` with its full key, the command adds
the rules that span sections, and ``raise_if_errors`` reports all of them at once.

``load_config_with_sources`` also says where each setting that differs from the library default
came from (a preset, a config file, the command line), for the start-up report: a preset's values
never reach a run unannounced.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from megatron_rlhf.config.fields import building_tree, choice_errors, literal_choices, not_a_choice
from megatron_rlhf.config.verl_names import verl_key_hint

PRESET_DIR = Path(__file__).parent / "presets"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the rule."""


def raise_if_errors(errors: list[str]) -> None:
    """One ``ConfigError`` listing every problem, one per line (nothing when there are none)."""
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def config_errors(cfg: Any, prefix: str = "", *, unused: Collection[str] = ()) -> list[str]:
    """The ``errors()`` of every dataclass in the tree ``cfg``, each prefixed with its dotted key.

    ``unused`` names sections of ``cfg`` the command will not use (the critic's optimizer of a run
    without a critic): they are not checked.
    """
    own = choice_errors(cfg) + (cfg.errors() if hasattr(cfg, "errors") else [])
    errors = [prefix + message for message in own]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value) and field.name not in unused:
            errors += config_errors(value, f"{prefix}{field.name}.")
    return errors


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


def _section_of(dotted_key: str, schema: type) -> type | None:
    """The dataclass that ``dotted_key``'s last component belongs to (None: not a section's key)."""
    cls = schema
    for part in dotted_key.split(".")[:-1]:
        section = typing.get_type_hints(cls).get(part)
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
            return None
        cls = section
    return cls


def _fields_at(dotted_key: str, schema: type) -> list[str]:
    """Valid field names of the dataclass that ``dotted_key``'s last component belongs to."""
    cls = _section_of(dotted_key, schema)
    return [f.name for f in dataclasses.fields(cls)] if cls is not None else []


def _field_type(dotted_key: str, schema: type) -> Any:
    """The annotated type of the field ``dotted_key`` (None: not a field of a section)."""
    cls = _section_of(dotted_key, schema)
    return typing.get_type_hints(cls).get(dotted_key.rpartition(".")[2]) if cls else None


def _choices_of(dotted_key: str, schema: type) -> tuple[object, ...] | None:
    """The choices of ``dotted_key`` when it is a ``Literal`` field, else None."""
    return literal_choices(_field_type(dotted_key, schema))


def _is_section(dotted_key: str, schema: type) -> bool:
    kind = _field_type(dotted_key.lstrip("."), schema)
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _is_list_field(dotted_key: str, schema: type) -> bool:
    kind = _field_type(dotted_key, schema)
    return kind is list or typing.get_origin(kind) in (list, tuple)


def _same_name_elsewhere(key: str, schema: type) -> list[str]:
    """The keys of ``schema`` whose last part is ``key``'s, the most alike first (``actor.lr``:
    ``actor_optim.lr``, then ``critic_optim.lr``)."""
    leaf = key.rpartition(".")[2]
    same_leaf = [k for k in library_defaults(schema) if k.rpartition(".")[2] == leaf]
    return sorted(same_leaf, key=lambda k: -difflib.SequenceMatcher(None, key, k).ratio())


def _unknown_key_error(
    full_key: str, origin: str, schema: type, update: Any = None, override: str | None = None
) -> ConfigError:
    """Names ``full_key`` (the first unknown part of a key) and the key meant: for a key of
    ``update`` under it that is verl's, this project's name for it; else a key of the same name in a
    subsection of its section; else the closest key in its section; else a key of the same name in
    another section (``actor.lr`` -> ``actor_optim.lr``).
    For the command line's ``override``, the setting to write."""
    given = _leaves(_plain(update)) if isinstance(update, DictConfig) else {}
    under = [k for k in given if k == full_key or k.startswith(full_key + ".")]
    for key in under:
        verl_hint = verl_key_hint(key, library_defaults(schema).keys())
        if verl_hint:
            return ConfigError(f"{origin}: unknown key '{key}': {verl_hint}")
    given_key = under[0] if under else full_key
    parent, _, leaf = full_key.rpartition(".")
    valid = _fields_at(full_key, schema)
    # A value is never meant for a section (actor.lr is not actor.lora, it is actor_optim.lr).
    alike = valid if given_key != full_key else [k for k in valid if not _is_section(f"{parent}.{k}", schema)]
    close = difflib.get_close_matches(leaf, alike, n=1)
    same_name = _same_name_elsewhere(given_key, schema)
    # A key that moved into a subsection (rollout.max_batch_size -> rollout.engine.max_batch_size).
    below = [k for k in same_name if parent and k.startswith(parent + ".")]
    if below:
        meant = below + [k for k in same_name if k not in below]
    elif close:
        meant = [(parent + "." if parent else "") + close[0] + given_key[len(full_key) :]]
    else:
        meant = same_name
    hint = ""
    if meant:
        setting = f"{meant[0]}={override.partition('=')[2]}" if override is not None else f"'{meant[0]}'"
        others = f" (or {', '.join(meant[1:])})" if len(meant) > 1 else ""
        hint = f"; did you mean {setting}?{others}"
    return ConfigError(f"{origin}: unknown key '{full_key}'{hint} (valid keys here: {valid})")


def _not_a_list_error(key: str, value: Any, origin: str, override: str | None) -> ConfigError:
    """A list setting given one value: the bracketed spelling (``data.train=[train.jsonl]``)."""
    fix = f"write {key}=[{value}]" if override is not None else f"write it as a list, [{value}]"
    return ConfigError(f"{origin}: {key}={value!r} is not valid: {key} is a list; {fix}")


def _check_sections(update: Mapping[Any, Any], cls: type, origin: str, prefix: str = "") -> None:
    """A value where the schema has a section (``rollout=5``, ``rollout: 5`` in a YAML file) is
    named here: OmegaConf's merge reports it without its key. So is a number other than 0 or 1 for a
    true/false key, which the merge reads as true (``save_hf=2`` is no save interval)."""
    hints = typing.get_type_hints(cls)
    for key, value in update.items():
        section = hints.get(key)
        if section in (bool, bool | None) and type(value) is int and value not in (0, 1):
            raise ConfigError(f"{origin}: {prefix}{key}={value} is not valid: {prefix}{key} is true or false")
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
            continue  # unknown keys and other plain values are the merge's to check
        if isinstance(value, Mapping):
            _check_sections(value, section, origin, f"{prefix}{key}.")
            continue
        names = [f.name for f in dataclasses.fields(section)]
        verl_hint = verl_key_hint(f"{prefix}{key}")
        raise ConfigError(
            f"{origin}: {prefix}{key}={value!r} is not valid: {prefix}{key} is a section (keys {names}), "
            f"not a single value; set its keys, e.g. {prefix}{key}.{names[0]}=..."
            + (f" ({prefix}{key} is also verl's key: {verl_hint})" if verl_hint else "")
        )


def _plain(cfg: DictConfig, *, resolve: bool = False) -> dict[str, Any]:
    """``cfg`` as plain nested dicts and lists (OmegaConf types the result as any container)."""
    return typing.cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=resolve))


def _merge(base: Any, update: Any, origin: str, schema: type, override: str | None = None) -> Any:
    """``update`` (from ``origin``: a file, or the command line's ``override``) merged into ``base``."""
    if isinstance(update, DictConfig):
        _check_sections(_plain(update), schema, origin)
    try:
        return OmegaConf.merge(base, update)
    except ConfigKeyError as err:
        raise _unknown_key_error(err.full_key or str(err.key), origin, schema, update, override) from None
    except ValidationError as err:
        if err.full_key and (choices := _choices_of(err.full_key, schema)) is not None:
            raise ConfigError(f"{origin}: {not_a_choice(err.full_key, err.value, choices)}") from None
        if err.full_key and _is_list_field(err.full_key, schema) and not isinstance(err.value, (list, tuple)):
            raise _not_a_list_error(err.full_key, err.value, origin, override) from None
        reason = (err.msg or str(err)).splitlines()[0]
        if err.value is None and override is not None and override.endswith("="):  # the shell ate the quotes
            reason += f"; an empty value reads as null: for the empty string write {override}\"''\""
        raise ConfigError(f"{origin}: {err.full_key}={err.value!r} is not valid: {reason}") from None
    except (OmegaConfBaseException, TypeError) as err:  # TypeError: e.g. a YAML list at the top level
        raise ConfigError(f"{origin}: {str(err).splitlines()[0]}") from None


BASE_KEY = "_base_"
"""A preset or YAML file may name another one under this key: that one is loaded first, and this
file's values override it (a GPU-sized preset that changes the sizes of a CPU one)."""


def _preset_chain(name_or_path: str) -> list[tuple[Path, DictConfig | ListConfig]]:
    """The files to merge, the furthest base first, each without its ``_base_`` key (a YAML list is
    returned as it is, for the merge to refuse)."""
    chain: list[tuple[Path, DictConfig | ListConfig]] = []
    next_file: str | None = name_or_path
    while next_file is not None:
        path = _resolve_preset(next_file)
        if any(path == seen for seen, _ in chain):
            raise ConfigError(f"{path}: {BASE_KEY} loops back to a file already loaded ({[str(p) for p, _ in chain]})")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as err:  # yaml errors come in several types
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        next_file = file_cfg.pop(BASE_KEY, None) if isinstance(file_cfg, DictConfig) else None
        chain.append((path, file_cfg))
    return chain[::-1]


COMMAND_LINE = "command line"


@dataclasses.dataclass(frozen=True)
class ChangedSetting:
    """A setting whose value is not the library default, and what set it."""

    key: str
    value: Any
    default: Any
    origin: str
    """``preset NAME``, a config file's path, ``command line``, or ``derived from other settings``
    (no file or override named it: a value a dataclass of the schema sets itself)."""


@dataclasses.dataclass(frozen=True)
class ConfigSources:
    """Where a loaded config came from: the preset or file it builds on, and every setting that
    differs from the library defaults with its origin."""

    base: str | None
    """The preset name or config file given with ``--config`` (None: library defaults only)."""
    changed: tuple[ChangedSetting, ...]
    repeated: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    """Settings the command line gave more than once, with each value given (the last is used)."""

    def report(self, without_effect: Mapping[str, str] | None = None) -> str:
        """The start-up report's settings block. ``without_effect``: the settings (keys or sections)
        the run reads nothing of, with why (``LoopConfig.without_effect``); one the command line
        gives is warned of."""
        base = f"preset {self.base}" if self.base in presets() else self.base
        head = f"settings: built on {base}" if base else "settings: library defaults (no --config)"
        notes = [
            f"warning: {key} is given {len(values)} times on the command line ({', '.join(map(_show, values))}): "
            "the last is used"
            for key, values in self.repeated.items()
        ]
        # Of the command line's settings only: a preset or a config file (often one --print-config
        # wrote) holds settings for the algorithms a run may switch to.
        for setting in self.changed:
            why = _closest_section(setting.key, without_effect or {})
            if why is not None and setting.origin == COMMAND_LINE:
                notes.append(f"warning: {setting.key}={_show(setting.value)} (command line) has no effect: {why}")
        if not self.changed:
            return "\n".join([head + "; none differs from the library defaults", *notes])
        width = max(len(c.key) for c in self.changed)
        rows = [f"  {c.key:<{width}}  {_show(c.value)}  (default {_show(c.default)}; {c.origin})" for c in self.changed]
        return "\n".join([head + f"; {len(self.changed)} differ from the library defaults:", *rows, *notes])


def _closest_section(key: str, reasons: Mapping[str, str]) -> str | None:
    """The reason of ``key``'s most specific entry in ``reasons`` (itself, or a section above it)."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        reason = reasons.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None


def _show(value: Any) -> str:
    return "''" if value == "" else str(value)


def _origin(path: Path) -> str:
    return f"preset {path.stem}" if path.parent == PRESET_DIR else str(path)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a plain container; lists and empty mappings are values."""
    if not isinstance(tree, Mapping) or not tree:
        return {prefix.rstrip("."): tree}
    leaves: dict[str, Any] = {}
    for key, value in tree.items():
        leaves.update(_leaves(value, f"{prefix}{key}."))
    return leaves


def _colon_key(tree: Any) -> str | None:
    """A mapping key that holds a colon and has no value: ``{a:1}`` in YAML, where ``{a: 1}`` was meant."""
    if not isinstance(tree, Mapping):
        return None
    for key, value in tree.items():
        if value is None and isinstance(key, str) and ":" in key:
            return key
        found = _colon_key(value)
        if found is not None:
            return found
    return None


def load_config[T](preset: str | None, overrides: list[str] | tuple[str, ...] = (), *, schema: type[T]) -> T:
    """Schema defaults <- preset or YAML file <- dotlist overrides, in that order.

    ``schema`` is the dataclass of the command (``SmokeConfig``, ``PPOConfig``, ...). Keys and types
    are checked here; values are checked by the command's check function, which reports
    ``config_errors`` (every dataclass's own ``errors()``) and its cross-component rules together.
    """
    return load_config_with_sources(preset, overrides, schema=schema)[0]


def load_config_with_sources[T](
    preset: str | None, overrides: list[str] | tuple[str, ...] = (), *, schema: type[T]
) -> tuple[T, ConfigSources]:
    """``load_config``, and where every setting that differs from the library default came from."""
    merged = OmegaConf.structured(schema)
    set_by: dict[str, str] = {}
    values: dict[str, list[Any]] = {}  # each command-line setting's values, in order
    if preset is not None:
        for path, file_cfg in _preset_chain(preset):
            merged = _merge(merged, file_cfg, str(path), schema)
            set_by.update(dict.fromkeys(_leaves(OmegaConf.to_container(file_cfg)), _origin(path)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            update = OmegaConf.from_dotlist([item])
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(
                f"override '{item}': its value is not valid YAML ({problem}); a list is [a, b], a mapping "
                "{key: value}, and a value with spaces or brackets goes in quotes"
            ) from None
        plain = OmegaConf.to_container(update)
        given = _leaves(plain)
        colon = _colon_key(plain)
        if colon is not None:
            name, _, value = colon.partition(":")
            raise ConfigError(
                f"override '{item}': YAML reads '{colon}' as a key with no value; write {{{name}: {value}}}, "
                "with a space after the colon"
            )
        merged = _merge(merged, update, f"override '{item}'", schema, item)
        for key, value in given.items():
            values.setdefault(key, []).append(value)
        set_by.update(dict.fromkeys(given, COMMAND_LINE))
    with building_tree():
        cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, schema), "a structured config of a dataclass builds that dataclass"
    defaults = library_defaults(schema)
    final = _leaves(OmegaConf.to_container(OmegaConf.structured(cfg)))
    changed = tuple(
        ChangedSetting(key, value, defaults.get(key), _setter(key, set_by))
        for key, value in final.items()
        if value != defaults.get(key)
    )
    repeated = {key: given for key, given in values.items() if len(given) > 1}
    return cfg, ConfigSources(preset, changed, repeated)


def library_defaults(schema: type) -> dict[str, Any]:
    """``{dotted key: library default}`` of every setting of ``schema``; a section's defaults as its
    parent sets them (``critic_optim.lr``)."""
    return _leaves(_plain(OmegaConf.structured(schema), resolve=True))


def _setter(key: str, set_by: dict[str, str]) -> str:
    """What set ``key``: the last update naming it or a section above it (``rollout={...}``)."""
    while key:
        if key in set_by:
            return set_by[key]
        key = key.rpartition(".")[0]
    return "derived from other settings"


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
