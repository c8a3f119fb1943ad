"""The progress line of long work: throttled, always printed at the end, with rate and ETA."""

from __future__ import annotations

import pytest

from megatron_rlhf.metrics.log import Progress


def test_progress_is_throttled_and_prints_the_end(capsys: pytest.CaptureFixture) -> None:
    readings = iter([100.0, 101.0, 105.0, 112.0, 113.0])  # start, then one reading per call
    progress = Progress("generate", 40, "completions", every_s=10.0, clock=lambda: next(readings))
    progress(5)  # t=101: 1 s since start -> quiet
    progress(10)  # t=105 -> quiet
    progress(30)  # t=112: 12 s -> printed, 30 done in 12 s = 2.5/s, 10 left -> eta 4 s (0:00:04)
    progress(40)  # t=113: the end -> printed although only 1 s passed
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["generate: 30/40 completions (2.5/s, eta 0:00:04)", "generate: 40/40 completions (3.1/s)"]


def test_eta_format_is_hours_minutes_seconds() -> None:
    from megatron_rlhf.metrics.log import format_eta

    assert format_eta(3725.9) == "1:02:05" and format_eta(4.0) == "0:00:04"
