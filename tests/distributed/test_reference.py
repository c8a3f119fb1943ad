"""The reference following the actor during PPO (``reference.update``), checked from the full
weights the worker saved after each RL step (``reference_worker.py``):

* ema: the reference equals ``decay * ref + (1 - decay) * actor`` computed here in float32 from
  the saved actors, step by step, with the two models in the same and in different layouts;
* periodic: the reference equals the actor exactly after a refresh step and is unchanged between;
* none: the reference keeps its loaded weights bit for bit, and the step reports no refresh.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import load_all_tensors
from tests.launch import run_worker, worker_results

WORKER = Path(__file__).with_name("reference_worker.py")
DECAY = 0.6  # the worker's reference.ema_decay
EMA_CASES = ("ema_tp2_to_tp1", "ema_tied_tp1_to_tp2", "ema_same_tp2")


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    run_worker(WORKER, 2, out, timeout=600)
    return out


def _weights(out: Path, case: str, name: str) -> dict[str, torch.Tensor]:
    return load_all_tensors(out / case / name)


def _steps(out: Path, case: str) -> list[dict]:
    return worker_results(out)[case]["steps"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("case", EMA_CASES)
def test_ema_reference_follows_the_recurrence(out: Path, case: str) -> None:
    expected = _weights(out, case, "reference-0")
    for step, record in enumerate(_steps(out, case), start=1):
        actor = _weights(out, case, f"actor-{step}")
        expected = {k: DECAY * expected[k] + (1 - DECAY) * actor[k] for k in expected}
        reference = _weights(out, case, f"reference-{step}")
        assert _max_diff(reference, expected) <= 1e-6, (case, step)
        assert _max_diff(reference, actor) > 1e-4, (case, step)  # a mix, not a copy of the actor
        assert record["refreshed"] == 1.0 and "timing_s/update_ref" in record["time_keys"]
        assert record["replicas_equal"]


@pytest.mark.distributed
def test_the_resharded_reference_takes_the_actors_padded_vocabulary(out: Path) -> None:
    """Vocab 600 pads to 640 at TP1 and to 768 at TP2: the TP2 reference of a TP1 actor holds 640."""
    from megatron_rlhf.models.builder import padded_vocab_size

    padded = worker_results(out)["ema_tied_tp1_to_tp2"]["padded_vocab"]
    assert padded == {"actor": 640, "reference": 640} and padded_vocab_size(600, 2) == 768


@pytest.mark.distributed
def test_periodic_reference_is_the_actor_after_each_refresh(out: Path) -> None:
    case = "periodic_pp2_to_tp2"  # update_every=2
    steps = _steps(out, case)
    assert [r["refreshed"] for r in steps] == [0.0, 1.0, 0.0, 1.0]
    previous = _weights(out, case, "reference-0")
    for step, record in enumerate(steps, start=1):
        actor, reference = _weights(out, case, f"actor-{step}"), _weights(out, case, f"reference-{step}")
        assert _max_diff(actor, previous) > 1e-4, step  # the actor moved away from the reference
        assert _equal(reference, actor if step % 2 == 0 else previous), step
        assert record["replicas_equal"]
        previous = reference


@pytest.mark.distributed
def test_fixed_reference_never_changes(out: Path) -> None:
    case = "none_tp2_to_tp1"
    from tests.distributed.test_ppo import _builtin_dir

    initial = load_all_tensors(_builtin_dir())
    steps = _steps(out, case)
    for step, record in enumerate(steps, start=1):
        assert _equal(_weights(out, case, f"reference-{step}"), initial), step
        assert _max_diff(_weights(out, case, f"actor-{step}"), initial) > 1e-4, step
        assert record["refreshed"] is None and "timing_s/update_ref" not in record["time_keys"]
