"""Common slips in a config get the fix in their error: a list given without brackets, a key in the
wrong section, a verl key, and a Hugging Face hub id as a model path (resolved from the local cache
when it is there)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megatron_rlhf.checkpoint.sources import ModelConfig, ModelsConfig, architecture_of, role_errors, shown_path
from megatron_rlhf.config.loader import ConfigError, load_config
from megatron_rlhf.models.architecture import load_architecture
from megatron_rlhf.trainer.ppo_config import PPOConfig
from tests.helpers import load_all_tensors, make_tiny_hf_model
from tests.launch import run_cli, run_cli_here


def _refused(overrides: tuple[str, ...] = (), file: Path | None = None) -> str:
    """The message of the ``ConfigError`` that loading ppo's config with these settings raises."""
    with pytest.raises(ConfigError) as err:
        load_config(None if file is None else str(file), overrides, schema=PPOConfig)
    return str(err.value)


def _yaml(tmp_path: Path, dotted: str, value: object) -> Path:
    """A config file setting the dotted key ``dotted`` to ``value`` (as nested sections)."""
    tree: object = value
    for part in reversed(dotted.split(".")):
        tree = {part: tree}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("data.train=train.jsonl", "write data.train=[train.jsonl]"),
        ("data.train=a.jsonl,b.jsonl", "write data.train=[a.jsonl,b.jsonl]"),
        ("scoring.rules=exact_answer", "write scoring.rules=[exact_answer]"),
    ],
)
def test_a_list_without_brackets_gets_the_bracketed_setting(override: str, fix: str) -> None:
    message = _refused((override,))
    assert fix in message
    assert "AnyNode" not in message


def test_a_list_without_brackets_in_a_file_is_named_with_the_file(tmp_path: Path) -> None:
    file = _yaml(tmp_path, "data.train", "train.jsonl")
    message = _refused(file=file)
    assert message.startswith(f"{file}: data.train='train.jsonl' is not valid: data.train is a list")
    assert "[train.jsonl]" in message


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("actor.lr=1e-6", "did you mean actor_optim.lr=1e-6? (or critic_optim.lr)"),
        ("lr=1e-6", "did you mean actor_optim.lr=1e-6? (or critic_optim.lr)"),
        ("critic.lr=2e-5", "did you mean critic_optim.lr=2e-5? (or actor_optim.lr)"),
        ("rollout.n=4", "did you mean rollout.sampling.n=4?"),
        # the same name one level down beats a sibling that merely looks alike (max_sample_batches)
        ("rollout.max_batch_size=8", "did you mean rollout.engine.max_batch_size=8?"),
        ("actor.pth=/models/x", "did you mean actor.path=/models/x?"),
    ],
)
def test_a_key_in_the_wrong_section_points_to_the_key_that_exists(override: str, meant: str) -> None:
    message = _refused((override,))
    assert meant in message, message


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("data.train=[train.jsonl", "did not find expected ',' or ']'"),
        ("scoring.weights={a: 1", "did not find expected ',' or '}'"),
    ],
)
def test_an_unclosed_bracket_on_the_command_line_names_the_override(override: str, problem: str) -> None:
    """Before: a 15-frame traceback from yaml's parser, naming "<unicode string>"."""
    message = _refused((override,))
    assert message.startswith(f"override '{override}': its value is not valid YAML ({problem})"), message


def test_a_key_in_the_wrong_section_of_a_file_names_the_key(tmp_path: Path) -> None:
    message = _refused(file=_yaml(tmp_path, "actor.lr", 1e-6))
    assert "unknown key 'actor.lr'; did you mean 'actor_optim.lr'? (or critic_optim.lr)" in message


VERL_KEYS = [
    ("actor_rollout_ref.actor.optim.lr", "1e-6", "actor_optim.lr"),
    ("actor_rollout_ref.model.path", "/models/qwen", "actor.path"),
    ("actor_rollout_ref.rollout.n", "8", "rollout.sampling.n"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "4", "max_tokens_per_micro_batch"),
    ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", "true", "actor_optim.cpu_offload_fraction"),
    ("critic.ppo_micro_batch_size_per_gpu", "4", "max_tokens_per_micro_batch"),
    ("data.train_files", "[train.parquet]", "data.train"),
    ("data.train_batch_size", "64", "prompts_per_step"),
    ("trainer.total_training_steps", "3", "max_steps"),
    ("trainer.total_epochs", "2", "num_epochs"),
    ("algorithm.adv_estimator", "grpo", "algorithm.advantage_estimator"),
]


@pytest.mark.parametrize(("verl_key", "value", "ours"), VERL_KEYS)
def test_a_verl_key_gets_this_projects_key_on_the_command_line_and_in_a_file(
    tmp_path: Path, verl_key: str, value: str, ours: str
) -> None:
    on_command_line = _refused((f"{verl_key}={value}",))
    in_file = _refused(file=_yaml(tmp_path, verl_key, yaml.safe_load(value)))
    for message in (on_command_line, in_file):
        assert f"unknown key '{verl_key}': this is verl's name; here it is {ours}" in message, message


def test_a_verl_key_with_no_counterpart_says_so() -> None:
    message = _refused(("actor_rollout_ref.model.enable_gradient_checkpointing=true",))
    assert "it has no counterpart here (activations are kept, not recomputed" in message


HUB_ID = "TinyOrg/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached_model(hub_cache: Path) -> Path:
    """``HUB_ID`` in the layout ``hf download`` leaves in a hub cache: its snapshot directory."""
    repo = hub_cache / "models--TinyOrg--tiny-qwen2"
    snapshot = repo / "snapshots" / COMMIT
    make_tiny_hf_model("qwen2", False, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_is_read_from_the_local_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    hub_cache = tmp_path / "hub"
    snapshot = _cached_model(hub_cache)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(variable, str(hub_cache if variable == "HF_HUB_CACHE" else tmp_path))
    monkeypatch.chdir(tmp_path)  # no directory named TinyOrg/tiny-qwen2 here
    assert architecture_of(HUB_ID) == load_architecture(snapshot)
    assert shown_path(HUB_ID) == f"{HUB_ID} (from the Hugging Face cache: {snapshot})"
    errors, archs = role_errors(ModelsConfig(actor=ModelConfig(path=HUB_ID)), ["actor", "critic"], 1)
    assert errors == []
    assert archs["actor"] == load_architecture(snapshot)
    assert archs["critic"] == load_architecture(snapshot).with_score_head()  # follows the actor's path


def test_a_hub_id_missing_from_the_cache_gets_the_download_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    proc = run_cli_here(
        "ppo", "--config", "ppo-tiny", "actor.path=Qwen/Qwen2.5-0.5B-Instruct", f"output_dir={out}", exit_code=2
    )
    message = (
        "actor.path='Qwen/Qwen2.5-0.5B-Instruct': model path 'Qwen/Qwen2.5-0.5B-Instruct': no such directory "
        f"({tmp_path / 'Qwen/Qwen2.5-0.5B-Instruct'}); as a Hugging Face hub id it is not in the local cache "
        f"({tmp_path / 'empty-hub'}) either. "
        "Download it with `hf download Qwen/Qwen2.5-0.5B-Instruct` (this path then finds it in the cache), "
        "or `hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR` and set actor.path=DIR"
    )
    assert message in proc.stderr
    assert proc.stderr.count("as a Hugging Face hub id") == 1, proc.stderr  # not again for the critic


def test_a_runs_output_dir_given_as_a_model_points_to_its_export(tmp_path: Path) -> None:
    (tmp_path / "run" / "hf").mkdir(parents=True)
    (tmp_path / "run" / "hf" / "config.json").write_text("{}")
    proc = run_cli_here("ppo", "--config", "ppo-tiny", f"actor.path={tmp_path / 'run'}", exit_code=2)
    assert f"is a run's output_dir: its trained model is {tmp_path / 'run' / 'hf'}" in proc.stderr


def test_a_run_checkpoints_model_given_as_a_model_gets_the_convert_command(tmp_path: Path) -> None:
    model = tmp_path / "run" / "checkpoints" / "step_2" / "models" / "actor"
    model.mkdir(parents=True)
    (model / "train_state.json").write_text("{}")
    proc = run_cli_here("ppo", "--config", "ppo-tiny", f"actor.path={model}", exit_code=2)
    assert f"{model} is a run checkpoint's trained model" in proc.stderr
    assert f"`megatron-rlhf convert mcore-to-hf {model} OUT` and set OUT" in proc.stderr


def test_convert_reads_a_hub_id_from_the_local_cache(tmp_path: Path) -> None:
    """``convert hf-to-mcore`` takes a hub id as its source like the trainers do; the round trip back to HF
    gives the cached snapshot's weights bit for bit."""
    snapshot = _cached_model(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    run_cli("convert", "hf-to-mcore", HUB_ID, str(tmp_path / "mcore"), "device=cpu", env=env, cwd=tmp_path)
    run_cli("convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "hf"), "device=cpu", cwd=tmp_path)
    expected, written = load_all_tensors(snapshot), load_all_tensors(tmp_path / "hf")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], expected[name]) for name in expected)
