"""The README's CPU commands, run as a reader runs them: in one directory holding the README's own
example files (``prompts.jsonl``, ``my_reward.py``) and, at the path it names, a tiny HF model built
here in place of the download; each command through bash, in README order, with the settings
``tests/unit/test_readme.py`` names (TEST_SETTINGS, and why). The rewards are recomputed with the
README's reward function, read from the README."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_chat_tokenizer, make_tiny_hf_model
from tests.launch import check_exit, subprocess_env
from tests.unit.test_readme import README, RUN, TEST_SETTINGS, readme_block, readme_commands


def _with_test_settings(command: str, keys: tuple[str, ...]) -> str:
    """``command`` with each of ``keys`` set to its TEST_SETTINGS value: in place of the README's
    ``key=value`` where the command has one, else appended."""
    if not keys:
        return command
    words = shlex.split(command)
    for key in keys:
        setting = f"{key}={TEST_SETTINGS[key][0]}"
        given = [i for i, word in enumerate(words) if word.startswith(f"{key}=")]
        if given:
            words[given[0]] = setting
        else:
            words.append(setting)
    return shlex.join(words)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _words_after(commands: list[str], prefix: str) -> list[str]:
    """The words of the one README command that starts with ``prefix``."""
    (command,) = [c for c in commands if c.startswith(prefix)]
    return shlex.split(command)


@pytest.mark.distributed
def test_the_readme_commands_run(tmp_path: Path) -> None:
    markdown = README.read_text()
    commands = readme_commands(markdown)
    (tmp_path / "prompts.jsonl").write_text(readme_block(markdown, "json"))
    (tmp_path / "my_reward.py").write_text(readme_block(markdown, "python"))
    model_dir = tmp_path / _words_after(commands, "hf download")[-1]
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(make_chat_tokenizer("qwen2", model_dir)))
    make_tiny_hf_model("qwen2", False, model_dir, vocab_size=vocab_size, pad_token_id=None)

    # The megatron-rlhf script pip installed beside this interpreter, as `source .venv/bin/activate` finds it.
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "megatron-rlhf").is_file(), f"no megatron-rlhf script in {bin_dir}: pip install -e . makes it"
    env = subprocess_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for command in [c for c in commands if c in RUN]:
        proc = subprocess.run(
            ["bash", "-c", _with_test_settings(command, RUN[command])],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        check_exit(proc)

    prompts = _records(tmp_path / "prompts.jsonl")
    run = tmp_path / "runs" / "my-first"
    steps = int(TEST_SETTINGS["max_steps"][0])
    assert [m["step"] for m in _records(run / "metrics.jsonl")] == list(range(1, steps + 1))
    namespace: dict = {}
    exec((tmp_path / "my_reward.py").read_text(), namespace)
    samples = _records(run / "samples.jsonl")
    assert samples
    for sample in samples:
        (row,) = [p for p in prompts if p["prompt"][-1]["content"] in sample["prompt"]]
        ground_truth = row["reward_model"]["ground_truth"]
        expected = namespace["compute_score"](row["data_source"], sample["response"], ground_truth)
        assert sample["reward"] == pytest.approx(expected)
    assert (run / "hf" / "config.json").is_file() and (run / "curves.png").is_file()
    logdir = tmp_path / _words_after(commands, "tensorboard --logdir")[-1]
    assert list(logdir.glob("events.out.tfevents.*")), f"no TensorBoard events in {logdir}"

    # The run of my-run.yaml: the library defaults (PPO with a critic, output_dir runs/default) and its own settings.
    assert len(_records(tmp_path / "runs" / "default" / "metrics.jsonl")) == steps
    answers = _records(tmp_path / "answers.jsonl")
    assert sorted(a["prompt_index"] for a in answers) == list(range(len(prompts)))
    for answer in answers:  # what scoring them offline needs: the prompt, and the row's reward inputs
        row = prompts[answer["prompt_index"]]
        assert row["prompt"][-1]["content"] in answer["prompt"] and answer["data_source"] == row["data_source"]
        assert answer["ground_truth"] == row["reward_model"]["ground_truth"]
