"""A run checkpoint's faults, in one process (CPU, one gloo rank): every file is covered by the
manifest and any change makes the checkpoint unusable, naming the file; nothing in it is unpickled
unchecked; a save before any update works; a full disk names the file and keeps the previous
checkpoint."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.test_train_state_save import tiny_train_state


@pytest.fixture(scope="module")
def saved(world_of_one, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """A synchronous checkpoint of a trained model that has made no update yet (megatron asserts
    on its empty Adam state unless the save allocates it) and of a model saved as weights."""
    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.roles import RoleModel

    state = tiny_train_state(torch.float32, False)
    arch, groups = state.role.arch, state.role.groups
    reference = RoleModel(
        role="reference",
        arch=arch,
        groups=groups,
        source=None,
        model=build_model(arch, groups, dtype=torch.float32, device=torch.device("cpu")),
    )
    train_states, weights = {"actor": state}, {"reference": reference}
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    RunCheckpointWriter(root, keep_last=2, background=False).save(
        1, train_states=train_states, weights=weights, run_state={"task": {}}, config_yaml="seed: 1\n"
    )
    return root / "step_1", train_states, weights


def _load(ckpt: Path, saved: tuple[Path, dict, dict], trust_unverified: bool = False) -> dict:
    from megatron_rlhf.checkpoint.run_checkpoint import load_run_checkpoint

    _, train_states, weights = saved
    return load_run_checkpoint(ckpt, train_states=train_states, weights=weights, trust_unverified=trust_unverified)


def _copy(saved: tuple[Path, dict, dict], tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoints" / "step_1"
    shutil.copytree(saved[0], ckpt)
    return ckpt


def _files(ckpt: Path) -> list[str]:
    return sorted(path.relative_to(ckpt).as_posix() for path in ckpt.rglob("*") if path.is_file())


def test_a_save_before_any_update_loads(saved: tuple[Path, dict, dict]) -> None:
    assert _load(saved[0], saved) == {"step": 1, "task": {}}


def test_a_synchronous_save_starts_no_process(world_of_one, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the first save of a fresh process: megatron would start its write-results queue's spawned
    Manager (``mcore.results_in_this_process``); the data's round trip is the tests' above."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    children = set(multiprocessing.active_children())
    RunCheckpointWriter(tmp_path, keep_last=1, background=False).save(
        1, train_states={"actor": tiny_train_state(torch.float32, False)}, weights={}, run_state={}, config_yaml=""
    )
    assert (tmp_path / "step_1").is_dir()
    assert set(multiprocessing.active_children()) == children
    assert filesystem_async._results_queue is None


def test_a_changed_byte_in_any_file_makes_the_checkpoint_unusable_naming_it(
    saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.run_checkpoint import UnusableCheckpoint

    files = _files(saved[0])
    assert {
        "run_state.json",
        "config.yaml",
        "manifest.json",
        "rng/rank00000.pt",
        "models/actor/train_state.json",
        "models/actor/rng/rank00000.pt",
        "models/actor/dist/.metadata",
        "models/actor/dist/integrity.json",
        "weights/reference/megatron_rlhf.json",
        "weights/reference/weights/__0_0.distcp",
    } <= set(files)
    for number, rel in enumerate(files):
        ckpt = _copy(saved, tmp_path / str(number))
        data = bytearray((ckpt / rel).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ckpt / rel).write_bytes(bytes(data))
        with pytest.raises(UnusableCheckpoint, match=f"{ckpt}.* is unusable") as err:
            _load(ckpt, saved)
        assert Path(rel).name in str(err.value), rel


@pytest.mark.parametrize(
    "rel",
    [
        "models/actor/dist/integrity.json",
        "weights/reference/weights/integrity.json",
        "rng/rank00000.pt",
        "models/actor/dist/__0_0.distcp",
    ],
)
def test_a_deleted_file_makes_the_checkpoint_unusable_naming_it(
    saved: tuple[Path, dict, dict], tmp_path: Path, rel: str
) -> None:
    from megatron_rlhf.checkpoint.run_checkpoint import UnusableCheckpoint

    ckpt = _copy(saved, tmp_path)
    (ckpt / rel).unlink()
    with pytest.raises(UnusableCheckpoint, match=f"{Path(rel).name}.*missing"):
        _load(ckpt, saved)


def test_a_file_added_to_a_model_directory_makes_the_checkpoint_unusable(
    saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """dist_checkpointing would read a ``common.pt`` beside the shards (its older format)."""
    from megatron_rlhf.checkpoint.run_checkpoint import UnusableCheckpoint

    ckpt = _copy(saved, tmp_path)
    torch.save({}, ckpt / "models" / "actor" / "dist" / "common.pt")
    with pytest.raises(UnusableCheckpoint, match=r"models/actor/dist/common\.pt: not part of the checkpoint"):
        _load(ckpt, saved)


def test_a_checkpoint_without_its_manifest_loads_only_when_trusted(
    saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.run_checkpoint import UnusableCheckpoint

    ckpt = _copy(saved, tmp_path)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(UnusableCheckpoint, match=r"manifest\.json is missing.*trust_unverified_checkpoint=true"):
        _load(ckpt, saved)
    assert _load(ckpt, saved, trust_unverified=True)["step"] == 1


class _Payload:
    """Unpickled, creates the file ``marker``: what a poisoned checkpoint file would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("manifest", ["kept", "rewritten"])
def test_a_poisoned_rng_file_is_never_unpickled(saved: tuple[Path, dict, dict], tmp_path: Path, manifest: str) -> None:
    """A pickle payload in place of a rank's RNG file: refused by its hash, and (manifest rewritten
    to match, as whoever wrote the payload could) by the weights-only reader; it never runs."""
    from megatron_rlhf.checkpoint.run_checkpoint import UnusableCheckpoint, _write_manifest

    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    torch.save({"python": _Payload(marker)}, ckpt / "rng" / "rank00000.pt")
    if manifest == "rewritten":
        (ckpt / "manifest.json").unlink()
        _write_manifest(ckpt)
    with pytest.raises(UnusableCheckpoint, match=r"rng/rank00000\.pt"):
        _load(ckpt, saved)
    assert not marker.exists()


def _draws() -> list[float]:
    """One draw from each generator a checkpoint restores, megatron's tracker included."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracker = torch.rand(()).item()
    return [random.random(), float(np.random.rand()), torch.rand(()).item(), tracker]


def test_rng_states_come_back_exactly(saved: tuple[Path, dict, dict], tmp_path: Path) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter, load_run_checkpoint

    get_cuda_rng_tracker().reset()
    get_cuda_rng_tracker().add("model-parallel-rng", 6)  # what _draws forks
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # numpy keeps a second gaussian: its state carries it
    RunCheckpointWriter(tmp_path, keep_last=1, background=False).save(
        2, train_states={}, weights={}, run_state={}, config_yaml=""
    )
    expected = _draws()
    load_run_checkpoint(tmp_path / "step_2", train_states={}, weights={}, trust_unverified=False)
    assert _draws() == expected


@contextlib.contextmanager
def _small_disk(path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs at ``path`` (root only)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` to ENOSPC, then free ``leave`` bytes."""
    filler = disk / "filler"
    with open(filler, "wb") as file, contextlib.suppress(OSError):
        while True:
            file.write(b"\0" * (1 << 16))
            file.flush()
    os.truncate(filler, max(filler.stat().st_size - leave, 0))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill needs root")
@pytest.mark.parametrize(
    "failing, leave, background",
    [
        ("rng/rank00000.pt", 0, False),  # the save's first file, written by this package
        ("models/actor/dist/__0_0.distcp", 128 << 10, False),  # a shard, by megatron's writer
        ("models/actor/dist/__0_0.distcp", 128 << 10, True),  # the same in the background writer process
    ],
)
def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(
    saved: tuple[Path, dict, dict], tmp_path: Path, failing: str, leave: int, background: bool
) -> None:
    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter, newest_checkpoint, remove_partial

    _, train_states, weights = saved
    with _small_disk(tmp_path / "disk") as disk:
        root = disk / "checkpoints"
        writer = RunCheckpointWriter(root, keep_last=2, background=background)
        save = dict(train_states=train_states, weights=weights, run_state={"task": {}}, config_yaml="seed: 1\n")
        writer.save(1, **save)
        writer.wait()
        _fill(disk, leave)
        with pytest.raises((OSError, RuntimeError), match="No space left on device") as err:
            writer.save(2, **save)
            writer.wait()
        assert str(root / "step_2.tmp" / failing) in str(err.value)
        assert newest_checkpoint(root) == root / "step_1"
        assert _load(root / "step_1", saved)["step"] == 1
        assert remove_partial(root) == [root / "step_2.tmp"]


@pytest.mark.parametrize(("keep_last", "kept"), [(2, ["step_2", "step_3"]), (0, ["step_1", "step_2", "step_3"])])
def test_keep_last_prunes_older_checkpoints_and_zero_keeps_all(
    tmp_path: Path, world_of_one, keep_last: int, kept: list[str]
) -> None:
    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter

    writer = RunCheckpointWriter(tmp_path, keep_last=keep_last, background=False)
    for step in (1, 2, 3):
        writer.save(step, train_states={}, weights={}, run_state={}, config_yaml="")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == kept


def test_a_pruning_killed_midway_leaves_a_leftover_the_next_start_removes(
    tmp_path: Path, world_of_one, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a kill inside the pruning's rmtree left step_1 without some of its files (perhaps
    its run_state.json: then nothing read it, reported it or deleted it again)."""
    from megatron_rlhf.checkpoint import run_checkpoint
    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter, complete_checkpoints, remove_partial

    writer = RunCheckpointWriter(tmp_path, keep_last=1, background=False)
    writer.save(1, train_states={}, weights={}, run_state={}, config_yaml="")

    def killed(path: object) -> None:
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(run_checkpoint.shutil, "rmtree", killed)  # the kill, before rmtree's first file
    with pytest.raises(KeyboardInterrupt):
        writer.save(2, train_states={}, weights={}, run_state={}, config_yaml="")
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_2"]
    assert remove_partial(tmp_path) == [tmp_path / "step_1.removing.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_remove_beyond_deletes_the_later_steps_and_points_latest_back(tmp_path: Path) -> None:
    """A run resumed from an older checkpoint (or rolled back, or started over with overwrite=true)
    leaves no later checkpoint of the run it replaces: pruning took the new ones in their place,
    and a crash's resume took the newest of the old."""
    from megatron_rlhf.checkpoint.run_checkpoint import LATEST_FILE, RUN_STATE_FILE, newest_checkpoint, remove_beyond

    for step in (2, 4, 6):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / RUN_STATE_FILE).write_text("{}")
    (tmp_path / "step_8.tmp").mkdir()  # not complete: remove_partial's
    (tmp_path / LATEST_FILE).write_text("step_6\n")
    assert remove_beyond(tmp_path, 2) == [tmp_path / "step_4", tmp_path / "step_6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2", "step_8.tmp"]
    assert (tmp_path / LATEST_FILE).read_text() == "step_2\n" and newest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert remove_beyond(tmp_path, 0) == [tmp_path / "step_2"]  # a fresh start
    assert not (tmp_path / LATEST_FILE).exists() and newest_checkpoint(tmp_path) is None
