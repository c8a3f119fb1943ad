"""How every command is given its settings: ``--config PRESET|FILE.yaml``, ``key=value`` overrides,
``--print-config``, and the flags that are aliases of keys (``config/flags.py``).

``CommandParser`` turns what a command's argparse parser leaves over into settings or into an error
in the command's own usage: a ``key=value`` after an option is a setting like the ones before it, a
bare word is a positional alias (``convert hf-to-mcore HF_DIR OUT_DIR``), and ``--max_steps 3``
(a key written as a flag) is answered with ``max_steps=3``.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from megatron_rlhf.config.annotated import annotated_yaml
from megatron_rlhf.config.fields import field_docs
from megatron_rlhf.config.flags import ALIASED, FLAG_ALIASES, POSITIONAL_ALIASES, SETTING
from megatron_rlhf.config.loader import ConfigSources, library_defaults, presets
from megatron_rlhf.trainer.loop_config import LoopConfig

DEFAULT_PRESET = "smoke"
TRAINER_PRESET_PREFIXES = ("ppo-", "sft-", "rm-", "pipeline-")


def add_config_args(
    parser: argparse.ArgumentParser,
    default: str | None = DEFAULT_PRESET,
    example: str = "actor.tp=2 seed=7",
    prefix: str | tuple[str, ...] | None = None,
) -> None:
    """``--config``, the ``key=value`` settings and ``--print-config``; the help lists the presets of
    this command only (those named ``prefix``..., or any of a tuple of prefixes; without a prefix,
    the presets of no trainer; ``prefix=()``: none)."""
    names = [
        n
        for n in presets()
        if (n.startswith(prefix) if prefix is not None else not n.startswith(TRAINER_PRESET_PREFIXES))
    ]
    shown = f"default: {default}" if default else "default: none, the library defaults"
    named = f"a preset name ({', '.join(names)}) or a YAML file" if names else "a YAML file"
    metavar = "PRESET|FILE.yaml" if names else "FILE.yaml"
    parser.add_argument("--config", default=default, metavar=metavar, help=f"{named} to build on ({shown})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"settings, e.g. {example}")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="run the command's checks, then print the resolved configuration as YAML, each setting "
        "described in a comment above it (the settings that differ from the library defaults first), "
        "and exit; the output loads again with --config FILE.yaml",
    )


def print_config(cfg: Any, sources: ConfigSources) -> None:
    """``--print-config``'s output: where the settings came from, then the annotated YAML."""
    print(annotated_yaml(cfg, settings_report(cfg, sources)), end="")


def settings_report(cfg: Any, sources: ConfigSources) -> str:
    """Where the settings came from, with a warning for each given one that ``cfg`` reads nothing of
    (a trainer's ``LoopConfig.without_effect``)."""
    return sources.report(cfg.without_effect() if isinstance(cfg, LoopConfig) else None)


def unset_errors(cfg: Any, *keys: str) -> list[str]:
    """For a dataclass's ``errors()``: each of ``keys`` that ``cfg`` leaves empty, with its docstring
    (which says what to give)."""
    cls: type = type(cfg)
    docs = field_docs(cls)
    return [f"{key} is not set. {docs[key]}" for key in keys if not getattr(cfg, key)]


class CommandParser(argparse.ArgumentParser):
    """A command's parser. After parsing, ``overrides`` holds every setting in the order a loader
    applies them: positional aliases, flag aliases, then ``key=value`` items (the explicit key wins).

    ``schema_of`` (set by ``cli.build_parser``) gives the command's config dataclass, imported only
    to name the key an unrecognized option meant."""

    command: str = ""
    schema_of: Callable[[], type] | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(given, namespace)
        if not hasattr(parsed, "overrides"):  # a parser without settings
            return parsed, extras
        for item in extras:
            if not SETTING.match(item):
                self.error(self._not_an_option(item, given))
        words = [item for item in parsed.overrides if not SETTING.match(item)]
        keys = POSITIONAL_ALIASES.get(self.command, ())
        if len(words) > len(keys):
            extra = words[len(keys)]
            takes = f" (this command takes {' '.join(k.upper() for k in keys)} before them)" if keys else ""
            self.error(f"'{extra}' is not a setting: settings are key=value{takes}")
        positional = [f"{key}={word}" for key, word in zip(keys, words, strict=False)]
        settings = [item for item in parsed.overrides if SETTING.match(item)]
        parsed.overrides = [*positional, *getattr(parsed, ALIASED, []), *settings, *extras]
        return parsed, []

    def _not_an_option(self, option: str, given: list[str]) -> str:
        """What an unrecognized ``--name[=value]`` should have been."""
        written, has_value, value = option.partition("=")
        if not has_value:
            after = given.index(option) + 1
            value = given[after] if after < len(given) and not given[after].startswith("--") else ""
        name = written.lstrip("-").replace("-", "_")
        for flag, key in FLAG_ALIASES.get(self.command, {}).items():
            if flag.lstrip("-").replace("-", "_") == name:
                return f"settings are key=value: {key}={value or 'VALUE'} (or {flag} {value or 'VALUE'})"
        keys = list(library_defaults(self.schema_of())) if self.schema_of else []
        if name in keys:
            return f"settings are key=value: {name}={value or 'VALUE'}"
        same_leaf = [key for key in keys if key.rpartition(".")[2] == name]
        close = same_leaf or difflib.get_close_matches(name, keys, n=1)
        hint = f"; did you mean {close[0]}={value or 'VALUE'}? (settings are key=value)" if close else ""
        return f"unrecognized option {written}{hint}"
