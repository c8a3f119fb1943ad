"""Config loading (preset / YAML file / dotlist overrides) and up-front validation messages."""

from __future__ import annotations

import json
import warnings

import pytest

from megatron_rlhf.config.loader import ConfigError, presets
from megatron_rlhf.config.loader import load_config as load_any_config
from megatron_rlhf.config.run import RunConfig
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.parallel.layout import layout_errors

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron_rlhf.checkpoint.sources import ModelConfig
    from megatron_rlhf.trainer.smoke import SmokeConfig
    from megatron_rlhf.trainer.smoke import check_smoke_config as validate


def load_config(preset=None, overrides=()):
    """The smoke command's config (the four models), as the tests below check it."""
    return load_any_config(preset, overrides, schema=SmokeConfig)


def tiny_hf_config(arch_class: str, **extra) -> dict:
    return {
        "architectures": [arch_class],
        "model_type": arch_class.split("For")[0].lower(),
        "hidden_act": "silu",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "rope_theta": 10000.0,
        **extra,
    }


def write_hf_dir(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# -------------------------------------------------------------------- loading


def test_smoke_preset_is_listed_and_loads():
    assert "smoke" in presets()
    cfg = load_config("smoke")
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.actor, ModelConfig)
    assert cfg.output_dir == "runs/smoke"  # from the preset, not the schema default
    assert cfg.seed == 1234
    assert (cfg.actor.path, cfg.critic.path) == ("builtin:tiny-llama", "builtin:tiny-llama-rm")
    assert (cfg.reference.path, cfg.reward.path) == ("builtin:tiny-llama", "builtin:tiny-llama-rm")


def test_schema_defaults_without_preset():
    cfg = load_config()
    assert cfg.output_dir == "runs/default" and cfg.seed == 1234 and cfg.device == "auto"


def test_overrides_merge_in_order():
    cfg = load_config("smoke", ["actor.tp=2", "seed=7", "critic.pp=2", "seed=8", "reward.path=/some/dir"])
    assert cfg.actor.tp == 2 and cfg.actor.pp == 1
    assert cfg.critic.pp == 2 and cfg.critic.tp == 1
    assert cfg.seed == 8  # the last override wins
    assert cfg.reward.path == "/some/dir"
    assert cfg.reference.tp == 1  # untouched roles keep preset values
    assert cfg.role("actor") is cfg.actor


def test_override_string_coercions():
    cfg = load_config("smoke", ["seed=42", "output_dir=5"])
    assert cfg.seed == 42 and isinstance(cfg.seed, int)
    assert cfg.output_dir == "5"


@pytest.mark.parametrize(
    "override,unknown,suggestion",
    [
        ("actor.tpp=2", "actor.tpp", "actor.tp=2"),
        ("actr.tp=1", "actr", "actor.tp=1"),
        ("sed=1", "sed", "seed=1"),
        ("critic.pathh=x", "critic.pathh", "critic.path=x"),
    ],
)
def test_unknown_key_suggests_closest(override, unknown, suggestion):
    with pytest.raises(ConfigError) as info:
        load_config("smoke", [override])
    msg = str(info.value)
    assert f"'{unknown}'" in msg
    assert f"did you mean {suggestion}?" in msg
    assert override in msg  # names where it came from


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        load_config("smoke", ["actor.zzzzzz=1"])
    msg = str(info.value)
    assert "did you mean" not in msg
    for key in ("path", "tp", "pp"):
        assert key in msg


@pytest.mark.parametrize("override,key,value", [("seed=abc", "seed", "abc"), ("actor.tp=2.5", "actor.tp", "2.5")])
def test_wrong_type_names_key_and_value(override, key, value):
    with pytest.raises(ConfigError) as info:
        load_config("smoke", [override])
    msg = str(info.value)
    assert key in msg and value in msg


def test_an_empty_value_for_a_text_key_says_how_to_write_the_empty_string():
    """critic.path="" in a shell arrives as critic.path=, which reads as null: the error named only
    the null, not how to give the empty string the docs describe."""
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    with pytest.raises(ConfigError) as info:
        load_any_config("ppo-tiny", ["critic.path="], schema=PPOConfig)
    assert str(info.value).endswith("an empty value reads as null: for the empty string write critic.path=\"''\"")
    assert load_any_config("ppo-tiny", ["critic.path=''"], schema=PPOConfig).critic.path == ""


def test_scalar_for_a_section_is_a_config_error():
    with pytest.raises(ConfigError, match="actor"):
        load_config("smoke", ["actor=5"])


def _refusal(tmp_path, text: str) -> str:
    """The ConfigError of ppo-tiny with ``text``: a run.yaml's text where it ends with a newline,
    else a command-line override."""
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    if text.endswith("\n"):
        (tmp_path / "run.yaml").write_text(text)
        preset, overrides = str(tmp_path / "run.yaml"), []
    else:
        preset, overrides = "ppo-tiny", [text]
    with pytest.raises(ConfigError) as info:
        load_any_config(preset, overrides, schema=PPOConfig)
    return str(info.value)


@pytest.mark.parametrize("text, origin", [("rollout=5", "override 'rollout=5'"), ("rollout: 5\n", "run.yaml")])
def test_a_value_where_a_section_belongs_names_the_section(tmp_path, text, origin):
    assert _refusal(tmp_path, text).endswith(
        f"{origin}: rollout=5 is not valid: rollout is a section (keys ['tp', 'sampling', "
        "'engine', 'filter_groups', 'max_sample_batches', 'multi_turn']), not a single value; set its keys, "
        "e.g. rollout.tp=..."
    )


def test_a_value_where_a_nested_section_belongs_names_its_full_key():
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    with pytest.raises(ConfigError, match=r"rollout\.sampling=3 is not valid: rollout\.sampling is a section"):
        load_any_config("ppo-tiny", ["rollout={sampling: 3}"], schema=PPOConfig)


@pytest.mark.parametrize(
    "text, origin, key",
    [
        ("save_hf=2", "override 'save_hf=2'", "save_hf"),
        ("rollout.sampling.ignore_eos=-1", "override 'rollout.sampling.ignore_eos=-1'", "rollout.sampling.ignore_eos"),
        ("data.add_bos=3", "override 'data.add_bos=3'", "data.add_bos"),  # bool | None
        ("save_hf: 2\n", "run.yaml", "save_hf"),
    ],
)
def test_a_number_other_than_0_or_1_for_a_true_or_false_key_is_refused(tmp_path, text, origin, key):
    """OmegaConf reads any non-zero number as true: save_hf=2, written for "every 2 steps", was a
    silent true."""
    from megatron_rlhf.trainer.ppo_config import PPOConfig

    value = text.partition("=")[2] or "2"
    assert _refusal(tmp_path, text).endswith(f"{origin}: {key}={value} is not valid: {key} is true or false")
    config = load_any_config("ppo-tiny", ["save_hf=0", "rollout.sampling.ignore_eos=1"], schema=PPOConfig)
    assert config.save_hf is False and config.rollout.sampling.ignore_eos is True


@pytest.mark.parametrize("override", ["seed", "actor.tp", ""])
def test_override_without_equals(override):
    with pytest.raises(ConfigError) as info:
        load_config("smoke", [override])
    assert "key=value" in str(info.value)
    assert f"'{override}'" in str(info.value)


def test_yaml_file_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 5\noutput_dir: out/x\nactor:\n  tp: 2\n  pp: 2\ncritic: {path: /models/rm}\n")
    cfg = load_config(str(path), ["actor.pp=1"])
    assert cfg.seed == 5 and cfg.output_dir == "out/x"
    assert cfg.actor.tp == 2 and cfg.actor.pp == 1
    assert cfg.critic.path == "/models/rm" and cfg.critic.tp == 1
    assert cfg.reward.path == ""  # schema default for what the file omits
    assert cfg.reference.path == cfg.actor.path == ""  # an empty reference path follows the actor's


def test_a_file_overrides_its_base(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text('seed: 5\noutput_dir: out/base\nactor: {tp: 2, pp: 2}\ncritic: {path: "${output_dir}/critic"}\n')
    child = tmp_path / "child.yaml"
    child.write_text(f"_base_: {base}\noutput_dir: out/child\nactor: {{pp: 1}}\n")
    cfg = load_config(str(child), ["seed=7"])
    assert (cfg.seed, cfg.output_dir, cfg.actor.tp, cfg.actor.pp) == (7, "out/child", 2, 1)
    assert cfg.critic.path == "out/child/critic"  # the base's interpolation sees the child's value
    assert load_config("smoke").actor == load_config(str(_write(tmp_path / "s.yaml", "_base_: smoke\n"))).actor


def test_a_base_loop_is_named(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"_base_: {b}\n")
    b.write_text(f"_base_: {a}\n")
    with pytest.raises(ConfigError, match=r"a.yaml: _base_ loops back to a file already loaded"):
        load_config(str(a))


def _write(path, text):
    path.write_text(text)
    return path


def test_yml_extension(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text("seed: 11\n")
    assert load_config(str(path)).seed == 11


def test_unknown_key_in_yaml_file_names_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("actor: {tpp: 2}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    msg = str(info.value)
    assert str(path) in msg and "'actor.tpp'" in msg and "did you mean 'actor.tp'?" in msg


@pytest.mark.parametrize("text", ["actor: [1\n", "- 1\n- 2\n"], ids=["invalid_yaml", "top_level_list"])
def test_bad_yaml_is_a_config_error_naming_the_file(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value)


def test_missing_yaml_file_named(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value)


def test_unknown_preset_named():
    with pytest.raises(ConfigError) as info:
        load_config("no-such-preset")
    msg = str(info.value)
    assert "'no-such-preset'" in msg and "smoke" in msg


# ------------------------------------------------------------------ validation


def validation_message(overrides, world_size) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config("smoke", overrides), world_size)
    return str(info.value)


def test_valid_smoke_config_returns_four_architectures():
    archs = validate(load_config("smoke"), 1)
    assert set(archs) == {"actor", "critic", "reference", "reward"}
    assert all(isinstance(a, Architecture) for a in archs.values())
    assert archs["actor"].score_head is False and archs["reference"].score_head is False
    assert archs["critic"].score_head is True and archs["reward"].score_head is True
    # builtin:tiny-llama: 4 heads, 2 kv heads, 4 layers
    assert (archs["actor"].num_attention_heads, archs["actor"].num_query_groups, archs["actor"].num_layers) == (4, 2, 4)


def test_valid_parallel_layout():
    cfg = load_config("smoke", ["actor.tp=2", "actor.pp=2", "critic.tp=2", "reward.pp=4", "reference.tp=2"])
    assert len(validate(cfg, 8)) == 4


def test_tp_must_divide_heads():
    msg = validation_message(["actor.tp=3"], 3)
    assert "actor.tp=3 must divide num_attention_heads=4" in msg
    assert "actor.tp=3 must divide num_key_value_heads=2" in msg


def test_tp_must_divide_kv_heads_only():
    msg = validation_message(["critic.tp=4"], 4)
    assert "critic.tp=4 must divide num_key_value_heads=2" in msg
    assert "num_attention_heads" not in msg


def test_world_size_divisibility():
    msg = validation_message(["actor.tp=2"], 3)
    assert "actor.tp*actor.pp=2 must divide the world size 3" in msg
    # other roles (tp=pp=1) are fine
    assert "critic" not in msg and "reward" not in msg and "reference" not in msg


def test_pp_must_divide_layers():
    msg = validation_message(["reference.pp=3"], 3)
    assert "reference.pp=3 must divide num_hidden_layers=4" in msg


def test_non_positive_parallel_sizes():
    msg = validation_message(["actor.tp=0"], 1)
    assert "actor.tp=0" in msg and ">= 1" in msg


def test_reward_pointing_at_causal_lm_refused():
    msg = validation_message(["reward.path=builtin:tiny-llama"], 1)
    assert "reward.path='builtin:tiny-llama'" in msg
    assert "LlamaForCausalLM" in msg and "ForSequenceClassification" in msg


def test_critic_may_start_from_a_causal_lm():
    archs = validate(load_config("smoke", ["critic.path=builtin:tiny-llama"]), 1)
    assert archs["critic"].score_head and archs["critic"].hf_class_name == "LlamaForSequenceClassification"


def test_actor_pointing_at_reward_model_refused():
    msg = validation_message(["actor.path=builtin:tiny-llama-rm"], 1)
    assert "actor.path='builtin:tiny-llama-rm'" in msg and "LlamaForSequenceClassification" in msg


def test_unknown_builtin_reported():
    msg = validation_message(["reward.path=builtin:nope"], 1)
    assert "reward.path='builtin:nope'" in msg and "builtin:tiny-llama" in msg


def test_nonexistent_path_reported(tmp_path):
    missing = tmp_path / "nowhere"
    msg = validation_message([f"reference.path={missing}"], 1)
    assert f"reference.path='{missing}'" in msg and "not a directory" in msg


def test_directory_without_config_json_reported(tmp_path):
    msg = validation_message([f"actor.path={tmp_path}"], 1)
    assert "actor.path=" in msg and str(tmp_path / "config.json") in msg


def test_hf_directories_validated(tmp_path):
    actor = write_hf_dir(tmp_path / "actor", tiny_hf_config("Qwen2ForCausalLM"))
    critic = write_hf_dir(tmp_path / "critic", tiny_hf_config("Qwen2ForSequenceClassification", num_labels=1))
    cfg = load_config("smoke", [f"actor.path={actor}", f"critic.path={critic}", "actor.tp=3", "critic.pp=3"])
    archs = validate(cfg, 3)
    assert archs["actor"].family == "qwen2" and archs["actor"].qkv_bias
    assert archs["critic"].score_head
    # 6 heads, 3 kv heads: tp=2 divides the heads but not the kv heads
    msg = validation_message([f"actor.path={actor}", "actor.tp=2"], 2)
    assert "actor.tp=2 must divide num_key_value_heads=3" in msg
    assert "num_attention_heads" not in msg


def test_unsupported_hf_directory_reported(tmp_path):
    bad = write_hf_dir(tmp_path / "gpt2", {**tiny_hf_config("LlamaForCausalLM"), "architectures": ["GPT2LMHeadModel"]})
    msg = validation_message([f"reference.path={bad}"], 1)
    assert "reference.path=" in msg and "GPT2LMHeadModel" in msg


def test_device_and_dtype_checked():
    """Settings with fixed choices are refused as the override is merged, each naming its choices."""
    assert "device='tpu' must be one of ['auto', 'cuda', 'cpu']" in validation_message(["device=tpu"], 1)
    assert "dtype='fp8' must be one of ['auto', 'bf16', 'fp16', 'fp32']" in validation_message(["dtype=fp8"], 1)


def test_output_dir_under_a_file_checked(tmp_path):
    (tmp_path / "somefile").write_text("")
    msg = validation_message([f"output_dir={tmp_path / 'somefile' / 'run'}"], 1)
    assert f"output_dir='{tmp_path / 'somefile' / 'run'}': {tmp_path / 'somefile'} is a file, not a directory" in msg


def test_all_errors_reported_together(tmp_path):
    missing = tmp_path / "missing"
    msg = validation_message(
        [
            "actor.tp=3",
            "critic.path=builtin:tiny-llama-rm",
            "reward.path=builtin:nope",
            f"reference.path={missing}",
            "critic.pp=3",
            "actor.path=builtin:tiny-llama-rm",
        ],
        4,
    )
    expected = [
        "actor.tp*actor.pp=3 must divide the world size 4",
        "actor.tp=3 must divide num_attention_heads=4",
        "actor.tp=3 must divide num_key_value_heads=2",
        "critic.pp=3 must divide num_hidden_layers=4",
        "critic.tp*critic.pp=3 must divide the world size 4",
        "actor.path='builtin:tiny-llama-rm' is a LlamaForSequenceClassification",
        "reward.path='builtin:nope'",
        f"reference.path='{missing}'",
    ]
    for fragment in expected:
        assert fragment in msg, fragment
    lines = [line for line in msg.splitlines()[1:] if line.strip()]
    assert len(lines) >= len(expected)


# --------------------------------------------------------------- layout_errors


def test_layout_errors_direct():
    arch = validate(load_config("smoke"), 1)["actor"]  # 4 heads, 2 groups, ffn 352, 4 layers
    assert layout_errors("actor", 2, 2, arch, 8) == []
    assert layout_errors("actor", 1, 1, arch, 1) == []
    errs = layout_errors("x", 4, 3, arch, 12)
    assert "x.tp=4 must divide num_key_value_heads=2" in errs
    assert "x.pp=3 must divide num_hidden_layers=4" in errs
    assert not any("world size" in e for e in errs)
    assert not any("num_attention_heads" in e for e in errs)
    assert layout_errors("x", 1, 1, arch, 5) == []
    assert layout_errors("x", 2, 1, arch, 5) == ["x.tp*x.pp=2 must divide the world size 5"]


def test_host_threads_auto_is_one_on_a_gpu_unless_an_optimizer_works_on_the_host(monkeypatch) -> None:
    import torch

    from megatron_rlhf.trainer.ppo_config import PPOConfig

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert PPOConfig().host_thread_count(gpu) == 1
    assert PPOConfig().host_thread_count(cpu) is None  # CPU mode: the models run on those threads
    offloaded = load_any_config("ppo-tiny", ["actor_optim.cpu_offload_fraction=0.5"], schema=PPOConfig)
    assert offloaded.host_thread_count(gpu) is None  # the optimizer's Adam step runs on the host
    assert load_any_config("ppo-tiny", ["host_threads=3"], schema=PPOConfig).host_thread_count(gpu) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert PPOConfig().host_thread_count(gpu) is None  # the environment decides
    assert any("host_threads=-1" in e for e in RunConfig(host_threads=-1).errors())
