"""Benchmark: a run checkpoint of the actor's train state copied to remote storage (``remote_dir``)
and back, and what a background upload costs the training steps that run beside it.

    python scripts/bench/remote_upload.py --model builtin:llama-1.5b --dir /tmp/bench_remote   # one GPU
    python scripts/bench/remote_upload.py --model builtin:tiny-llama --dir /tmp/bench_remote   # CPU check

The actor's train state (weights, distributed-optimizer state, LR schedule; built and stepped as
``checkpoint.py`` does) is saved once through ``RunCheckpointWriter``. Then, one JSON line per
figure (a run cut short keeps what it measured):

* ``upload_GBps`` / ``download_GBps``: ``RemoteDir.upload`` (``step_N.tmp``, copy to ``step_N``,
  ``latest``: exactly what a run does) and ``download_newest`` back (checked against the manifest),
  with ``--target s3`` to an S3 server on localhost (moto's server mode, ``tests/s3_server.py``: a
  Python server on the same host, so a floor for a real object store's rate, not a ceiling; it
  assembles a multipart object in memory, which a 25 GB shard can exhaust), with ``--target file``
  to a ``file://`` folder on the same disk (a shared file system mount's path through fsspec);
* ``step_s_idle`` / ``step_s_uploading``: the median training step (forward, backward, optimizer;
  ``--tokens`` tokens) with no upload, and while that upload runs in a background thread as
  ``RemoteMirror`` runs it (up to ``--steps`` steps each); ``upload_step_cost`` is their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from common import RunningReport, clock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.s3_server, run by its path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:llama-1.5b")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_remote"), help="local work folder (emptied)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per training step of the cost figure")
    parser.add_argument("--steps", type=int, default=20, help="training steps of the idle figure")
    parser.add_argument(
        "--target",
        choices=["s3", "file"],
        default="s3",
        help="s3: moto's S3 server on localhost; file: a file:// folder on the same disk",
    )
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()

    from megatron_rlhf.checkpoint.remote import RemoteDir
    from megatron_rlhf.checkpoint.run_checkpoint import RunCheckpointWriter
    from megatron_rlhf.checkpoint.sources import ModelConfig, architecture_of, build_role
    from megatron_rlhf.config.run import resolve_dtype
    from megatron_rlhf.parallel.distributed import init_distributed
    from megatron_rlhf.training.objectives import sft_loss
    from megatron_rlhf.training.optim import OptimConfig, make_train_state
    from megatron_rlhf.training.train import train_step
    from tests import s3_server

    env = init_distributed(args.device)
    assert env.world_size == 1, "one process: the upload is rank 0's work"
    dtype = resolve_dtype("auto", env.device)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    report = RunningReport(args.out, model=args.model, device=env.device.type, dtype=str(dtype).removeprefix("torch."))

    role = build_role(
        "actor", ModelConfig(path=args.model), architecture_of(args.model), world_size=1, dtype=dtype, device=env.device
    )
    state = make_train_state(role, OptimConfig(lr=1e-6))
    length = 512
    ids = torch.randint(
        0, role.arch.vocab_size, (max(args.tokens // length, 1), length), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    loss = sft_loss(role)

    def step_seconds() -> float:
        start = clock(env.device)
        train_step(state, batch, loss, max_tokens_per_micro_batch=args.tokens)
        return clock(env.device) - start

    step_seconds()  # the Adam state exists before the save; kernels warm
    writer = RunCheckpointWriter(args.dir / "local", keep_last=1, background=False)
    start = time.perf_counter()
    writer.save(1, train_states={"actor": state}, weights={}, run_state={}, config_yaml="")
    ckpt = args.dir / "local" / "step_1"
    size = sum(path.stat().st_size for path in ckpt.rglob("*") if path.is_file())
    report.add(size_GB=size / 1e9, local_save_s=time.perf_counter() - start)

    def timed_upload(remote: RemoteDir) -> float:
        start = time.perf_counter()
        remote.upload(ckpt, keep_last=1)
        return time.perf_counter() - start

    with contextlib.ExitStack() as stack:
        if args.target == "s3":
            server = stack.enter_context(s3_server.start(args.dir / "moto.log"))
            os.environ.update(server.env())
            remote = RemoteDir(f"s3://{s3_server.BUCKET}/run")
        else:
            remote = RemoteDir(f"file://{args.dir / 'file-remote'}")
        remote.check_writable()
        # The upload runs in a background thread as RemoteMirror runs it; training steps are timed
        # beside it (up to --steps), against as many with no upload.
        idle = [step_seconds() for _ in range(args.steps)]
        seconds_box: list[float] = []

        def upload() -> None:
            seconds_box.append(timed_upload(remote))

        thread = threading.Thread(target=upload, name="remote-upload")
        thread.start()
        uploading: list[float] = []
        while thread.is_alive() and len(uploading) < args.steps:
            uploading.append(step_seconds())
        report.add(
            step_s_idle=statistics.median(idle),
            step_s_uploading=statistics.median(uploading),
            steps_while_uploading=len(uploading),
            upload_step_cost=statistics.median(uploading) / statistics.median(idle),
            tokens_per_step=int(ids.numel()),
        )
        thread.join()
        if not seconds_box:
            raise SystemExit(
                "the upload failed" + (f"; moto's log: {args.dir / 'moto.log'}" if args.target == "s3" else "")
            )
        report.add(upload_s=seconds_box[0], upload_GBps=size / 1e9 / seconds_box[0])
        shutil.rmtree(args.dir / "local")  # room on the disk
        start = time.perf_counter()
        got = remote.download_newest(args.dir / "downloaded")
        seconds = time.perf_counter() - start
        assert got is not None, "the upload did not download again"
        report.add(download_s=seconds, download_GBps=size / 1e9 / seconds)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
