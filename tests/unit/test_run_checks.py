"""The up-front checks of what a trainer's run writes and reads (its output directory, its data
files): each command names the setting and the path before it writes or builds anything."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_rlhf.commands.generate import GenerateConfig
from megatron_rlhf.config.loader import ConfigError, config_errors, load_config
from megatron_rlhf.data.builtin import data_overlap_warnings
from megatron_rlhf.trainer.ppo_config import PPOConfig, check_ppo_config
from megatron_rlhf.trainer.rm import RMConfig
from megatron_rlhf.trainer.sft import SFTConfig
from megatron_rlhf.trainer.supervised import check_config


def _check_ppo(overrides: list[str]) -> None:
    check_ppo_config(load_config("ppo-tiny", overrides, schema=PPOConfig), 1)


def _check_supervised(schema: type, score_head: bool) -> Callable[[list[str]], None]:
    def check(overrides: list[str]) -> None:
        check_config(
            load_config("rm-tiny" if score_head else "sft-tiny", overrides, schema=schema), 1, score_head=score_head
        )

    return check


COMMANDS = {"ppo": _check_ppo, "sft": _check_supervised(SFTConfig, False), "rm": _check_supervised(RMConfig, True)}


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "response": "b", "chosen": "b", "rejected": "c"}\n')
    return path


def _error(command: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        COMMANDS[command](overrides)
    return str(info.value)


@pytest.mark.parametrize("command", COMMANDS)
def test_output_dir_under_a_file_is_named(command: str, tmp_path: Path, data_file: Path) -> None:
    blocker = tmp_path / "somefile"
    blocker.write_text("")
    for output_dir in (blocker / "run", blocker):
        message = _error(command, [f"output_dir={output_dir}", f"data.train=[{data_file}]"])
        assert f"output_dir='{output_dir}': {blocker} is a file, not a directory" in message
    COMMANDS[command]([f"output_dir={tmp_path / 'new' / 'run'}", f"data.train=[{data_file}]"])
    assert not (tmp_path / "new").exists()  # checked, not made


@pytest.mark.parametrize("command", COMMANDS)
def test_missing_data_files_are_named_with_their_setting(command: str, tmp_path: Path, data_file: Path) -> None:
    (tmp_path / "notes.txt").write_text("")
    message = _error(
        command, [f"output_dir={tmp_path / 'run'}", f"data.train=[/nope.jsonl,{data_file},{tmp_path / 'notes.txt'}]"]
    )
    assert "data.train: dataset path '/nope.jsonl' does not exist" in message
    assert f"data.train: {tmp_path / 'notes.txt'}: unsupported data file extension '.txt'" in message
    assert str(data_file) not in message


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_missing_validation_files_are_named(command: str, tmp_path: Path, data_file: Path) -> None:
    message = _error(command, [f"data.train=[{data_file}]", f"data.validation=[{tmp_path / 'val'}]"])
    assert f"data.validation: dataset path '{tmp_path / 'val'}' does not exist" in message


def test_built_in_prompt_sets_are_checked_by_name(tmp_path: Path) -> None:
    _check_ppo([f"output_dir={tmp_path}", "data.train=[builtin:lowercase-prompts]"])
    message = _error("ppo", [f"output_dir={tmp_path}", "data.train=[builtin:uppercase-prompts]"])
    assert (
        "data.train: unknown built-in dataset 'builtin:uppercase-prompts'; available: ['builtin:lowercase-prompts', "
        in message
    )


def test_unreadable_data_files_are_named(tmp_path: Path, data_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opened up front (root reads any file, so the refusal is simulated)."""
    real_open = Path.open

    def refuse(self: Path, *args, **kwargs):
        if self == data_file:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    message = _error("sft", [f"data.train=[{tmp_path}]"])
    assert f"data.train: [Errno 13] Permission denied: '{data_file}'" in message


@pytest.mark.parametrize("command", COMMANDS)
def test_a_device_file_as_data_is_named_as_what_it_is(command: str, tmp_path: Path) -> None:
    message = _error(command, [f"output_dir={tmp_path / 'run'}", "data.train=[/dev/null]"])
    assert "data.train: dataset path '/dev/null' is not a regular file or a directory" in message
    assert "does not exist" not in message


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A read-only file system (a tmpfs mounted ro): root writes through permission bits, not through this."""
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root in a namespace that allows mounts)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_dir_that_cannot_be_written_is_named_up_front(
    command: str, read_only_dir: Path, data_file: Path
) -> None:
    message = _error(command, [f"output_dir={read_only_dir / 'run'}", f"data.train=[{data_file}]"])
    assert f"output_dir='{read_only_dir / 'run'}': cannot write in {read_only_dir} (Read-only file system)" in message


@pytest.mark.parametrize("command", COMMANDS)
def test_a_resume_value_that_is_no_mode_and_no_directory_is_named(
    command: str, tmp_path: Path, data_file: Path
) -> None:
    message = _error(command, [f"output_dir={tmp_path / 'run'}", f"data.train=[{data_file}]", "resume=sometimes"])
    assert (
        "resume='sometimes' must be auto, never, or a checkpoint directory (.../checkpoints/step_N); 'sometimes' "
        "does not exist"
    ) in message


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_rows_longer_than_the_models_positions_are_refused_up_front(command: str, data_file: Path) -> None:
    """As ppo refuses prompt + response lengths past the actor's positions: rows up to data.max_length
    would reach positions the model has no rotary scaling or training for."""
    message = _error(command, [f"data.train=[{data_file}]", "data.max_length=1025"])
    assert "data.max_length=1025 exceeds the model's max_position_embeddings=1024" in message
    COMMANDS[command]([f"data.train=[{data_file}]", "data.max_length=1024"])


def test_scoring_limits_past_the_runs_own_are_refused(tmp_path: Path) -> None:
    """An over-long ramp as long as a response penalised every response (an empty one too), and a
    reward timeout past the collectives' let the other ranks time out first, naming no reward call."""
    out = f"output_dir={tmp_path}"
    message = _error("ppo", [out, "rollout.sampling.max_new_tokens=24", "scoring.overlong.buffer=24"])
    assert "scoring.overlong.buffer=24 must be below rollout.sampling.max_new_tokens=24" in message
    timeouts = [out, "scoring.timeout_s=600", "dist_timeout_s=600"]
    with pytest.raises(ConfigError) as info:
        check_ppo_config(load_config("ppo-tiny", timeouts, schema=PPOConfig), 2)
    assert "scoring.timeout_s=600.0 must be below dist_timeout_s=600" in str(info.value)
    _check_ppo(timeouts)  # one rank: no other waits for its scores
    rm_only = ["scoring.rules=[]", "scoring.use_reward_model=true", "dist_timeout_s=30"]  # no call is timed
    check_ppo_config(load_config("ppo-tiny", [out, *rm_only], schema=PPOConfig), 2)
    _check_ppo([out, "rollout.sampling.max_new_tokens=24", "scoring.overlong.buffer=23", "scoring.timeout_s=0"])


def test_a_file_read_twice_or_by_both_train_and_validation_is_warned_of(tmp_path: Path) -> None:
    """Before, nothing said so; a repeat may be meant (a set weighed twice), so it is a warning.
    A directory of data files counts as its files; a path is compared resolved."""
    shard = tmp_path / "shards" / "a.jsonl"
    shard.parent.mkdir()
    shard.write_text('{"prompt": "a"}\n')
    other = tmp_path / "b.jsonl"
    other.write_text('{"prompt": "b"}\n')
    again = str(tmp_path / "shards" / ".." / "shards" / "a.jsonl")
    assert data_overlap_warnings([str(shard.parent), again, str(other)], [str(other)]) == [
        f"warning: data.train reads {shard} 2 times: its rows are trained on as often each epoch",
        f"warning: data.validation reads {other}, which data.train reads: it measures training data",
    ]
    assert data_overlap_warnings([str(shard), "builtin:arithmetic-train"], ["builtin:arithmetic-test"]) == []


def test_a_tool_timeout_past_the_collectives_is_refused_where_other_ranks_wait(tmp_path: Path) -> None:
    tools = [
        f"output_dir={tmp_path}",
        "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tool_config_path=builtin:calculator",
    ]
    late = [*tools, "rollout.multi_turn.tool_timeout_s=1200"]
    with pytest.raises(ConfigError) as info:
        check_ppo_config(load_config("ppo-tiny", late, schema=PPOConfig), 2)
    assert "rollout.multi_turn.tool_timeout_s=1200.0 must be below dist_timeout_s=600" in str(info.value)
    _check_ppo(late)  # one rank


def _generate_errors(settings: list[str]) -> list[str]:
    return config_errors(load_config(None, settings, schema=GenerateConfig))


def test_generate_checks_its_input_tools_and_greedy_samples_up_front(tmp_path: Path) -> None:
    """Before: a missing input was found after the model loaded, a tools file other than the agent's
    offered the model tools that answered 'unknown tool', and n greedy samples were n copies."""
    run = ["model=builtin:tiny-llama", f"output={tmp_path / 'out.jsonl'}"]
    missing = tmp_path / "nowhere.jsonl"
    (error,) = _generate_errors([*run, f"input={missing}"])
    assert error == f"input: dataset path '{missing}' does not exist"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    run.append(f"input={prompts}")
    assert _generate_errors(run) == []
    tools = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=builtin:calculator"]
    (error,) = _generate_errors([*run, *tools, "data.tools_file=builtin:python"])
    assert error.startswith("data.tools_file='builtin:python' offers the prompts other tools than the agent runs")
    (error,) = _generate_errors([*run, "rollout.sampling.temperature=0", "rollout.sampling.n=4"])
    assert error.startswith("rollout.sampling.n=4 at temperature 0 (greedy) makes 4 identical completions")
