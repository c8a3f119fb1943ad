"""HF parity at TP1, TP2, PP2 and TP2xPP2 for every family, on 4 gloo ranks (torchrun, one launch for
all families: each launch costs its ranks' imports)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import FAMILIES
from tests.launch import run_worker

WORKER = Path(__file__).with_name("hf_parity_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_worker(WORKER, 4, tmp_path_factory.mktemp("hf_parity"), ",".join(FAMILIES))


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_parity_and_round_trip_all_layouts(results: dict, family: str) -> None:
    for head in ("lm", "cls"):
        for layout in ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"):
            assert results[f"{family}-{head}/{layout}/max_abs_diff"] < 1e-4
            assert results[f"{family}-{head}/{layout}/round_trip_bit_identical"] == 1.0
