"""An S3-compatible server on localhost for the remote-checkpoint tests: moto's server mode
(``python -m moto.server``, from the package index: the ``test`` extra), one process per test
module, with authentication enforced so that a test can tell credentials read from the
environment from none.

moto lets the first ``INITIAL_NO_AUTH_ACTION_COUNT`` requests through unsigned; ``start`` spends
them on a bucket, an IAM user with full S3 access and its access key, and one read-only user, and
from then on every request must be signed with one of those keys (an unknown key: InvalidAccessKeyId).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BUCKET = "ckpts"
READ_ONLY_POLICY = (
    '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], '
    '"Resource": "*"}]}'
)
FULL_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'


@dataclasses.dataclass(frozen=True)
class S3Server:
    endpoint: str
    key: tuple[str, str]
    """(access key id, secret) of a user allowed everything in S3."""
    read_only_key: tuple[str, str]
    """(access key id, secret) of a user who may only read."""

    def env(self, key: tuple[str, str] | None = None) -> dict[str, str]:
        """The environment variables a run reads its endpoint and credentials from (``key``, or the full one)."""
        key_id, secret = key or self.key
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def filesystem(self):  # s3fs is imported lazily
        import s3fs

        return s3fs.S3FileSystem(
            key=self.key[0], secret=self.key[1], endpoint_url=self.endpoint, skip_instance_cache=True
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def start(log: Path) -> Iterator[S3Server]:
    """moto's server on a free port of 127.0.0.1 until the block ends; the bucket ``BUCKET`` and two users made."""
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    boto3 = pytest.importorskip("boto3")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "9", "MOTO_PORT": str(port)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        anonymous = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "x"}
        s3 = boto3.client("s3", aws_secret_access_key="x", **anonymous)
        iam = boto3.client("iam", aws_secret_access_key="x", **anonymous)
        s3.create_bucket(Bucket=BUCKET)
        keys = []
        for user, policy in (("writer", FULL_POLICY), ("reader", READ_ONLY_POLICY)):
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=policy)
            made = iam.create_access_key(UserName=user)["AccessKey"]
            keys.append((made["AccessKeyId"], made["SecretAccessKey"]))
        yield S3Server(endpoint=endpoint, key=keys[0], read_only_key=keys[1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
