"""The actor's generation copy made by resharding the training weights (hybrid engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_worker

WORKER = Path(__file__).with_name("reshard_worker.py")
TOLERANCE = 1e-5
COPY_CASES = ("tp2", "pp2", "tp2_tied", "pp2_tied", "tp1_to_tp2")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_worker(WORKER, 2, tmp_path_factory.mktemp("reshard"), timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("case", COPY_CASES)
def test_generation_copy_matches_training_model(results: dict, case: str) -> None:
    """TP2 / PP2 (untied llama, tied qwen2) -> TP1xDP2, and TP1xDP2 -> TP2: logits and greedy tokens."""
    assert results[f"{case}/logits_max_abs_diff"] < TOLERANCE
    assert results[f"{case}/greedy_mismatches"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("update", ["perturbed", "optimizer_step"])
@pytest.mark.parametrize("case", ["tp2", "pp2"])
def test_refresh_follows_training_updates(results: dict, case: str, update: str) -> None:
    """In place after a perturbation; rebuilt after release() (memory freed) around an optimizer step."""
    key = f"{case}/{update}"
    assert results[f"{key}/stale_logits_max_abs_diff"] > 1e-3  # the update did change the model
    assert results[f"{key}/refreshed_logits_max_abs_diff"] < TOLERANCE
    if update == "perturbed":
        assert results[f"{key}/refresh_moved_tensors"] == 0
    assert results[f"{key}/refresh_same_role_object"] is True


@pytest.mark.distributed
def test_refresh_after_other_pairs_of_the_same_layouts(results: dict) -> None:
    """megatron's plan cache is keyed by layout sizes: switching pairs must not reuse another's plan."""
    assert results["tp2_tied/refreshed_again_logits_max_abs_diff"] < TOLERANCE


@pytest.mark.distributed
def test_zero_copy_returns_the_training_model(results: dict) -> None:
    assert results["zero_copy_tp1/same_object"] is True
    assert results["zero_copy_tp2/same_object"] is True


def test_generation_layout() -> None:
    from megatron_rlhf.hybrid.reshard import generation_layout
    from megatron_rlhf.parallel.layout import Layout

    assert generation_layout(Layout(tp=2, pp=2, dp=2), 1, 8) == Layout(tp=1, pp=1, dp=8)
    assert generation_layout(Layout(tp=1, pp=4, dp=2), 4, 8) == Layout(tp=4, pp=1, dp=2)
    with pytest.raises(ValueError, match=r"generation tp=3 must divide the world size 8"):
        generation_layout(Layout(tp=2, pp=2, dp=2), 3, 8)
    with pytest.raises(ValueError, match=r"generation tp=0 must be >= 1"):
        generation_layout(Layout(tp=2, pp=2, dp=2), 0, 8)
    with pytest.raises(ValueError, match=r"the training layout TP2xPP2xDP1 has 4 ranks, not the world size 8"):
        generation_layout(Layout(tp=2, pp=2, dp=1), 2, 8)


def test_matching_vocab_pad_multiple_keeps_the_padded_vocab() -> None:
    from megatron_rlhf.hybrid.reshard import matching_vocab_pad_multiple
    from megatron_rlhf.models.builder import padded_vocab_size

    for vocab in (97, 128, 32000, 151936):
        for train_tp in (1, 2, 4, 8):
            source = padded_vocab_size(vocab, train_tp)
            for gen_tp in (1, 2, 4, 8):
                multiple = matching_vocab_pad_multiple(vocab, source, gen_tp)
                assert padded_vocab_size(vocab, gen_tp, multiple) == source
    with pytest.raises(ValueError, match=r"tp=3 must divide the source model's padded vocabulary 256"):
        matching_vocab_pad_multiple(97, 256, 3)
    with pytest.raises(ValueError, match=r"padded vocabulary 64 does not hold the vocabulary of 97 tokens"):
        matching_vocab_pad_multiple(97, 64, 1)
