"""What a resumed run may change (``trainer/resume_check.RULES``) and the output_dir lock
(``trainer/run_lock``), without a run: every config key is classified, and the lock refuses a live
or foreign holder and takes over a dead one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rlhf.trainer.ppo_config import PPOConfig
from megatron_rlhf.trainer.resume_check import RULES, ResumeReview, RunFacts, leaf_rules, review_resume
from megatron_rlhf.trainer.rm import RMConfig
from megatron_rlhf.trainer.run_lock import LOCK_FILE, STALE_AFTER_S, OutputDirLocked, acquire, release
from megatron_rlhf.trainer.sft import SFTConfig


def test_every_config_key_has_exactly_one_resume_rule_and_every_rule_is_used() -> None:
    used = set()
    for schema in (PPOConfig, SFTConfig, RMConfig):
        rules = leaf_rules(schema())  # raises KeyError naming an unclassified key
        used |= {owner for _, owner in rules.values()}
    declared = {f"{cls}.{field}" for cls, fields in RULES.items() for field in fields}
    assert declared == used, f"rules for no key: {sorted(declared - used)}"


def _holder(out: Path, **fields: object) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_FILE).write_text(json.dumps(fields) + "\n")


def test_a_critic_and_reference_left_to_the_actor_compare_as_the_actors_path() -> None:
    """A checkpoint whose config.yaml wrote the paths out (as configs did before they stayed empty)
    against a resumed config that leaves them to the actor: the same models, so no change; a moved
    actor moves both."""
    cfg = PPOConfig()
    models = "actor: {path: /m/a}\ncritic: {path: %s}\nreference: {path: %s}\n"
    written, left = models % ("/m/a", "/m/a"), models % ("''", "''")
    facts = RunFacts("ppo", 40, {}, "fp32", "data")
    assert review_resume(cfg, left, written, {}, facts, "").changed == []
    moved = review_resume(cfg, left.replace("/m/a", "/m/b"), written, {}, facts, "").changed
    assert [line.split(" (")[0] for line in moved] == [
        "actor.path: '/m/a' -> '/m/b'",
        "critic.path: '/m/a' -> '/m/b'",
        "reference.path: '/m/a' -> '/m/b'",
    ]


def test_the_dtype_is_compared_as_resolved() -> None:
    """Before: dtype=auto against a checkpoint's dtype=fp32, both fp32 in CPU mode, was refused."""
    cfg = PPOConfig()
    auto, fp32, bf16 = "dtype: auto\n", "dtype: fp32\n", "dtype: bf16\n"
    on_cpu, on_gpu = RunFacts("ppo", 40, {}, "fp32", "data"), RunFacts("ppo", 40, {}, "bf16", "data")
    for recorded in ({"dtype": "fp32"}, {}):  # recorded by the checkpoint, or (older ones) its setting
        review = review_resume(cfg, auto, fp32, recorded, on_cpu, "")
        assert (review.changed, review.refused) == ([], []), recorded
        (refusal,) = review_resume(cfg, auto, fp32, recorded, on_gpu, "").refused
        assert refusal == (
            "dtype: the checkpoint's run trained in fp32, this one would in bf16 "
            "(dtype='auto'; auto is bf16 on a GPU, fp32 on CPU)"
        )
    # A checkpoint that records bf16, written with dtype=auto on a GPU, resumed with dtype=bf16.
    assert review_resume(cfg, bf16, auto, {"dtype": "bf16"}, on_gpu, "").refused == []
    # An older checkpoint written with auto: what it resolved to is unknown, so a change is refused.
    assert review_resume(cfg, fp32, auto, {}, on_cpu, "").refused == ["dtype: 'auto' -> 'fp32'"]


def test_a_reward_model_may_appear_go_or_change_on_resume_and_a_critic_may_not() -> None:
    """Nothing of the reward model is in a checkpoint (it is read from its path at each start), and
    RULES lets scoring.use_reward_model change. Before: adding one to a resumed run was refused."""
    from megatron_rlhf.models.architecture import architecture_from_hf_config
    from megatron_rlhf.models.builtin import builtin_config

    policy = builtin_config("builtin:tiny-llama")
    scorer = architecture_from_hf_config(builtin_config("builtin:tiny-llama-rm"))
    actor = architecture_from_hf_config(policy)
    cfg, same = PPOConfig(), "seed: 1\n"
    saved = {"trainer": "ppo", "models": {"actor": policy}}
    with_reward = RunFacts("ppo", 40, {"actor": actor, "reward": scorer}, "fp32", "data")
    assert review_resume(cfg, same, same, saved, with_reward, "").refused == []
    saved_with_reward = {"trainer": "ppo", "models": {"actor": policy, "reward": policy}}
    assert (
        review_resume(
            cfg, same, same, saved_with_reward, RunFacts("ppo", 40, {"actor": actor}, "fp32", "data"), ""
        ).refused
        == []
    )
    with_critic = RunFacts("ppo", 40, {"actor": actor, "critic": scorer}, "fp32", "data")
    assert review_resume(cfg, same, same, saved, with_critic, "").refused == [
        "the run uses a critic that the checkpoint's run did not"
    ]


def test_a_checkpoint_of_another_trainer_or_of_resized_data_is_refused() -> None:
    """Before: ppo resumed an sft run's checkpoint (the same single model, so nothing differed that
    was compared), and a training file cut from 40 to 20 rows changed the data order unseen."""
    cfg, same = PPOConfig(), "seed: 1\n"
    sft_state = {"trainer": "sft", "examples": 40}
    (refusal,) = review_resume(cfg, same, same, sft_state, RunFacts("ppo", 40, {}, "fp32", "data"), "").refused
    assert refusal.startswith("the checkpoint was written by 'sft', this run is 'ppo'")
    (refusal,) = review_resume(
        cfg, same, same, {"trainer": "ppo", "examples": 40}, RunFacts("ppo", 20, {}, "fp32", "data"), ""
    ).refused
    assert "the training data now has 20 examples, the checkpoint's run had 40" in refusal
    # A checkpoint from before these were recorded is not compared on them.
    assert review_resume(cfg, same, same, {}, RunFacts("ppo", 20, {}, "fp32", "data"), "").refused == []


def test_the_training_data_is_compared_by_content_not_by_file_name(tmp_path: Path) -> None:
    """Before: data.train was compared by name. A file rewritten in place with as many rows resumed
    silently at another data position; the same data copied to a node's own disk was refused."""
    from megatron_rlhf.data import load_sft_dataset
    from megatron_rlhf.data.datasets import content_digest
    from megatron_rlhf.data.tokenizer import ByteTokenizer

    def digest(name: str, responses: tuple[str, ...]) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": "p", "response": r}) + "\n" for r in responses))
        return content_digest(load_sft_dataset(path, ByteTokenizer(300), max_length=32)[0])

    original = digest("a.jsonl", ("x", "y"))
    assert digest("copy.jsonl", ("x", "y")) == original and digest("a.jsonl", ("x", "z")) != original
    cfg = PPOConfig()
    old, moved = "data:\n  train: [a.jsonl]\n", "data:\n  train: [/local/copy.jsonl]\n"
    saved = {"trainer": "ppo", "examples": 2, "data": original}
    review = review_resume(cfg, moved, old, saved, RunFacts("ppo", 2, {}, "fp32", original), "")
    assert review.refused == [] and any("compared by the examples' content" in line for line in review.changed)
    (refusal,) = review_resume(cfg, old, old, saved, RunFacts("ppo", 2, {}, "fp32", "other"), "").refused
    assert refusal.startswith("the training examples' content differs from the checkpoint's run's")
    # A checkpoint that records no digest: the files' names are compared, as before.
    (refusal,) = review_resume(cfg, moved, old, {"examples": 2}, RunFacts("ppo", 2, {}, "fp32", original), "").refused
    assert refusal == "data.train: ['a.jsonl'] -> ['/local/copy.jsonl']"


def test_a_lock_of_a_live_process_is_refused_and_a_dead_ones_taken_over(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(live.pid).create_time()
        _holder(tmp_path, host=socket.gethostname(), pid=live.pid, process_started=started, started="then")
        with pytest.raises(OutputDirLocked, match=rf"in use by another run: pid {live.pid} on .*{LOCK_FILE}"):
            acquire(tmp_path)
    finally:
        live.kill()
        live.wait()
    lock = acquire(tmp_path)  # the same holder, now dead
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert acquire(tmp_path) == lock  # held by this process already
    release(lock)
    assert not lock.exists()


def test_a_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    """This process's pid with another start time: the holder died and its pid was given again."""
    _holder(tmp_path, host=socket.gethostname(), pid=os.getppid(), process_started=1.0, started="long ago")
    assert json.loads(acquire(tmp_path).read_text())["pid"] == os.getpid()


def test_a_lock_of_another_host_is_refused_while_fresh_and_taken_over_once_stale(tmp_path: Path) -> None:
    """Another host's process cannot be checked: its lock counts while its holder refreshes it (a
    requeued Slurm job on a new node after its first node died takes it over once it is stale)."""
    _holder(tmp_path, host="node-17", pid=4242, process_started=1.0, started="yesterday")
    lock = tmp_path / LOCK_FILE
    with pytest.raises(OutputDirLocked, match=rf"host node-17 \(pid 4242.*refreshed 0 s ago.*delete {lock}"):
        acquire(tmp_path)
    assert json.loads(lock.read_text())["host"] == "node-17"
    stale = time.time() - STALE_AFTER_S - 1
    os.utime(lock, (stale, stale))
    assert acquire(tmp_path) == lock and json.loads(lock.read_text())["pid"] == os.getpid()
    release(lock)


def test_the_holder_refreshes_its_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.trainer import run_lock

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = acquire(tmp_path)
    os.utime(lock, (1.0, 1.0))
    deadline = time.time() + 5
    while lock.stat().st_mtime < 2.0 and time.time() < deadline:
        time.sleep(0.05)
    assert time.time() - lock.stat().st_mtime < 5
    release(lock)
    assert not lock.exists()


def test_the_same_command_restarted_before_its_first_checkpoint_starts_over(tmp_path: Path) -> None:
    """A run SIGKILLed after some steps, before any checkpoint, left config.yaml and training lines.
    Before: the same command (a Slurm requeue) was refused as "another run's files". A changed
    config, or a run that finished (result.json: its export is kept), is still refused."""
    import dataclasses

    from megatron_rlhf.config.loader import ConfigError, to_yaml
    from megatron_rlhf.trainer import loop

    cfg = SFTConfig(output_dir=str(tmp_path), max_steps=10, save_every=5)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    (tmp_path / "metrics.jsonl").write_text('{"split": "train", "step": 3}\n')
    loop._check_output_dir(cfg, tmp_path)
    with pytest.raises(ConfigError, match=r"holds another run's files \(config.yaml, metrics.jsonl\)"):
        loop._check_output_dir(dataclasses.replace(cfg, max_steps=20), tmp_path)
    (tmp_path / "result.json").write_text("{}\n")
    with pytest.raises(ConfigError, match="holds another run's files"):
        loop._check_output_dir(cfg, tmp_path)


def _take_over_when_released(out: Path, start: object, done: object, results: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    try:
        acquire(out)
        results.put("held")  # type: ignore[attr-defined]
    except OutputDirLocked:
        results.put("refused")  # type: ignore[attr-defined]
    done.wait()  # type: ignore[attr-defined]  # holding it until every process has tried


def test_of_processes_taking_over_one_stale_lock_together_exactly_one_holds_it(tmp_path: Path) -> None:
    """Before: each read the dead holder, deleted the lock file and made its own, and a slower one
    deleted a faster one's fresh lock: two holders (2 of 15 tries of a pair)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    processes = 6
    for round_ in range(8):
        out = tmp_path / f"round_{round_}"
        _holder(out, host=socket.gethostname(), pid=os.getpid(), process_started=1.0, started="long ago")
        start, done, results = context.Barrier(processes), context.Barrier(processes), context.Queue()
        workers = [
            context.Process(target=_take_over_when_released, args=(out, start, done, results)) for _ in range(processes)
        ]
        for worker in workers:
            worker.start()
        outcomes = sorted(results.get(timeout=60) for _ in workers)
        for worker in workers:
            worker.join(timeout=60)
        assert outcomes == ["held"] + ["refused"] * (processes - 1), f"round {round_}: {outcomes}"


def test_resume_never_refuses_complete_checkpoints_whatever_else_the_output_dir_holds(tmp_path: Path) -> None:
    """Before: without metrics.jsonl (loggers=[console]) the run counted as one that completed no
    step, and its fresh start deleted checkpoints/step_5."""
    from megatron_rlhf.config.loader import ConfigError
    from megatron_rlhf.trainer import loop

    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_5" / "run_state.json").write_text("{}")
    for files in ({}, {"config.yaml": "seed: 1\n"}):
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        with pytest.raises(
            ConfigError, match=r"holds another run's checkpoints \(checkpoints/step_5\), which resume=never"
        ):
            loop._check_output_dir(SFTConfig(output_dir=str(tmp_path), resume="never"), tmp_path)
    loop._check_output_dir(SFTConfig(output_dir=str(tmp_path), resume="never", overwrite=True), tmp_path)


def test_add_bos_is_compared_as_resolved_and_an_older_checkpoints_false_is_explained() -> None:
    """data.add_bos=null is recorded as what the tokenizer made of it; a checkpoint written when false
    was the default resumes where the tokenizer adds no BOS, and is refused, with the fix, where it does."""
    cfg, facts = PPOConfig(), RunFacts("ppo", 40, {}, "fp32", "data")
    older = "data:\n  add_bos: false\n"
    assert review_resume(cfg, older, older, {}, facts, "") == ResumeReview([], [])
    review = review_resume(cfg, "data:\n  add_bos: true\n", older, {}, facts, "")
    assert review.refused == ["data.add_bos: False -> True"]
    (changed,) = review.changed
    assert "data.add_bos=false continues such a run as it was" in changed
