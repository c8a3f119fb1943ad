"""``megatron-rlhf sft`` and ``megatron-rlhf rm`` as a user runs them: CPU mode, subprocesses,
files on disk, and the exported models checked independently with transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.launch import REPO, run_cli

MAIN = REPO / "megatron_rlhf" / "__main__.py"
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]
MARKER = "#"  # the tiny built-in reward model starts out preferring rows *without* it (see test)
PAD, BOS, EOS, OFFSET = 0, 1, 2, 3  # ByteTokenizer ids


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sft_rows(n: int, seed: int) -> list[dict]:
    """'g a e =' -> ' e a g': the response is the prompt's words reversed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
        rows.append({"prompt": " ".join(words) + " =", "response": " " + " ".join(reversed(words))})
    return rows


def _preference_rows(n: int, seed: int) -> list[dict]:
    """Chosen and rejected are the same words, except that one word of the chosen is the marker:
    same length, one token apart, so only the marker separates them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4))) + " ?"
        body = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
        chosen = list(body)
        chosen[rng.randrange(len(body))] = MARKER
        rows.append({"prompt": prompt, "chosen": " " + " ".join(chosen), "rejected": " " + " ".join(body)})
    return rows


def _byte_ids(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode("utf-8")]


def _records(out_dir: Path, split: str) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


@pytest.fixture(scope="module")
def rm_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rm-data")
    train = _write_jsonl(root / "train.jsonl", _preference_rows(256, 2))
    return train, _write_jsonl(root / "val.jsonl", _preference_rows(64, 3))


RM_ARGS = ("--config", "rm-tiny", "global_batch_size=16", "log_every=4", "optim.lr=1e-3", "optim.warmup_steps=2")


@pytest.fixture(scope="module")
def rm_single(rm_data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """The reward model trained at TP1 in one process: 16 steps, evaluated every 8."""
    out = tmp_path_factory.mktemp("rm-single")
    train, val = rm_data
    proc = run_cli(
        "rm",
        "--config",
        "rm-tiny",
        *RM_ARGS,
        f"data.train=[{train}]",
        f"data.validation=[{val}]",
        f"output_dir={out}",
        "max_steps=16",
        "eval_every=8",
    )
    return out, proc


def test_adjacent_pairs_reorders_pack_batch_layout() -> None:
    from megatron_rlhf.data import PreferenceExample, SFTExample, pack_batch
    from megatron_rlhf.trainer.rm import adjacent_pairs

    def side(first: int, length: int) -> SFTExample:
        return SFTExample(torch.arange(first, first + length), torch.ones(length, dtype=torch.bool))

    examples = [PreferenceExample(chosen=side(10 * i, 3 + i), rejected=side(10 * i + 5, 2)) for i in range(3)]
    batch = adjacent_pairs(pack_batch(examples, pad_id=0))
    assert batch["is_chosen"].tolist() == [True, False] * 3
    assert batch["pair_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["input_ids"][:, 0].tolist() == [0, 5, 10, 15, 20, 25]
    assert batch["lengths"].tolist() == [3, 2, 4, 2, 5, 2]


@pytest.fixture(scope="module")
def sft_single(tmp_path_factory: pytest.TempPathFactory):
    """The built-in tiny Llama fine-tuned at TP1 in one process: 40 steps, validated at the end."""
    root = tmp_path_factory.mktemp("sft-single")
    train = _write_jsonl(root / "train.jsonl", _sft_rows(256, 0))
    val = _write_jsonl(root / "val.jsonl", _sft_rows(32, 1))
    out = root / "run"
    proc = run_cli(
        "sft",
        "--config",
        "sft-tiny",
        f"data.train=[{train}]",
        f"data.validation=[{val}]",
        f"output_dir={out}",
        "max_steps=40",
        "log_every=10",
    )
    return out, train, proc


@pytest.mark.distributed
def test_sft_loss_drops_and_export_loads_in_transformers(sft_single) -> None:
    from transformers import LlamaForCausalLM

    out, _, proc = sft_single
    val_rows = _sft_rows(32, 1)
    assert "tokenizer: HFTokenizer(" in proc.stdout and "copied tokenizer.json, tokenizer_config.json" in proc.stdout
    assert "train data: read 256 rows from 1 file(s): kept 256" in proc.stdout
    assert "step 40/40" in proc.stdout and "tokens/s" in proc.stdout

    steps = _records(out, "train")
    assert [r["step"] for r in steps] == list(range(1, 41))
    first, last = steps[0]["loss"], sum(r["loss"] for r in steps[-3:]) / 3
    assert first > 5.5 and last < 0.4 * first, (first, last)  # random init: ~ln(512) = 6.2
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    (validation,) = _records(out, "validation")
    assert validation["step"] == 40 and validation["examples"] == 32
    assert list((out / "tb").glob("events.out.tfevents.*"))

    # The export loads with transformers and scores the validation set as the trainer did.
    model = LlamaForCausalLM.from_pretrained(out / "hf", attn_implementation="eager").eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for row in val_rows:
            prompt, response = _byte_ids(row["prompt"]), _byte_ids(row["response"]) + [EOS]
            ids = torch.tensor([prompt + response])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            targets = ids[0, 1:]
            picked = logprobs[torch.arange(len(targets)), targets][len(prompt) - 1 :]
            nll -= picked.sum().item()
            tokens += len(response)
    assert tokens == validation["tokens"]
    assert abs(nll / tokens - validation["nll"]) < 1e-4 * validation["nll"], (nll / tokens, validation)
    assert nll / tokens < 0.5 * first


@pytest.mark.distributed
def test_sft_export_is_a_model_path_that_tokenizes_identically(sft_single) -> None:
    """The exported hf/ dir of a built-in model carries its byte tokenizer: a second run from it
    reads the same token ids (same batches, same token counts), and transformers reads them too."""
    from transformers import AutoTokenizer

    from megatron_rlhf.data import ByteTokenizer, load_tokenizer

    first_out, train, _ = sft_single
    hf_dir = first_out / "hf"
    second_out = first_out.parent / "from-export"
    proc = run_cli(
        "sft",
        "--config",
        "sft-tiny",
        f"model.path={hf_dir}",
        f"data.train=[{train}]",
        f"output_dir={second_out}",
        "max_steps=3",
        "log_every=1",
    )
    assert f"tokenizer: HFTokenizer('{hf_dir / 'tokenizer.json'}'" in proc.stdout
    assert [r["tokens"] for r in _records(second_out, "train")] == [
        r["tokens"] for r in _records(first_out, "train")[:3]
    ]
    reference, ours, theirs = ByteTokenizer(512), load_tokenizer(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    for row in _sft_rows(32, 0) + [{"prompt": "héllo wörld — 日本語", "response": " 🙂 e\u0301\n"}]:
        for text in row.values():
            ids = reference.encode(text)
            assert ours.encode(text) == theirs.encode(text) == ids == _byte_ids(text)
            assert ours.decode(ids + [EOS]) == theirs.decode(ids + [EOS]) == text
    assert (
        (ours.pad_id, ours.bos_id, ours.eos_id)
        == (theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id)
        == (PAD, BOS, EOS)
    )


@pytest.mark.distributed
def test_rm_learns_the_marker_to_high_validation_accuracy(rm_single, rm_data) -> None:
    from transformers import LlamaForSequenceClassification

    out, proc = rm_single
    steps = _records(out, "train")
    validations = _records(out, "validation")
    assert [v["step"] for v in validations] == [8, 16]
    # The untrained model prefers the rows without the marker: accuracy is learned, not inherited.
    assert steps[0]["accuracy"] < 0.5, steps[0]
    assert validations[-1]["accuracy"] > 0.9, validations
    assert validations[-1]["pairs"] == 64
    assert steps[-1]["loss"] < 0.25 * steps[0]["loss"]
    result = json.loads((out / "result.json").read_text())
    assert result["validation"]["accuracy"] == validations[-1]["accuracy"]
    assert f"validation accuracy {validations[-1]['accuracy']:.4f}" in proc.stdout

    # Independent check: transformers scores the exported model (reward at the last real token,
    # found through the exported pad_token_id) and agrees on every pair.
    model = LlamaForSequenceClassification.from_pretrained(out / "hf", attn_implementation="eager").eval()
    assert model.config.pad_token_id == PAD
    rows = [json.loads(line) for line in rm_data[1].read_text().splitlines()]
    correct, margin = 0, 0.0
    with torch.no_grad():
        for row in rows:
            sides = [_byte_ids(row["prompt"] + row[key]) + [EOS] for key in ("chosen", "rejected")]
            width = max(map(len, sides))
            ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sides])
            chosen, rejected = model(ids).logits[:, 0].tolist()
            correct += chosen > rejected
            margin += chosen - rejected
    assert correct / len(rows) == validations[-1]["accuracy"]
    assert abs(margin / len(rows) - validations[-1]["margin"]) < 1e-4 * max(1.0, abs(validations[-1]["margin"]))


@pytest.mark.distributed
def test_rm_under_torchrun_dp2_matches_single_process(rm_single, rm_data, tmp_path: Path) -> None:
    single_out, _ = rm_single
    train, val = rm_data
    out = tmp_path / "dp2"
    proc = run_cli(
        "rm",
        "--config",
        "rm-tiny",
        *RM_ARGS,
        f"data.train=[{train}]",
        f"data.validation=[{val}]",
        f"output_dir={out}",
        "max_steps=8",
        nproc=2,
        timeout=300,
    )
    assert "TP1xPP1xDP2" in proc.stdout and "(8 per DP rank x 2)" in proc.stdout
    assert "validation at step 8: accuracy" in proc.stdout
    # Same global batches, loss normalised over the global batch: the layout does not change the run.
    mine = _records(out, "train")
    reference = _records(single_out, "train")[:8]
    assert len(mine) == 8
    for a, b in zip(mine, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, b["loss"]), (a, b)
    (validation,) = _records(out, "validation")
    (reference_validation,) = [v for v in _records(single_out, "validation") if v["step"] == 8]
    assert validation["pairs"] == 64  # each DP rank scored its half; counts summed over DP
    assert abs(validation["accuracy"] - reference_validation["accuracy"]) <= 1 / 64
    assert abs(validation["loss"] - reference_validation["loss"]) < 1e-3


def _write_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json (the words, '=', '?', '#', <eos>; filler up to vocab_size)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    words = ["<unk>", "<eos>", *WORDS, "=", "?", MARKER]
    vocab = {w: i for i, w in enumerate(words + [f"<unused{i}>" for i in range(vocab_size - len(words))])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


@pytest.mark.distributed
def test_sft_of_an_hf_model_uses_and_exports_its_tokenizer(tmp_path: Path) -> None:
    from tests.helpers import VOCAB, make_tiny_hf_model

    make_tiny_hf_model("qwen2", False, tmp_path / "model")
    _write_word_tokenizer(tmp_path / "model", VOCAB)
    train = _write_jsonl(tmp_path / "train.jsonl", _sft_rows(32, 0))
    out = tmp_path / "run"
    proc = run_cli(
        "sft",
        "--config",
        "sft-tiny",
        f"model.path={tmp_path / 'model'}",
        f"data.train=[{train}]",
        f"output_dir={out}",
        "global_batch_size=8",
        "max_steps=3",
        "optim.lr=1e-4",
        "log_every=1",
    )
    assert "tokenizer: HFTokenizer(" in proc.stdout
    assert "copied tokenizer.json, tokenizer_config.json" in proc.stdout
    assert (out / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "model" / "tokenizer.json").read_bytes()
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["pad_token_id"] == VOCAB - 1
    # Tokenized by the model's tokenizer: "a b c =" + " c b a" + <eos> is 8 word-level tokens.
    from megatron_rlhf.data import epoch_batches

    rows = _sft_rows(32, 0)
    batches = epoch_batches(32, 8, 0, 1, seed=1234, epoch=0, drop_last=True)
    expected = [sum(2 * (len(rows[i]["prompt"].split()) - 1) + 2 for i in batch) for batch in batches[:3]]
    assert [r["tokens"] for r in _records(out, "train")] == expected


def test_rm_training_accuracy_and_margin_are_over_the_steps_pairs(tmp_path: Path) -> None:
    """A step cut into micro-batches of unequal pair counts reported the mean of their accuracies
    and margins (e.g. 1/2, 0/1, 2/3 -> 0.389 for 3 of 6 pairs). Now the share and the mean over the
    step's pairs: the same figures as the evaluation of the same pairs with the same weights, before
    the step's update, which scores them another way (``validate``)."""
    rows = _preference_rows(6, 5)
    for row in rows[::3]:  # the untrained model prefers rows without the marker: it gets these two right
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
    pairs = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "rm"
    run_cli(
        "rm", "--config", "rm-tiny", f"data.train=[{pairs}]", f"data.validation=[{pairs}]", f"output_dir={out}",
        "global_batch_size=6", "max_steps=1", "eval_before_train=true", "data.max_length=40",
        "max_tokens_per_micro_batch=60", "save_final=false", "save_hf=false",
    )  # fmt: skip
    (step,) = _records(out, "train")
    before = next(v for v in _records(out, "validation") if v["step"] == 0)
    assert before["pairs"] == 6
    assert before["accuracy"] == pytest.approx(2 / 6) and step["accuracy"] == before["accuracy"]
    assert abs(step["margin"] - before["margin"]) < 1e-5 * max(1.0, abs(before["margin"]))
    assert abs(step["loss"] - before["loss"]) < 1e-5 * max(1.0, before["loss"])
