"""The step's phase timer (``metrics/phases.py``): phases in the order they ran, parts filed under
the phase open at the time, and each phase's std over a window of recent steps."""

from __future__ import annotations

import statistics

import pytest
import torch

from megatron_rlhf.metrics.phases import PhaseTimer


def test_phases_parts_and_the_std_over_the_window() -> None:
    timer = PhaseTimer(torch.device("cpu"), window=2)
    gen_seconds = []
    for step in range(3):
        with timer.phase("gen"):
            with timer.part("generation weights (zero copy)"):
                pass
            timer.add("cuda graph capture", 0.5)
        with timer.phase("reward"):
            pass
        with timer.phase("reward"):  # a phase run twice in a step adds up
            pass
        metrics = timer.step_metrics()
        gen_seconds.append(metrics["timing_s/gen"])
        assert list(metrics) == [
            "timing_s/gen",
            "timing_s/reward",
            "timing_s/gen/generation_weights_zero_copy",
            "timing_s/gen/cuda_graph_capture",
            "timing_s/gen/std",
            "timing_s/reward/std",
        ], step
        assert metrics["timing_s/gen/cuda_graph_capture"] == 0.5
        assert metrics["timing_s/gen/std"] == pytest.approx(statistics.pstdev(gen_seconds[-2:]))
    assert gen_seconds[0] != gen_seconds[1]  # each step starts from zero


def test_a_part_outside_any_phase_is_filed_by_its_own_name() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    timer.add("generate", 1.0)
    assert timer.step_metrics() == {"timing_s/generate": 1.0}
