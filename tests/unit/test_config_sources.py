"""A user's run builds on the library defaults and nothing else, says where each setting came from,
and refuses at --print-config what the run would refuse; verl's keys are answered with ours."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from megatron_rlhf.cli import build_parser, main
from megatron_rlhf.commands import TRAINERS
from megatron_rlhf.commands.config_args import settings_report
from megatron_rlhf.config.annotated import annotated_yaml
from megatron_rlhf.config.loader import (
    COMMAND_LINE,
    ConfigError,
    library_defaults,
    load_config,
    load_config_with_sources,
    presets,
)
from megatron_rlhf.config.verl_names import VERL_NAMES, verl_key_hint
from megatron_rlhf.docs import DOCS, PAGES, rendered

USER_RUNS = {
    "ppo": [
        "actor.path=/models/policy",
        "data.train=[train.parquet]",
        "scoring.custom_function.path=reward.py",
        "scoring.custom_function.name=default_compute_score",
    ],
    "sft": ["model.path=/models/base", "data.train=[train.jsonl]", "optim.lr=2e-5"],
    "rm": ["model.path=/models/base", "data.train=[prefs.jsonl]"],
}


@pytest.mark.parametrize("command", ["ppo", "sft", "rm", "plan"])
def test_a_trainer_command_without_config_builds_on_no_preset(command: str) -> None:
    assert build_parser().parse_args([command]).config is None


@pytest.mark.parametrize("command", list(USER_RUNS))
def test_a_users_run_differs_from_the_library_defaults_only_where_it_says(command: str) -> None:
    """Nothing reaches a run without --config but its own settings (a preset that leaked in would
    show up here with its own origin)."""
    cfg, sources = load_config_with_sources(None, USER_RUNS[command], schema=TRAINERS[command].trainer().schema)
    given = {item.split("=")[0] for item in USER_RUNS[command]}
    assert {c.key for c in sources.changed} == given
    assert all(c.origin == COMMAND_LINE for c in sources.changed)
    assert sources.report().startswith("settings: library defaults (no --config)")
    if command == "ppo":
        assert cfg.scoring.rules == [] and not cfg.scoring.use_reward_model
        assert cfg.role("critic").path == cfg.role("reference").path == "/models/policy"
        assert cfg.critic.path == cfg.reference.path == ""  # kept empty: a saved config still follows the actor
        assert cfg.actor_optim.lr == 1e-6 and cfg.algorithm.loss.kl_loss_coef == 0.0
        assert cfg.algorithm.loss.clip_low == cfg.algorithm.loss.clip_high == 0.2


def test_a_saved_config_keeps_the_critic_and_reference_following_the_actor(tmp_path: Path) -> None:
    """--print-config's YAML of a run whose critic and reference start from the actor, loaded again
    with another actor.path: they start from the new one (a saved resolved path would not)."""
    schema = TRAINERS["ppo"].trainer().schema
    cfg, sources = load_config_with_sources(None, USER_RUNS["ppo"], schema=schema)
    saved = tmp_path / "run.yaml"
    saved.write_text(annotated_yaml(cfg, sources.report()))
    moved = load_config(str(saved), ["actor.path=/models/policy-v2"], schema=schema)
    assert moved.role("critic").path == moved.role("reference").path == "/models/policy-v2"
    pinned = load_config(str(saved), ["actor.path=/models/policy-v2", "reference.path=/models/policy"], schema=schema)
    assert pinned.role("reference").path == "/models/policy" and pinned.role("critic").path == "/models/policy-v2"


@pytest.mark.parametrize("preset", presets())
def test_every_preset_is_named_and_is_the_origin_of_what_it_sets(preset: str) -> None:
    from megatron_rlhf.trainer.smoke import SmokeConfig

    command = next((c for c in TRAINERS if preset.startswith(f"{c}-")), None)
    schema = TRAINERS[command].trainer().schema if command else SmokeConfig
    _, sources = load_config_with_sources(preset, [], schema=schema)
    assert sources.report().startswith(f"settings: built on preset {preset}")
    assert sources.changed
    assert all(c.origin.startswith("preset ") for c in sources.changed)


def test_origins_follow_the_merge_order(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("_base_: ppo-tiny\nactor_optim: {lr: 3.0e-6}\nrollout:\n  sampling: {n: 8}\n")
    cfg, sources = load_config_with_sources(
        str(run), ["rollout.sampling.n=6", "seed=7"], schema=TRAINERS["ppo"].trainer().schema
    )
    origin = {c.key: c.origin for c in sources.changed}
    assert origin["actor_optim.lr"] == str(run) and cfg.actor_optim.lr == 3e-6
    assert origin["rollout.sampling.n"] == COMMAND_LINE and cfg.rollout.sampling.n == 6
    assert origin["seed"] == COMMAND_LINE
    assert origin["scoring.rules"] == origin["algorithm.loss.kl_loss_coef"] == "preset ppo-tiny"
    assert "algorithm.loss.clip_low" not in origin  # ppo-tiny sets it to the default: not a difference
    report = sources.report()
    assert report.startswith(f"settings: built on {run}")
    assert "actor_optim.lr" in report and f"(default 1e-06; {run})" in report


def test_print_config_runs_the_checks_a_run_makes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong group size, a missing reward model and a zero timeout are refused by --print-config,
    and a good config is printed with its differences from the defaults as comments."""
    base = ["--config", "ppo-tiny", f"output_dir={tmp_path / 'run'}"]
    assert (
        main(
            [
                "ppo",
                *base,
                "rollout.sampling.n=1",
                "scoring.use_reward_model=true",
                f"reward.path={tmp_path / 'no-rm'}",
                "dist_timeout_s=0",
                "--print-config",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "rollout.sampling.n=1: the grpo estimator compares the samples of a prompt" in err
    assert f"reward.path='{tmp_path / 'no-rm'}'" in err and "is not a directory" in err
    assert "dist_timeout_s=0.0 must be > 0" in err
    assert main(["ppo", *base, "seed=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# settings: built on preset ppo-tiny;")
    assert "#   seed  " in out and "(default 1234; command line)" in out and "\nseed: 3\n" in out


def test_a_clip_past_1_and_a_decay_inside_the_warm_up_are_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: clip_low=1.5 failed after the models were built, unnamed; decay_steps below
    warmup_steps was quietly raised to warmup_steps + 1."""
    settings = ["algorithm.loss.clip_low=1.5", "actor_optim.decay_style=cosine", "actor_optim.warmup_steps=500"]
    settings += ["actor_optim.decay_steps=100", f"output_dir={tmp_path}", "--print-config"]
    assert main(["ppo", "--config", "ppo-tiny", *settings]) == 2
    err = capsys.readouterr().err
    assert "algorithm.loss.clip_low=1.5 must be < 1" in err
    assert "actor_optim.decay_steps=100 must be above warmup_steps=500" in err


def test_settings_a_run_would_silently_ignore_are_refused_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a budget below one sequence was exceeded, eval_every without validation data and a
    profiled step past the end did nothing, and a stop id past the vocabulary never stopped."""
    settings = ["max_tokens_per_micro_batch=16", "eval_every=5", "max_steps=1", "profile_steps=[5]"]
    settings += ["rollout.sampling.stop_token_ids=[99999]", f"output_dir={tmp_path}", "--print-config"]
    assert main(["ppo", "--config", "ppo-tiny", *settings]) == 2
    err = capsys.readouterr().err
    assert "max_tokens_per_micro_batch=16 is below the longest sequence" in err and "= 88 tokens" in err
    assert "eval_every=5 evaluates data.validation, which is empty" in err
    assert "profile_steps=[5]: [5] come after max_steps=1" in err
    assert "rollout.sampling.stop_token_ids=[99999] holds ids outside the actor's vocabulary" in err


def test_a_health_watch_that_could_never_fire_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a misspelled phase, a KL limit without a reference, and sft given an RL signal were
    accepted, and the watch never acted on them."""
    ppo = ["ppo", "--config", "ppo-tiny", f"output_dir={tmp_path}", "--print-config"]
    assert main([*ppo, "health.max_phase_s={genn: 1, step: 9}", "health.roll_back_on=[slow]"]) == 2
    assert (
        "health.max_phase_s: ['genn'] are not phases of this run; they are ['gen', 'reward'" in capsys.readouterr().err
    )
    assert main([*ppo, "health.max_kl=5", "algorithm.loss.kl_loss_coef=0"]) == 2  # ppo-tiny's only KL term
    assert (
        "health.max_kl=5.0: this run has no figure the kl_blowup signal could act on (no KL" in capsys.readouterr().err
    )
    assert main([*ppo, "health.max_phase_s={step: 9, gen: 5}", "health.max_phase_std_s={update_actor: 1}"]) == 0
    # ppo-tiny samples at most 24 tokens, 4 per prompt
    lengths = ["health.min_response_length=30", "health.max_response_length=100", "critic.lora.rank=8"]
    assert main([*ppo, *lengths, "health.max_uniform_group_fraction=0.5", "rollout.sampling.n=1"]) == 2
    err = capsys.readouterr().err
    assert "health.min_response_length=30.0 is not below rollout.sampling.max_new_tokens=24: every step" in err
    assert "health.max_response_length=100.0 is not below rollout.sampling.max_new_tokens=24: length_blowup" in err
    assert "health.max_uniform_group_fraction=0.5: this run has no figure the uniform_groups signal" in err
    assert "critic.lora.rank=8: this run builds no critic (algorithm.advantage_estimator='grpo')" in err
    sft = ["sft", "--config", "sft-tiny", "data.train=[builtin:arithmetic-sft]", f"output_dir={tmp_path}"]
    assert main([*sft, "health.min_entropy=1", "health.max_phase_std_s={step: 1}", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "health.min_entropy=1.0: this run has no figure the entropy_collapse signal could act on" in err
    assert "health.max_phase_std_s: ['step'] are not phases of this run; they are []" in err


def test_a_run_refuses_a_bad_config_before_torch_distributed_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dist_timeout_s=0 used to reach torch.distributed's start-up and end in a C++ stack; the run's
    checks now come first (before the settings report, which comes before torch.distributed)."""
    assert (
        main(
            [
                "sft",
                "--config",
                "sft-tiny",
                "data.train=[builtin:lowercase-prompts]",
                "dist_timeout_s=0",
                f"output_dir={tmp_path}",
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert "dist_timeout_s=0.0 must be > 0" in captured.err and "settings:" not in captured.out


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("actor_rollout_ref.rollout.n=4", "this is verl's name; here it is rollout.sampling.n"),
        ("trainer.total_epochs=1", "here it is num_epochs"),
        ("data.val_files=[v.parquet]", "here it is data.validation"),
        ("trainer.save_freq=-1", "verl's -1 (never) is `save_every=0 save_final=false`"),
        ("actor_rollout_ref.rollout.multi_turn.enable=true", "here it is rollout.multi_turn.enable"),
        (
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true",
            "verl's actor_rollout_ref.rollout.multi_turn.*; it has no counterpart",
        ),
        ("trainer.made_up=1", "a verl key with no counterpart here"),
    ],
)
def test_a_verl_key_is_answered_with_this_projects_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], schema=TRAINERS["ppo"].trainer().schema)
    assert f"unknown key '{override.split('=')[0]}'" in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize(
    ("override", "meant"),
    [("data.max_prompt_length=64", "did you mean data.max_length=64?"), ("actor_rollout_ref.actor.optim.lr=1", "")],
)
def test_a_verl_ppo_key_given_to_sft_gets_no_ppo_answer(override: str, meant: str) -> None:
    """Before: sft was told data.max_prompt_length is "here data.max_prompt_length" (a ppo key, as
    is actor_optim.lr, which it was given for verl's actor optimizer)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], schema=TRAINERS["sft"].trainer().schema)
    assert "verl's" not in str(info.value) and meant in str(info.value)


def _is_key(schema: type, dotted: str) -> bool:
    cls: typing.Any = schema
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return True


def test_every_key_the_verl_table_names_exists() -> None:
    schema = TRAINERS["ppo"].trainer().schema
    named = [key for rows in VERL_NAMES.values() for row in rows for key in row.here]
    assert named and [key for key in named if not _is_key(schema, key)] == []
    assert verl_key_hint("rollout.sampling.n") is None and verl_key_hint("data.train") is None


@pytest.mark.parametrize("page", list(PAGES))
def test_generated_doc_pages_are_up_to_date(page: str) -> None:
    assert (DOCS / page).read_text() == rendered(page), f"run: python -m megatron_rlhf.docs (docs/{page})"


def test_the_defaults_page_lists_every_key_of_every_trainer() -> None:
    from megatron_rlhf.config.loader import to_yaml

    text = (DOCS / "defaults.md").read_text()
    for command in ("ppo", "sft", "rm"):
        schema = TRAINERS[command].trainer().schema
        assert to_yaml(load_config(None, [], schema=schema)) == to_yaml(schema())
        for field in dataclasses.fields(schema):
            assert f"| `{field.name}" in text


def test_a_setting_given_twice_on_the_command_line_is_reported_with_both_values() -> None:
    """The last value wins, as in OmegaConf; before, the first vanished with no word (a launch script's
    default and a user's value for the same key)."""
    schema = TRAINERS["ppo"].trainer().schema
    cfg, sources = load_config_with_sources(
        None, [*USER_RUNS["ppo"], "actor_optim.lr=5e-6", "actor_optim.lr=1e-5"], schema=schema
    )
    assert cfg.actor_optim.lr == 1e-5
    assert sources.report().endswith(
        "warning: actor_optim.lr is given 2 times on the command line (5e-06, 1e-05): the last is used"
    )
    _, once = load_config_with_sources(None, [*USER_RUNS["ppo"], "actor_optim.lr=1e-5"], schema=schema)
    assert "warning" not in once.report()


def test_a_yaml_mapping_without_a_space_after_its_colon_is_explained() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["scoring.weights={exact_answer:0.5}"], schema=TRAINERS["ppo"].trainer().schema)
    assert str(info.value) == (
        "override 'scoring.weights={exact_answer:0.5}': YAML reads 'exact_answer:0.5' as a key with no value; "
        "write {exact_answer: 0.5}, with a space after the colon"
    )


GIVEN_WITHOUT_EFFECT = {
    "critic.path=/models/critic": "algorithm.advantage_estimator='grpo' uses no critic",
    "critic_optim.lr=2e-06": "algorithm.advantage_estimator='grpo' uses no critic",
    "algorithm.advantage.lam=0.9": "the grpo estimator does not read it",
    "algorithm.loss.kl_estimator=k2": "algorithm.loss.kl_loss_coef=0: no KL loss",
    "algorithm.kl_penalty.target_kl=0.2": "algorithm.kl_penalty.coef=0: no KL penalty",
    "algorithm.kl_penalty_estimator=k3": "algorithm.kl_penalty.coef and algorithm.loss.kl_loss_coef are 0: no "
    "reference is built",
    "num_epochs=3": "max_steps=5 sets the run's length",
    "save_every=10": "the run ends at max_steps=5, before the first save",
    "scoring.overlong.penalty=0.5": "scoring.overlong.buffer=0 turns the over-long penalty off",
    "rollout.max_sample_batches=2": "rollout.filter_groups=false",
    "eval.n=4": "data.validation is empty: no evaluation",
    "actor_optim.min_lr=1e-07": "actor_optim.decay_style=constant: the learning rate stays at lr after the warm-up",
}


def test_a_given_setting_the_run_reads_nothing_of_is_warned_of_with_why(tmp_path: Path) -> None:
    """Before, each of these changed nothing and said nothing. The settings of a preset or a file (one
    --print-config wrote holds every algorithm's) are not warned of; nor are those a run reads."""
    schema = TRAINERS["ppo"].trainer().schema
    run = [*USER_RUNS["ppo"], "algorithm.advantage_estimator=grpo", "max_steps=5"]
    cfg, sources = load_config_with_sources(None, [*run, *GIVEN_WITHOUT_EFFECT], schema=schema)
    warned = [line for line in settings_report(cfg, sources).splitlines() if line.startswith("warning")]
    assert sorted(warned) == sorted(
        f"warning: {setting} (command line) has no effect: {why}" for setting, why in GIVEN_WITHOUT_EFFECT.items()
    )
    file = tmp_path / "run.yaml"
    file.write_text("critic:\n  path: /models/critic\n")
    cfg, sources = load_config_with_sources(str(file), run, schema=schema)
    assert "warning" not in settings_report(cfg, sources)  # a file (--print-config's) holds every algorithm's
    read = ["algorithm.advantage_estimator=gae", "algorithm.advantage.lam=0.9", "critic.path=/models/critic"]
    read += [
        "algorithm.kl_penalty.coef=0.01",
        "algorithm.kl_penalty.type=adaptive",
        "algorithm.kl_penalty.target_kl=0.2",
        "algorithm.kl_penalty_estimator=k3",  # with a reference, the logged KL's (and health.max_kl's)
    ]
    cfg, sources = load_config_with_sources(None, [*USER_RUNS["ppo"], *read], schema=schema)
    assert "warning" not in settings_report(cfg, sources)
    fixed = ["algorithm.kl_penalty.coef=0.01", "algorithm.kl_penalty.target_kl=0.2"]
    cfg, sources = load_config_with_sources(None, [*USER_RUNS["ppo"], *fixed], schema=schema)
    assert settings_report(cfg, sources).endswith(
        "warning: algorithm.kl_penalty.target_kl=0.2 (command line) has no effect: algorithm.kl_penalty.type='fixed' "
        "does not read it"
    )
    for preset in ("ppo-tiny", "ppo-grpo-1.5b"):
        cfg, sources = load_config_with_sources(preset, [], schema=schema)
        assert cfg.without_effect() and "warning" not in settings_report(cfg, sources)


@pytest.mark.parametrize(
    ("command", "settings"),
    [
        ("ppo", []),
        ("ppo", ["algorithm.advantage_estimator=grpo", "max_steps=3", "save_every=9", "reference.update=periodic"]),
        ("sft", ["max_steps=3", "save_every=9"]),
        ("rm", ["max_steps=3", "save_every=9"]),
    ],
)
def test_every_setting_said_to_have_no_effect_exists(command: str, settings: list[str]) -> None:
    """A misspelt key in ``without_effect`` would never match a given setting: each names a setting or
    a section of the schema."""
    schema = TRAINERS[command].trainer().schema
    keys = set(library_defaults(schema))
    unread = load_config(None, [*USER_RUNS[command], *settings], schema=schema).without_effect()
    assert unread
    for key in unread:
        assert key in keys or any(k.startswith(key + ".") for k in keys), key
