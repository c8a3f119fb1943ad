"""Checkpoints on remote storage (``checkpoint/remote.py``) against a real S3-compatible server on
localhost (moto's server mode, ``tests/s3_server.py``) and a ``file://`` directory: the layout, the
same with or without a trailing slash; ``latest`` written last, so an interrupted upload leaves the
previous checkpoint in use; ``keep_last`` applied remotely; the download checked against the
manifest; credentials read from the environment; clear errors for a missing bucket, a read-only
user, unknown credentials, hdfs without libhdfs, a missing package, an unknown protocol and a
remote_dir that is not a URL."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import s3_server
from tests.unit import test_run_checkpoint

pytest.importorskip("s3fs", reason="s3fs is in the test extra")

saved = test_run_checkpoint.saved
"""A fixture: one real checkpoint (a trained model before its first update, and a reference's weights)."""


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3_server.S3Server]:
    with s3_server.start(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def s3_env(s3: s3_server.S3Server, monkeypatch: pytest.MonkeyPatch) -> s3_server.S3Server:
    """The writer's credentials and the endpoint in this process's environment, nothing else."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return s3


def _steps(saved_ckpt: Path, root: Path, *steps: int) -> list[Path]:
    """Copies of the saved checkpoint as ``root/step_N`` (a complete checkpoint each: same manifest)."""
    made = []
    for step in steps:
        made.append(root / f"step_{step}")
        shutil.copytree(saved_ckpt, made[-1])
    return made


def _listing(remote) -> list[str]:
    """Every object or file under the remote root, relative to it."""
    return sorted(path[len(remote.root) + 1 :] for path in remote.fs.find(remote.root))


def _url(kind: str, tmp_path: Path, name: str) -> str:
    return f"s3://{s3_server.BUCKET}/{tmp_path.name}/{name}" if kind == "s3" else f"file://{tmp_path}/remote/{name}"


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_upload_layout_is_the_same_with_or_without_a_trailing_slash(
    request: pytest.FixtureRequest, kind: str, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.remote import RemoteDir
    from megatron_rlhf.checkpoint.run_checkpoint import files_under

    if kind == "s3":
        request.getfixturevalue("s3_env")
    (ckpt,) = _steps(saved[0], tmp_path / "local", 3)
    listings = []
    for url in (_url(kind, tmp_path, "plain"), _url(kind, tmp_path, "slash") + "/"):
        remote = RemoteDir(url)
        remote.check_writable()
        remote.upload(ckpt, keep_last=2)
        listings.append(_listing(remote))
        assert remote.complete_steps() == [3] and remote.latest() == 3
    assert listings[0] == listings[1] == ["latest"] + [f"step_3/{rel}" for rel in files_under(ckpt)]


def test_keep_last_applies_remotely_and_the_newest_downloads_verified(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.remote import RemoteDir
    from megatron_rlhf.checkpoint.run_checkpoint import files_under

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    for ckpt in _steps(saved[0], tmp_path / "local", 2, 4, 6):
        remote.upload(ckpt, keep_last=2)
    assert remote.complete_steps() == [4, 6] and remote.latest() == 6
    got = remote.download_newest(tmp_path / "fresh" / "checkpoints", remote.complete_steps())
    assert got == tmp_path / "fresh" / "checkpoints" / "step_6"
    assert files_under(got) == files_under(saved[0])
    assert (got.parent / "latest").read_text() == "step_6\n"
    assert not (got.parent / "step_6.tmp").exists()

    # A changed object in the newest: the previous one is downloaded instead.
    victim = next(rel for rel in files_under(saved[0]) if rel.endswith(".distcp"))
    remote.fs.pipe_file(remote.path("step_6", victim), b"changed")
    got = remote.download_newest(tmp_path / "other" / "checkpoints", remote.complete_steps())
    assert got is not None and got.name == "step_4"


def test_the_health_watchs_best_checkpoint_is_kept_remotely_and_downloaded_with_the_newest(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """A rollback goes back to the best evaluation's checkpoint: remote pruning keeps it as local
    pruning does, and a requeued job that resumes from the remote gets it along with the newest."""
    from megatron_rlhf.checkpoint.remote import RemoteDir
    from megatron_rlhf.checkpoint.run_checkpoint import _write_manifest, copy_problems

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    for ckpt in _steps(saved[0], tmp_path / "local", 2, 4, 6, 8):
        run_state = json.loads((ckpt / "run_state.json").read_text())
        run_state.setdefault("loop", {})["health"] = {"best_step": 4 if ckpt.name != "step_2" else 2}
        (ckpt / "run_state.json").write_text(json.dumps(run_state))
        (ckpt / "manifest.json").unlink()
        _write_manifest(ckpt)
        remote.upload(ckpt, keep_last=2, pinned="step_4")
    assert remote.complete_steps() == [4, 6, 8]
    root = tmp_path / "fresh" / "checkpoints"
    got = remote.download_newest(root, remote.complete_steps())
    assert got == root / "step_8" and (root / "latest").read_text() == "step_8\n"
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step_4", "step_8"]
    assert copy_problems(root / "step_4") == []


def test_an_interrupted_upload_leaves_the_previous_checkpoint_and_is_cleaned_up(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """Leftovers of uploads killed at each point: files under step_4.tmp (killed while uploading),
    a partial step_6 beyond latest (killed while copying it to its name). Neither is read; the
    next upload deletes both."""
    from megatron_rlhf.checkpoint.remote import RemoteDir

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    step_2, step_4, step_6 = _steps(saved[0], tmp_path / "local", 2, 4, 6)
    remote.upload(step_2, keep_last=2)
    remote.fs.put(str(step_4 / "config.yaml"), remote.path("step_4.tmp", "config.yaml"))
    remote.fs.put(str(step_6 / "run_state.json"), remote.path("step_6", "run_state.json"))
    assert remote.latest() == 2 and remote.complete_steps() == [2]
    got = remote.download_newest(tmp_path / "fresh" / "checkpoints", remote.complete_steps())
    assert got is not None and got.name == "step_2"
    remote.upload(step_4, keep_last=2)
    assert [path.rsplit("/", 1)[-1] for path in remote.fs.ls(remote.root, detail=False)] == [
        "latest",
        "step_2",
        "step_4",
    ]


def test_credentials_come_from_the_environment(
    s3: s3_server.S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The server refuses unsigned and unknown keys: the writer's key works only from the environment."""
    from megatron_rlhf.checkpoint.remote import RemoteDir, RemoteStorageError

    url = _url("s3", tmp_path, "creds")
    for name, value in s3.env(("AKIAUNKNOWN0000000000", "not-a-secret")).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RemoteStorageError, match=r"cannot be written: permission denied.*AWS_ACCESS_KEY_ID"):
        RemoteDir(url).check_writable()
    for name, value in s3.env(s3.read_only_key).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RemoteStorageError, match="cannot be written: permission denied"):
        RemoteDir(url).check_writable()
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    RemoteDir(url).check_writable()


def test_a_missing_bucket_is_named_at_start_up(s3_env: s3_server.S3Server) -> None:
    from megatron_rlhf.checkpoint.remote import RemoteDir, RemoteStorageError

    with pytest.raises(RemoteStorageError, match=r"remote_dir='s3://no-such-bucket/x'.*the bucket does not exist"):
        RemoteDir("s3://no-such-bucket/x/").check_writable()
    assert not s3_env.filesystem().exists("no-such-bucket")  # not created


def test_hdfs_without_libhdfs_says_what_it_needs() -> None:
    from megatron_rlhf.checkpoint.remote import RemoteDir, RemoteStorageError

    if os.environ.get("ARROW_LIBHDFS_DIR") or os.environ.get("HADOOP_HOME"):
        pytest.skip("a Hadoop installation is configured here")
    with pytest.raises(RemoteStorageError, match=r"HadoopFileSystem could not start .*libhdfs.*untested"):
        RemoteDir("hdfs://localhost:8020/ckpts")


def test_a_missing_package_or_an_unknown_protocol_is_named() -> None:
    import importlib.util

    from megatron_rlhf.checkpoint.remote import RemoteDir, RemoteStorageError

    with pytest.raises(RemoteStorageError, match=r"remote_dir='nope://x/y': Protocol not known: nope"):
        RemoteDir("nope://x/y")
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(RemoteStorageError, match=r"remote_dir='gs://bucket/x': .*install gcsfs"):
            RemoteDir("gs://bucket/x/")


@pytest.mark.parametrize("bad", ["bucket/prefix", "/shared/ckpts", "s3://", "s3:/bucket"])
def test_remote_dir_must_be_a_url(bad: str) -> None:
    from megatron_rlhf.trainer.loop_config import LoopConfig

    assert any(e.startswith(f"remote_dir={bad!r} must be a URL") for e in LoopConfig(remote_dir=bad).errors())
    assert not [e for e in LoopConfig(remote_dir="s3://bucket/prefix/").errors() if "remote_dir" in e]


def test_a_file_url_with_a_relative_path_is_refused() -> None:
    """Before: file://relative/path was each node's own ./relative/path, out of a requeued job's reach."""
    from megatron_rlhf.trainer.loop_config import LoopConfig

    (error,) = [e for e in LoopConfig(remote_dir="file://relative/path").errors() if "remote_dir" in e]
    assert error.startswith("remote_dir='file://relative/path': a file:// URL takes an absolute path")
    assert not [e for e in LoopConfig(remote_dir="file:///shared/ckpts").errors() if "remote_dir" in e]


def test_the_mirror_uploads_in_the_background_and_reports_a_failure(
    world_of_one, s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.remote import RemoteMirror

    (ckpt,) = _steps(saved[0], tmp_path / "local", 2)
    mirror = RemoteMirror(_url("s3", tmp_path, "run"), keep_last=2)
    mirror.start(ckpt, None)
    mirror.wait(required=True)
    assert mirror.remote is not None and mirror.remote.complete_steps() == [2]
    missing = tmp_path / "local" / "step_4"  # a checkpoint deleted before its upload: the upload fails
    missing.mkdir()
    mirror.start(missing, None)
    with pytest.raises(RuntimeError, match=r"uploading .*step_4 to s3://.* failed"):
        mirror.wait(required=True)
    assert mirror.remote.complete_steps() == [2]


def test_a_resumed_checkpoint_missing_remotely_is_uploaded(
    world_of_one,
    s3_env: s3_server.S3Server,
    saved: tuple[Path, dict, dict],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """remote_dir added to a run, or its final upload failed: the checkpoint it resumes goes up."""
    from megatron_rlhf.checkpoint.remote import RemoteMirror

    step_2, step_4 = _steps(saved[0], tmp_path / "local", 2, 4)
    mirror = RemoteMirror(_url("s3", tmp_path, "run"), keep_last=2)
    assert mirror.remote is not None
    mirror.catch_up(step_2, None)
    mirror.wait(required=True)
    assert mirror.remote.complete_steps() == [2]
    assert "does not hold step_2, the checkpoint resumed: uploading it" in capsys.readouterr().out
    mirror.remote.upload(step_4, keep_last=2)
    mirror.catch_up(step_4, None)  # the remote's latest names it already: nothing to do
    mirror.wait(required=True)
    assert "uploading it" not in capsys.readouterr().out
    # The same step on another branch (the remote's from before a rollback): uploaded over it.
    _rewrite_run_state(step_4, reseeded=[[3, 4]])
    mirror.catch_up(step_4, None)
    mirror.wait(required=True)
    assert "does not hold step_4, the checkpoint resumed: uploading it" in capsys.readouterr().out
    assert mirror.remote.lineage(4) == (1, 4)


def test_a_storage_librarys_own_error_is_a_config_error_naming_remote_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: botocore's NoCredentialsError (no OSError) escaped on rank 0 alone, before the
    broadcast that tells the other ranks, which then waited until the collective timeout."""
    from megatron_rlhf.config.loader import ConfigError
    from megatron_rlhf.trainer import loop
    from megatron_rlhf.trainer.loop_config import LoopConfig

    class NoCredentialsError(Exception):  # botocore's has this name and no OSError base
        pass

    def no_credentials(self: object) -> None:
        raise NoCredentialsError("Unable to locate credentials")

    monkeypatch.setattr(loop.RemoteDir, "check_writable", no_credentials)
    cfg = LoopConfig(remote_dir="s3://bucket/run", output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"remote_dir='s3://bucket/run': NoCredentialsError: Unable to locate"):
        loop._fetch_remote(cfg, tmp_path)


def _rewrite_run_state(ckpt: Path, **loop: object) -> None:
    """Set ``loop`` keys of ``ckpt``'s run_state.json, keeping the checkpoint complete (its manifest anew)."""
    from megatron_rlhf.checkpoint.run_checkpoint import _write_manifest

    run_state = json.loads((ckpt / "run_state.json").read_text())
    run_state.setdefault("loop", {}).update(loop)
    (ckpt / "run_state.json").write_text(json.dumps(run_state))
    (ckpt / "manifest.json").unlink()
    _write_manifest(ckpt)


def test_a_stale_local_checkpoint_gives_way_to_the_remote_ones_further_along(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """Before: a job requeued back onto a node holding step_2 resumed it, and its uploads then
    deleted the remote step_4 and step_6. Further along: a later step, or more rollbacks behind."""
    from megatron_rlhf.checkpoint.remote import RemoteDir
    from megatron_rlhf.trainer import loop
    from megatron_rlhf.trainer.loop_config import LoopConfig

    url = _url("s3", tmp_path, "run")
    remote = RemoteDir(url)
    for ckpt in _steps(saved[0], tmp_path / "uploaded", 2, 4, 6):
        remote.upload(ckpt, keep_last=0)
    out = tmp_path / "node"
    root = out / "checkpoints"
    _steps(saved[0], root, 2)
    cfg = LoopConfig(remote_dir=url, output_dir=str(out))
    loop._fetch_remote(cfg, out)
    assert cfg.resume_from() == root / "step_6" and (root / "latest").read_text() == "step_6\n"
    assert remote.fetch_newer(root, root / "step_6") is None  # level: the local one stands

    # A rollback on another node went back to step_4 and redid step_5: fewer steps, one more rollback.
    (redone,) = _steps(saved[0], tmp_path / "other", 5)
    _rewrite_run_state(redone, reseeded=[[5, 6]])
    remote.upload(redone, keep_last=0)
    assert remote.complete_steps() == [2, 4, 5]  # step_6, of the branch left, is gone
    loop._fetch_remote(cfg, out)
    # The local step_6 (before: left, and resumed as the highest step) goes with the branch it was on.
    assert cfg.resume_from() == root / "step_5" and not (root / "step_6").exists()


def test_remote_checkpoints_that_cannot_be_used_stop_the_run_instead_of_being_replaced(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """Before: each case started a fresh run (exit 0), whose first upload deleted them."""
    from megatron_rlhf.checkpoint.remote import RemoteDir, RemoteStorageError
    from megatron_rlhf.checkpoint.run_checkpoint import files_under

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    step_4, step_6 = _steps(saved[0], tmp_path / "uploaded", 4, 6)
    for ckpt in (step_4, step_6):
        remote.upload(ckpt, keep_last=0)
    root = tmp_path / "fresh" / "checkpoints"

    # Every remote checkpoint changed since it was written.
    victim = next(rel for rel in files_under(saved[0]) if rel.endswith(".distcp"))
    for name in ("step_4", "step_6"):
        remote.fs.pipe_file(remote.path(name, victim), b"changed")
    with pytest.raises(RemoteStorageError, match=r"holds step_4, step_6, none usable .*resume=never overwrite=true"):
        remote.fetch_newer(root, None)
    (local,) = _steps(saved[0], root, 3)  # a local one to continue from: a warning, not a refusal
    assert remote.fetch_newer(root, local) is None
    assert remote.held_steps() == [4, 6]

    # A latest that names no step.
    remote.fs.pipe_file(remote.path("latest"), b"garbage\n")
    with pytest.raises(RemoteStorageError, match=r"/latest holds 'garbage', expected 'step_N'"):
        remote.fetch_newer(root, None)
    assert remote.held_steps() == [4, 6]


def test_whole_checkpoints_after_latest_are_resumed_unless_a_rollback_left_them(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    """An upload stopped between its copy and ``latest`` (on an object store, once a step's objects
    are copied): the copy is whole, and resumed. A branch a rollback left, whose removal stopped
    half-way (fewer rollbacks behind it than behind latest's checkpoint): not resumed."""
    from megatron_rlhf.checkpoint.remote import RemoteDir

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    step_4, step_6 = _steps(saved[0], tmp_path / "uploaded", 4, 6)
    remote.upload(step_4, keep_last=0)
    remote.fs.put(str(step_6), remote.path("step_6"), recursive=True)  # copied; latest still step_4
    got = remote.fetch_newer(tmp_path / "a" / "checkpoints", None)
    assert got is not None and got.name == "step_6"
    remote.fs.rm_file(remote.path("latest"))  # the first upload stopped before its latest
    got = remote.fetch_newer(tmp_path / "b" / "checkpoints", None)
    assert got is not None and got.name == "step_6"

    (redone,) = _steps(saved[0], tmp_path / "other", 5)
    _rewrite_run_state(redone, reseeded=[[5, 6]])
    remote.upload(redone, keep_last=0)  # a rollback to step_4, step_5 redone
    remote.fs.put(str(step_6), remote.path("step_6"), recursive=True)  # the branch left, not yet removed
    got = remote.fetch_newer(tmp_path / "c" / "checkpoints", None)
    assert got is not None and got.name == "step_5"


def test_going_back_removes_the_later_remote_checkpoints_and_an_upload_those_of_another_branch(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.remote import RemoteDir

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    step_2, step_3, step_4, step_6 = _steps(saved[0], tmp_path / "local", 2, 3, 4, 6)
    for ckpt in (step_2, step_4, step_6):
        remote.upload(ckpt, keep_last=0)
    assert remote.remove_beyond(4) == ["step_6"]
    assert remote.latest() == 4 and remote.held_steps() == [2, 4]
    remote.upload(step_3, keep_last=0)  # the run continues from step_2 (resume=PATH): step_4 is another branch's
    assert remote.latest() == 3 and remote.held_steps() == [2, 3]
    assert remote.remove_beyond(0) == ["step_2", "step_3"]  # a fresh start
    assert remote.latest() is None and _listing(remote) == []


def test_resume_never_replaces_remote_checkpoints_only_with_overwrite(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    from megatron_rlhf.checkpoint.remote import RemoteDir
    from megatron_rlhf.config.loader import ConfigError
    from megatron_rlhf.trainer import loop
    from megatron_rlhf.trainer.loop_config import LoopConfig

    url = _url("s3", tmp_path, "run")
    RemoteDir(url).upload(_steps(saved[0], tmp_path / "local", 2)[0], keep_last=0)
    cfg = LoopConfig(remote_dir=url, output_dir=str(tmp_path / "out"), resume="never")
    with pytest.raises(
        ConfigError,
        match=r"holds another run's checkpoints \(step_2\), which resume=never would replace: set overwrite=true",
    ):
        loop._fetch_remote(cfg, tmp_path / "out")
    loop._fetch_remote(
        LoopConfig(remote_dir=url, output_dir=str(tmp_path / "out"), resume="never", overwrite=True), tmp_path / "out"
    )
    RemoteDir(url).fs.pipe_file(RemoteDir(url).path("latest"), b"step_x")
    with pytest.raises(ConfigError, match=r"latest holds 'step_x', expected 'step_N'") as caught:
        loop._fetch_remote(LoopConfig(remote_dir=url, output_dir=str(tmp_path / "out")), tmp_path / "out")
    assert "credentials" not in str(caught.value)  # before: a garbage latest was reported as a storage error


def test_a_remote_removal_interrupted_midway_is_cleaned_up_by_the_next_upload(
    s3_env: s3_server.S3Server, saved: tuple[Path, dict, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An object store deletes a directory's objects in any order: a kill midway can leave step_2
    without run_state.json, which nothing would read or remove again."""
    from megatron_rlhf.checkpoint.remote import RemoteDir

    remote = RemoteDir(_url("s3", tmp_path, "run"))
    step_2, step_4, step_6 = _steps(saved[0], tmp_path / "local", 2, 4, 6)
    for ckpt in (step_2, step_4):
        remote.upload(ckpt, keep_last=0)
    remote.fs.rm_file(remote.path("step_2", "run_state.json"))
    remote.upload(step_6, keep_last=0)
    assert remote.held_steps() == [4, 6] and not remote.fs.exists(remote.path("step_2"))
    assert "step_2: no run_state.json: an interrupted removal" in capsys.readouterr().out
