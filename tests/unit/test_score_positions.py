"""Where a reward model's score is read: as transformers' *ForSequenceClassification pools it, so a
reward model trained here scores in transformers as it did in training, and one trained elsewhere
scores here as it does there (``training.objectives.score_positions``)."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.training.objectives import score_positions

EOS = 2


@pytest.mark.parametrize("pad_id", [None, 0, EOS], ids=["no-pad", "own-pad", "pad-is-eos"])
def test_positions_equal_transformers_pooling(pad_id: int | None) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=pad_id, eos_token_id=EOS,
    )  # fmt: skip
    model = LlamaForSequenceClassification(config).eval()
    # Rows ending in EOS, with EOS inside one, one without EOS; right-padded with the pad id (or EOS).
    rows = [[5, 6, 7, EOS], [5, EOS, 9, 10, 11, EOS, EOS], [8, 9]]
    width, filler = max(map(len, rows)), EOS if pad_id is None else pad_id
    input_ids = torch.tensor([row + [filler] * (width - len(row)) for row in rows])
    lengths = torch.tensor([len(row) for row in rows])
    with torch.no_grad():
        if pad_id is None:  # transformers scores one row at a time then (no pad: no batch)
            pooled = torch.cat([model(torch.tensor([row])).logits[:, 0] for row in rows])
        else:
            pooled = model(input_ids).logits[:, 0]
        per_token = model.score(model.model(input_ids).last_hidden_state)[..., 0]
    at = score_positions(input_ids, lengths, pad_id)
    torch.testing.assert_close(per_token[torch.arange(len(rows)), at], pooled, rtol=0, atol=1e-6)
    expected = {None: [3, 6, 1], 0: [3, 6, 1], EOS: [2, 4, 1]}[pad_id]
    assert at.tolist() == expected
