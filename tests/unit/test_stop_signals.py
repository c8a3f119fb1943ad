"""A stop signal's handling (``trainer/stop.py``), in this process with its clock stepped by hand: the
first records the stop, the same request delivered again at once is merged with it, and a second one
later ends the process at once."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_rlhf.trainer import stop


class _Exited(Exception):
    pass


def test_a_repeat_at_once_is_the_same_request_and_a_later_one_exits_now(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(stop.time, "monotonic", lambda: now[0])

    def exited(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(stop.os, "_exit", exited)
    with stop.StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.code == 0 and stop.stop_requested()
        now[0] += stop.SAME_REQUEST_S / 2
        os.kill(os.getpid(), signal.SIGTERM)  # Slurm's and torchrun's copies of one request
        assert signals.code == 0
        now[0] += stop.SAME_REQUEST_S
        with pytest.raises(_Exited) as exit_code:
            os.kill(os.getpid(), signal.SIGINT)
    assert exit_code.value.args == (128 + signal.SIGINT,)
    assert not stop.stop_requested()
