"""One CLI style: every command's settings are ``key=value`` from its config dataclass; the flags that
came before are aliases of keys; a key written as a flag is answered with its key=value form; and
``--print-config`` prints YAML whose comments are the fields' docstrings and which loads back into
the same config."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from megatron_rlhf.cli import build_parser
from megatron_rlhf.commands import schema_of
from megatron_rlhf.commands.generate import GenerateConfig, GenerateRolloutConfig
from megatron_rlhf.commands.plan import planned_schema
from megatron_rlhf.config.annotated import WIDTH
from megatron_rlhf.config.flags import FLAG_ALIASES
from megatron_rlhf.config.loader import library_defaults, load_config
from megatron_rlhf.rollout.native_config import NativeEngineConfig
from megatron_rlhf.rollout.sampling import SamplingParams
from tests.launch import run_cli_here


def _settings(*argv: str) -> list[str]:
    return build_parser().parse_args(list(argv)).overrides


def test_flags_are_aliases_of_keys_and_an_explicit_key_wins() -> None:
    given = _settings(
        "generate", "--num-samples", "4", "rollout.sampling.top_k=5", "--tp", "2", "--ignore-eos",
        "--no-cuda-graphs", "--stop-token-ids", "7", "8", "rollout.sampling.n=6",
    )  # fmt: skip
    assert given == [
        "rollout.sampling.n=4",
        "rollout.tp=2",
        "rollout.sampling.ignore_eos=true",
        "rollout.engine.cuda_graphs=false",
        "rollout.sampling.stop_token_ids=[7,8]",
        "rollout.sampling.n=6",  # a flag of several values stops at a setting; after its alias, the key wins
        "rollout.sampling.top_k=5",
    ]
    cfg = load_config(None, given, schema=GenerateConfig)
    assert cfg.rollout.sampling == SamplingParams(n=6, top_k=5, ignore_eos=True, stop_token_ids=(7, 8))
    assert cfg.rollout.tp == 2 and cfg.rollout.engine == NativeEngineConfig(cuda_graphs=False)


def test_generate_shares_ppos_rollout_dataclasses() -> None:
    """The settings generate and ppo both have are one declaration: ppo's own dataclasses."""
    from megatron_rlhf.trainer.ppo_config import PPOConfig, RolloutConfig

    generate, ppo = typing.get_type_hints(GenerateRolloutConfig), typing.get_type_hints(RolloutConfig)
    assert generate["sampling"] is ppo["sampling"] is SamplingParams
    assert generate["engine"] is ppo["engine"] is NativeEngineConfig
    generate_top, ppo_top = typing.get_type_hints(GenerateConfig), typing.get_type_hints(PPOConfig)
    assert generate_top["device"] == ppo_top["device"] and generate_top["dtype"] == ppo_top["dtype"]


def test_convert_takes_its_positional_words_as_keys() -> None:
    assert _settings("convert", "hf-to-mcore", "/models/a", "ckpt/a", "--tp", "2", "pp=2") == [
        "direction=hf-to-mcore",
        "source=/models/a",
        "output=ckpt/a",
        "tp=2",
        "pp=2",
    ]
    assert _settings("convert", "direction=mcore-to-hf", "source=c", "output=o") == [
        "direction=mcore-to-hf",
        "source=c",
        "output=o",
    ]


@pytest.mark.parametrize("command", list(FLAG_ALIASES))
def test_every_flag_names_a_key_of_its_command_and_its_help_says_which(command: str) -> None:
    keys = library_defaults(schema_of(command))
    help_text = " ".join(run_cli_here(command, "--help").stdout.split())
    for flag, key in FLAG_ALIASES[command].items():
        assert key in keys, (flag, key)
        assert re.search(rf"{flag}[ ,]", help_text) and f"= {key}=" in help_text, (flag, key)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("ppo", "--max_steps", "3"), "settings are key=value: max_steps=3"),
        (("ppo", "--config", "ppo-tiny", "--max-steps=3", "seed=1"), "settings are key=value: max_steps=3"),
        (("sft", "--data.train", "[a.jsonl]"), "settings are key=value: data.train=[a.jsonl]"),
        (("generate", "--num_samples", "4"), "settings are key=value: rollout.sampling.n=4 (or --num-samples 4)"),
        (("ppo", "--max_stepz", "3"), "unrecognized option --max_stepz; did you mean max_steps=3?"),
        (("ppo", "--lr", "1e-6"), "unrecognized option --lr; did you mean actor_optim.lr=1e-6?"),
        (("plan", "--world_size", "8"), "settings are key=value: plan.world_size=8 (or --world-size 8)"),
        (("convert", "a", "b", "c", "d"), "'d' is not a setting: settings are key=value"),
    ],
)
def test_a_key_written_as_a_flag_gets_its_key_value_form_in_the_commands_usage(argv, message) -> None:
    proc = run_cli_here(*argv, exit_code=2)
    assert f"megatron-rlhf {argv[0]}: error: {message}" in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"usage: megatron-rlhf {argv[0]} ")


def test_the_config_command_is_gone_and_says_what_replaces_it() -> None:
    proc = run_cli_here("config", "actor.tp=2", exit_code=2)
    assert proc.stderr.splitlines() == [
        "megatron-rlhf: error: 'megatron-rlhf config' is gone: use 'megatron-rlhf <command> --print-config' "
        "(e.g. megatron-rlhf ppo --config ppo-tiny --print-config)"
    ]
    listed = run_cli_here("--help").stdout
    assert "\n    config " not in listed and "\n    generate " in listed


def test_version_prints_the_run_logs_environment_line_and_fails_where_megatron_core_cannot_import(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    line = capsys.readouterr().out
    assert line.startswith("megatron-rlhf ") and f"torch {torch.__version__}, CUDA " in line
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # what a broken install's import meets
    with pytest.raises(SystemExit) as broken:
        build_parser().parse_args(["--version"])
    assert broken.value.code == 1
    assert "megatron-core cannot be imported" in capsys.readouterr().err


def test_required_generate_settings_are_named(tmp_path: Path) -> None:
    proc = run_cli_here("generate", f"output={tmp_path / 'o.jsonl'}", "--input", "p.jsonl", exit_code=2)
    assert "model is not set. Required: the policy, an HF model directory" in proc.stderr
    assert "input is not set" not in proc.stderr and "output is not set" not in proc.stderr


PRINTED = {
    "ppo": ("--config", "ppo-tiny", "rollout.sampling.n=6", "actor_optim.lr=3e-6", "output_dir={tmp}/run"),
    "sft": ("--config", "sft-tiny", "data.train=[builtin:arithmetic-sft]", "output_dir={tmp}/run"),
    "pipeline": ("stages=[grpo,test]", "output_dir={tmp}/run"),
    "smoke": ("seed=7", "output_dir={tmp}/run"),
    "generate": ("--model", "builtin:tiny-llama", "input=builtin:arithmetic-test", "output={tmp}/o.jsonl",
                 "--num-samples", "4", "--stop-token-ids", "3", "4", "rollout.sampling.temperature=0.7"),
    "plan": ("--config", "sft-tiny", "data.train=[builtin:arithmetic-sft]", "--world-size", "2", "--json"),
    "convert": ("hf-to-mcore", "/models/a", "ckpt/a", "--tp", "2"),
}  # fmt: skip
"""A command line of each kind of command: a trainer built on a preset, the pipeline's sections chained
by its preset's interpolations, generate with flags and keys, plan of a trainer named only by its
preset, convert with positional words."""


def _loaded(command: str, argv: list[str]) -> object:
    """The config a command line gives, loaded as the command loads it."""
    args = build_parser().parse_args([command, *argv])
    if command == "plan":
        cfg = load_config(args.config, args.overrides, schema=planned_schema("sft"))
        return dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, trainer="sft"))
    return load_config(args.config, args.overrides, schema=schema_of(command))


@pytest.mark.parametrize("command", list(PRINTED))
def test_print_config_reloads_as_the_same_config(command: str, tmp_path: Path) -> None:
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in PRINTED[command]]
    printed = run_cli_here(command, *argv, "--print-config").stdout
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    assert _loaded(command, ["--config", str(saved)]) == _loaded(command, argv)
    again = run_cli_here(command, "--config", str(saved), "--print-config").stdout
    assert _without_header(again) == _without_header(printed)  # the header names the file: it differs
    assert yaml.safe_load(again) == yaml.safe_load(printed)


def _without_header(printed: str) -> list[str]:
    """``--print-config``'s lines after its settings report (its first line and the rows under it)."""
    lines = printed.splitlines()
    assert lines[0].startswith("# settings: ")
    return [line for line in lines[1:] if not line.startswith("#   ")]


def test_print_config_comments_each_key_with_its_docstring_indented_with_it(tmp_path: Path) -> None:
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in PRINTED["generate"]]
    lines = run_cli_here("generate", *argv, "--print-config").stdout.splitlines()
    assert lines[0].startswith("# settings: library defaults (no --config); ")
    n = lines.index("    n: 4")
    assert lines[n - 1] == "    # Samples per prompt (a group, for GRPO-style estimators)."
    top_p = lines.index("    top_p: 1.0")
    assert lines[top_p - 4 : top_p] == [
        "    # Keep the nucleus: the smallest set of most likely tokens whose probability reaches top_p",
        "    # (after top-k; always at least one token); 1 = off. Not free: on one H200 the 1.5B model",
        "    # decoded 84k tokens/s at top_p=0.9 with FlashInfer installed, 77k without, against 91k greedy,",
        "    # 256 slots (docs/benchmarks.md).",
    ]
    assert lines[lines.index("rollout:") - 1] == "# Generation's layout, sampling and engine (ppo's rollout.* keys)."
    assert all(len(line) <= WIDTH for line in lines if line.lstrip().startswith("#") and "(default" not in line)


def test_the_exit_before_teardown_does_what_exit_does_first(tmp_path: Path) -> None:
    """``entry`` ends with ``os._exit`` (skipping the teardown in which gloo's threads abort a rank):
    a thread still running is waited for, ``atexit`` handlers run, and text still in stdout's buffer
    (a pipe's: block-buffered) comes out."""
    program = tmp_path / "exits.py"
    program.write_text(
        "import atexit, threading, time\n"
        "from megatron_rlhf.cli import exit_before_teardown\n"
        "atexit.register(print, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished'))).start()\n"
        "print('buffered')\n"
        "exit_before_teardown(3)\n"
    )
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["buffered", "thread finished", "atexit ran"]
