"""Tokenizers: HF tokenizer.json and SentencePiece models trained here vs their own libraries; bytes."""

from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path

import pytest

from megatron_rlhf.data import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld ünïcode 日本語 🙂",
    "  spaces\tand\nnewlines ",
]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|eot|>"]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json trained on a few sentences (ids 0..4 are SPECIALS)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("hf")
    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 5, trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    """A SentencePiece BPE model with byte fallback, trained on generated text."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    corpus = d / "corpus.txt"
    corpus.write_text(
        "\n".join([f"the quick brown fox number {i} jumps" for i in range(100)] + TEXTS * 5), encoding="utf-8"
    )
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(d / "tokenizer"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        hard_vocab_limit=False,
        pad_id=3,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        minloglevel=2,
        num_threads=1,
    )
    corpus.unlink()
    (d / "tokenizer.vocab").unlink()
    return d


def copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --------------------------------------------------------------------------- HF tokenizer.json


def test_hf_round_trip_matches_library(hf_dir):
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=False) == text


def test_hf_special_ids_agree_with_transformers(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    d = copy_dir(hf_dir, tmp_path / "m")
    write_json(
        d / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": {"__type": "AddedToken", "content": "</s>"},
            "pad_token": "<pad>",
        },
    )
    tok = load_tokenizer(d)
    ref = AutoTokenizer.from_pretrained(str(d))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 0)
    assert tok.encode(TEXTS[2]) == ref.encode(TEXTS[2], add_special_tokens=False)  # no BOS added


def test_hf_special_ids_precedence_and_stop_ids(hf_dir, tmp_path):
    d = copy_dir(hf_dir, tmp_path / "m")
    write_json(d / "tokenizer_config.json", {"eos_token": "<|eot|>", "pad_token": None})
    write_json(d / "special_tokens_map.json", {"eos_token": "</s>", "bos_token": "<s>"})
    write_json(d / "generation_config.json", {"eos_token_id": [2, 4], "pad_token_id": 3})
    write_json(d / "config.json", {"eos_token_id": 2, "bos_token_id": 0})
    tok = load_tokenizer(d)
    assert tok.eos_id == 4  # tokenizer_config.json wins
    assert tok.bos_id == 1  # from special_tokens_map.json, ahead of config.json
    assert tok.pad_id == 3  # null in tokenizer_config.json: the next file decides
    assert tok.stop_ids == (4, 2)  # every EOS named, de-duplicated


def test_hf_pad_falls_back_to_eos_then_zero(hf_dir, tmp_path):
    d = copy_dir(hf_dir, tmp_path / "m")
    tok = load_tokenizer(d)
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.stop_ids) == (None, None, 0, ())
    write_json(d / "config.json", {"eos_token_id": 2})
    tok = load_tokenizer(d)
    assert (tok.eos_id, tok.pad_id) == (2, 2)


def test_hf_special_token_errors_name_file_and_field(hf_dir, tmp_path):
    d = copy_dir(hf_dir, tmp_path / "m")
    write_json(d / "tokenizer_config.json", {"eos_token": "<|nope|>"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token='<\|nope\|>' is not in the"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").unlink()
    write_json(d / "generation_config.json", {"eos_token_id": 100000})
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id=100000 .*vocab_size=320"):
        load_tokenizer(d)


def test_hf_corrupt_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot load tokenizer"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_preferred_over_sentencepiece(hf_dir, sp_dir, tmp_path):
    d = copy_dir(hf_dir, tmp_path / "m")
    (d / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    assert isinstance(load_tokenizer(d), HFTokenizer)


# --------------------------------------------------------------------------- SentencePiece


def test_sentencepiece_round_trip_matches_library(sp_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_dir)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (sp.get_piece_size(), 1, 2, 3)
    assert tok.stop_ids == (2,)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == sp.encode(text, out_type=int)
        assert tok.decode(ids) == sp.decode(ids)
    assert tok.decode(tok.encode("héllo 日本語 fox")) == "héllo 日本語 fox"  # byte fallback


def test_sentencepiece_config_overrides_model_ids(sp_dir, tmp_path):
    d = copy_dir(sp_dir, tmp_path / "m")
    write_json(d / "tokenizer_config.json", {"eos_token": "<unk>"})
    assert load_tokenizer(d).eos_id == 0
    write_json(d / "tokenizer_config.json", {"eos_token": "<|not a piece|>"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token='<\|not a piece\|>'"):
        load_tokenizer(d)


# --------------------------------------------------------------------------- missing / bytes


def test_no_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    expected = f"no tokenizer in '{tmp_path}': looked for tokenizer.json, tokenizer.model"
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(512)
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size, tok.stop_ids) == (0, 1, 2, 512, (2,))
    assert tok.encode("Ab") == [ord("A") + 3, ord("b") + 3]
    for text in TEXTS + ["", "\x00\xff"]:
        ids = tok.encode(text)
        assert ids == [b + 3 for b in text.encode("utf-8")]
        assert all(3 <= i < 259 for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode([1] + tok.encode("日本") + [2, 0, 0]) == "日本"  # specials carry no text
    assert tok.decode([300, ord("x") + 3]) == "\ufffdx"  # ids past the bytes stay visible


def _mixed_texts() -> list[str]:
    """ASCII, Latin, combining marks, CJK, emoji, control characters and whitespace, mixed."""
    rng = random.Random(0)
    ranges = [(0x20, 0x7E), (0x00, 0x2FF), (0x3000, 0x9FFF), (0x1F300, 0x1FAFF), (0x0A, 0x0A), (0x0300, 0x036F)]
    mixed = ["".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    return TEXTS + ["", "\x00\x7f\x80\xff", "e\u0301 \r\n\t  Ġ Ċ"] + mixed


def test_built_in_models_ship_the_byte_tokenizer_as_tokenizer_json():
    """The built-in models' tokenizer.json gives ByteTokenizer's ids, here and in transformers'
    AutoTokenizer; both decode any ids as ByteTokenizer does (specials no text, ids past the bytes
    U+FFFD, invalid UTF-8 U+FFFD)."""
    from transformers import AutoTokenizer

    from megatron_rlhf.models.builtin import builtin_checkpoint

    model_dir = builtin_checkpoint("builtin:tiny-llama")
    reference, ours, theirs = ByteTokenizer(512), load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(ours, HFTokenizer)
    assert (ours.pad_id, ours.bos_id, ours.eos_id, ours.vocab_size, ours.stop_ids) == (0, 1, 2, 512, (2,))
    assert (theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (0, 1, 2, 512)
    for text in _mixed_texts():
        ids = reference.encode(text)
        assert ours.encode(text) == ids and theirs.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids) == text
    rng = random.Random(1)
    for _ in range(2000):
        ids = [
            rng.choice([rng.randrange(512), rng.randrange(3), rng.randrange(0x83, 259)])
            for _ in range(rng.randrange(30))
        ]
        assert ours.decode(ids) == theirs.decode(ids) == reference.decode(ids), ids


def test_byte_tokenizer_errors():
    assert ByteTokenizer(259).vocab_size == 259
    with pytest.raises(ValueError, match=r"vocab_size >= 259.*got 258"):
        ByteTokenizer(258)
    with pytest.raises(ValueError, match="token id 512 out of range"):
        ByteTokenizer(512).decode([512])


def test_decode_batch_is_decode_of_each_row(hf_dir, sp_dir):
    rows = [[], [3, 7, 2, 1], *(list(range(5 + k, 40 + 3 * k)) for k in range(6))]  # specials, empty, long
    for tok in (load_tokenizer(hf_dir), load_tokenizer(sp_dir), ByteTokenizer(300)):
        encoded = [tok.encode(t) for t in TEXTS]
        for batch in (rows, encoded, [encoded[0]] * 3):
            assert tok.decode_batch(batch) == [tok.decode(ids) for ids in batch], tok


def test_tokenizers_pickle_for_worker_processes(hf_dir, sp_dir):
    """data.num_workers sends the tokenizer to each worker process: every backend pickles whole."""
    for tok in (load_tokenizer(hf_dir), load_tokenizer(sp_dir), ByteTokenizer(300)):
        copy = pickle.loads(pickle.dumps(tok))
        assert type(copy) is type(tok) and repr(copy) == repr(tok)
        specials = ("bos_id", "eos_id", "pad_id", "stop_ids")
        assert [getattr(copy, name) for name in specials] == [getattr(tok, name) for name in specials]
        assert [copy.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]


# --------------------------------------------------------------------------- special tokens in a response

# Responses as a policy samples them: special tokens in the middle of the text, next to ordinary ones.
CHAT_RESPONSES = [
    "ang 3 ####<|im_start|> 3",
    "<|im_start|>assistant\nIt is five.<|im_end|>",
    "two<|endoftext|>three",
    "Bonjour<|im_end|><|im_end|>très bien",
    "plain text, no specials",
]


def test_hf_decode_skips_special_tokens_as_transformers_does(tmp_path):
    """verl scores ``tokenizer.decode(ids, skip_special_tokens=True)``: ours gives that text for
    responses with special tokens mid-text (e.g. '... ####<|im_start|> 3' reads '... #### 3', which
    verl's gsm8k scores 1.0); by default, as transformers' default decode, it keeps them."""
    from transformers import AutoTokenizer

    from tests.helpers import make_chat_tokenizer

    model_dir = make_chat_tokenizer("qwen2", tmp_path / "qwen2")
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rows = [theirs.encode(text, add_special_tokens=False) for text in CHAT_RESPONSES]
    special = {i for i, token in theirs.added_tokens_decoder.items() if token.special}
    assert sum(i in special for ids in rows for i in ids) == 6  # each special is one token
    skipped = [theirs.decode(ids, skip_special_tokens=True) for ids in rows]
    assert skipped[0] == "ang 3 #### 3" and skipped[3] == "Bonjourtrès bien"
    assert [ours.decode(ids, skip_special_tokens=True) for ids in rows] == skipped
    assert ours.decode_batch(rows, skip_special_tokens=True) == skipped
    kept = [theirs.decode(ids) for ids in rows]
    assert kept == CHAT_RESPONSES
    assert [ours.decode(ids) for ids in rows] == ours.decode_batch(rows) == kept


def test_built_in_tokenizer_skips_nothing_that_is_text():
    """The byte tokenizer's specials (pad, bos, eos) carry no text whether skipped or not, in
    ByteTokenizer and in the built-in models' tokenizer.json, here and in transformers; ids past the
    bytes are no specials (U+FFFD either way)."""
    from transformers import AutoTokenizer

    from megatron_rlhf.models.builtin import builtin_checkpoint

    model_dir = builtin_checkpoint("builtin:tiny-llama")
    reference, ours, theirs = ByteTokenizer(512), load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(2)
    rows = [[rng.choice([rng.randrange(512), rng.randrange(3)]) for _ in range(rng.randrange(30))] for _ in range(300)]
    rows.append([ord("a") + 3, 2, 1, 0, ord("b") + 3, 300])
    for ids in rows:
        expected = theirs.decode(ids, skip_special_tokens=True)
        assert expected == theirs.decode(ids), ids
        for skip in (True, False):
            assert (
                ours.decode(ids, skip_special_tokens=skip)
                == reference.decode(ids, skip_special_tokens=skip)
                == expected
            )
    assert reference.decode(rows[-1]) == "ab\ufffd"
    expected = [theirs.decode(ids, skip_special_tokens=True) for ids in rows]
    assert (
        ours.decode_batch(rows, skip_special_tokens=True)
        == reference.decode_batch(rows, skip_special_tokens=True)
        == expected
    )


def test_sentencepiece_skips_control_unknown_and_named_pieces(tmp_path):
    """SentencePiece: control pieces, the unknown piece and the ids named bos/eos/pad are special and
    skipped (transformers' all_special_ids for such a model); a user-defined piece is text.
    Without ``skip_special_tokens`` it is SentencePiece's own decode. Expected texts written by hand."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([f"hello world number {i} <user> again" for i in range(60)]), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=80,
        model_type="bpe",
        pad_id=3,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        minloglevel=2,
        control_symbols=["<ctrl>"],
        user_defined_symbols=["<user>"],
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tok = load_tokenizer(tmp_path)
    ctrl, user = sp.piece_to_id("<ctrl>"), sp.piece_to_id("<user>")
    assert sp.is_control(ctrl) and not sp.is_control(user)
    hello, world = tok.encode("hello"), tok.encode(" world")
    ids = [1, *hello, ctrl, 0, 3, user, 2, *world, 2]
    assert tok.decode(ids, skip_special_tokens=True) == "hello<user> world"
    assert tok.decode_batch([ids, hello], skip_special_tokens=True) == ["hello<user> world", "hello"]
    assert tok.decode(ids) == sp.decode(ids) == "hello ⁇ <user> world"
    assert tok.decode_batch([ids, hello]) == [sp.decode(ids), "hello"]


@pytest.mark.parametrize(
    ("post_processor", "add_bos_token"),
    [(False, None), (True, None), (False, True), (True, False)],
    ids=["plain", "post-processor", "config-true-without-post-processor", "config-false-with-post-processor"],
)
def test_adds_bos_and_text_prompts_agree_with_transformers(hf_dir, tmp_path, post_processor, add_bos_token) -> None:
    """data.add_bos=null gives a text prompt the ids transformers' tokenizer(text) gives (Llama's
    tokenizer.json adds the BOS by its post-processor, which transformers follows over
    tokenizer_config.json's add_bos_token), and a conversation what apply_chat_template gives.
    Before, text never got it."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    from megatron_rlhf.data import load_prompt_dataset

    d = copy_dir(hf_dir, tmp_path / "m")
    raw = RawTokenizer.from_file(str(d / "tokenizer.json"))
    if post_processor:
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    config |= {"chat_template": "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"}
    write_json(
        d / "tokenizer_config.json", config if add_bos_token is None else config | {"add_bos_token": add_bos_token}
    )
    theirs, ours = AutoTokenizer.from_pretrained(str(d)), load_tokenizer(d)
    expected = post_processor
    assert ours.adds_bos is expected
    assert (theirs("hello world")["input_ids"][0] == 1) is expected
    rows = [{"prompt": t} for t in TEXTS] + [{"prompt": [{"role": "user", "content": "hello world"}]}]
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset, _ = load_prompt_dataset(d / "p.jsonl", ours, max_length=256)
    assert [ex.prompt_ids.tolist() for ex in dataset] == [theirs(t)["input_ids"] for t in TEXTS] + [
        theirs.apply_chat_template(rows[-1]["prompt"], tokenize=True)["input_ids"]
    ]
    forced, _ = load_prompt_dataset(d / "p.jsonl", ours, max_length=256, add_bos=True)
    assert all(ex.prompt_ids[0] == 1 and ex.prompt_ids[1] != 1 for ex in forced)  # every prompt, never doubled


def test_sentencepiece_adds_bos_unless_its_config_says_otherwise(sp_dir, tmp_path) -> None:
    """As transformers' Llama tokenizer: add_bos_token defaults to true."""
    assert load_tokenizer(sp_dir).adds_bos is True
    d = copy_dir(sp_dir, tmp_path / "m")
    write_json(d / "tokenizer_config.json", {"add_bos_token": False})
    assert load_tokenizer(d).adds_bos is False
    assert ByteTokenizer(512).adds_bos is False
