"""Text <-> token ids for the trainers: an HF ``tokenizer.json``, a SentencePiece model, or bytes.

``encode`` returns plain token ids and never adds BOS/EOS itself: the datasets decide what to
append, so the same ids come out whichever backend is used. ``bos_id``/``eos_id`` are given for
callers that want them, and ``adds_bos`` says whether transformers' ``tokenizer(text)`` starts with
the BOS (what ``data.add_bos`` follows by default): a ``tokenizer.json``'s where its post-processor
adds it (Llama's do, Qwen's have no BOS; transformers 5 goes by the post-processor alone here, not
``add_bos_token``); a SentencePiece model's unless ``tokenizer_config.json`` sets ``add_bos_token``
false (Llama 1/2 and Mistral's tokenizers add it); the bytes tokenizer's, never.

Special-token ids are read, first found wins, from ``tokenizer_config.json``,
``special_tokens_map.json`` (token strings, looked up in the vocabulary), ``generation_config.json``
and ``config.json`` (``*_token_id``); a SentencePiece model's own ids come last. ``stop_ids`` is
every EOS id those files name (``generation_config.json`` often lists several, e.g. Llama 3's
``<|end_of_text|>`` and ``<|eot_id|>``): what a rollout engine stops on.

``pad_id`` is always an int: the model's pad token, else EOS, else 0. Padded positions are masked
out (``attention_mask``/``loss_mask``), so any valid id will do there.

``decode`` keeps special tokens, as transformers' does by default (a rendered prompt shows its chat
markup); ``skip_special_tokens=True`` skips them, as verl decodes the responses (and prompts) its
reward functions read and vLLM its output text: the trainers decode what rewards, rules and
samples.jsonl read that way, so that a ``<|im_start|>`` sampled mid-response never reaches a
reward's regex. What is special, per backend: ``tokenizer.json``, the added tokens marked special (as
transformers' fast tokenizers);
SentencePiece, its control and unknown pieces and the ids named bos/eos/pad (transformers'
``all_special_ids`` for such a model; user-defined pieces are text); bytes, pad/bos/eos, which carry no
text in either mode (the built-in models' ``tokenizer.json`` decodes them to nothing as well).

``chat_template`` is the model's chat template, found where transformers looks: ``chat_template.jinja``
first, else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of named templates
of which ``default`` is used). It is rendered with the special-token strings of
``tokenizer_config.json``, else ``special_tokens_map.json``. Only ``tokenizer.json`` tokenizers have
one: a template writes special tokens as text (``<|im_start|>``), which ``tokenizer.json``'s added
tokens turn back into their ids but a SentencePiece model would spell out piece by piece.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from megatron_rlhf.config.loader import ConfigError
from megatron_rlhf.metrics.log import log
from megatron_rlhf.models.architecture import Architecture
from megatron_rlhf.models.builtin import BYTE_SPECIALS

from .chat_template import SPECIAL_TOKEN_VARIABLES, ChatTemplate

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "template_turn_end",
    "turn_end_warning",
]

# Looked for in this order by load_tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_TOKEN_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")  # token strings
_ID_CONFIGS = ("generation_config.json", "config.json")  # token ids
_ROLES = ("bos", "eos", "pad")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the rollout engine need from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    adds_bos: bool
    pad_id: int
    stop_ids: tuple[int, ...]
    chat_template: ChatTemplate | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; special tokens kept unless ``skip_special_tokens`` (module docstring)."""
        ...

    def decode_batch(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool = False) -> list[str]:
        """``[decode(ids) for ids in rows]``, in one call: a rollout's responses are decoded
        together (in parallel threads where the library has them)."""
        ...


# --------------------------------------------------------------------------- special tokens


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read tokenizer metadata: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_string(value: Any) -> str | None:
    """A token as written by HF: a string, an AddedToken dict ``{"content": ...}``, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_ids(
    model_dir: Path, token_to_id: Callable[[str], int | None], vocab_size: int
) -> tuple[dict[str, int | None], tuple[int, ...]]:
    """Resolve bos/eos/pad from the model's JSON files; returns (role -> id, all eos ids)."""
    found: dict[str, int | None] = dict.fromkeys(_ROLES)
    stop: list[int] = []

    def check(path: Path, field: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(f"{path}: {field}={value!r} is not a token id of this tokenizer (vocab_size={vocab_size})")
        return value

    for name in _TOKEN_CONFIGS:
        path = model_dir / name
        if not path.is_file():
            continue
        data = _read_json(path)
        for role in _ROLES:
            token = _token_string(data.get(f"{role}_token"))
            if token is None:
                continue
            tid = token_to_id(token)
            if tid is None:
                raise ValueError(f"{path}: {role}_token={token!r} is not in the tokenizer's vocabulary")
            if found[role] is None:
                found[role] = tid
            if role == "eos":
                stop.append(tid)
    for name in _ID_CONFIGS:
        path = model_dir / name
        if not path.is_file():
            continue
        data = _read_json(path)
        for role in _ROLES:
            field = f"{role}_token_id"
            value = data.get(field)
            if value is None:
                continue
            ids = [check(path, field, v) for v in (value if isinstance(value, list) else [value])]
            if ids and found[role] is None:
                found[role] = ids[0]
            if role == "eos":
                stop.extend(ids)
    return found, tuple(dict.fromkeys(stop))  # de-duplicated, first-seen order


def _pad_of(pad: int | None, eos: int | None) -> int:
    return pad if pad is not None else eos if eos is not None else 0


def _chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model's chat template (see the module docstring), or None when it ships none."""
    configs = {name: _read_json(model_dir / name) for name in _TOKEN_CONFIGS if (model_dir / name).is_file()}
    specials: dict[str, str] = {}
    for data in configs.values():  # tokenizer_config.json first: first found wins
        for variable in SPECIAL_TOKEN_VARIABLES:
            token = _token_string(data.get(variable))
            if token is not None:
                specials.setdefault(variable, token)
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path), specials)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the chat template: {exc}") from exc
    path = model_dir / "tokenizer_config.json"
    template = configs.get(path.name, {}).get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"{path}: chat_template lists templates named {sorted(map(str, named))} but none "
                "named 'default', the one used for prompts"
            )
        template = named["default"]
    if not isinstance(template, str):
        raise ValueError(
            f"{path}: chat_template must be a Jinja template string or a list of "
            f"{{name, template}} objects, got {type(template).__name__}"
        )
    return ChatTemplate(template, f"{path} (chat_template)", specials)


# --------------------------------------------------------------------------- backends


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) through the ``tokenizers`` library."""

    def __init__(self, model_dir: Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:  # pragma: no cover - transformers depends on it
            raise ImportError(
                f"{model_dir / 'tokenizer.json'} needs the 'tokenizers' package: pip install tokenizers"
            ) from exc
        path = model_dir / "tokenizer.json"
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{path}: cannot load tokenizer: {exc}") from exc
        self.path = path
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        ids, stop = _special_ids(model_dir, self._tok.token_to_id, self.vocab_size)
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.pad_id: int = _pad_of(ids["pad"], ids["eos"])
        self.stop_ids: tuple[int, ...] = stop
        self.chat_template: ChatTemplate | None = _chat_template(model_dir)
        marked = self._tok.encode("a", add_special_tokens=True).ids  # with the post-processor's tokens
        plain = self._tok.encode("a", add_special_tokens=False).ids
        self.adds_bos: bool = self.bos_id is not None and marked[:1] == [self.bos_id] != plain[:1]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool = False) -> list[str]:
        return self._tok.decode_batch([list(ids) for ids in rows], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (Llama 1/2, Mistral v0.1 style checkpoints)."""

    def __init__(self, model_dir: Path) -> None:
        import sentencepiece as spm

        path = model_dir / "tokenizer.model"
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"{path}: cannot load SentencePiece model: {exc}") from exc
        self.path = path
        self.vocab_size: int = self._sp.get_piece_size()
        ids, stop = _special_ids(model_dir, self._piece_id, self.vocab_size)
        # SentencePiece reports a disabled special piece as -1.
        own = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(), "pad": self._sp.pad_id()}
        for role in _ROLES:
            if ids[role] is None and own[role] >= 0:
                ids[role] = own[role]
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        config = model_dir / "tokenizer_config.json"
        setting = _read_json(config).get("add_bos_token") if config.is_file() else None
        self.adds_bos: bool = self.bos_id is not None and setting is not False
        self.pad_id: int = _pad_of(ids["pad"], ids["eos"])
        self.stop_ids: tuple[int, ...] = stop or ((self.eos_id,) if self.eos_id is not None else ())
        self.chat_template: ChatTemplate | None = None  # see the module docstring
        named = {i for i in (self.bos_id, self.eos_id, ids["pad"], *self.stop_ids) if i is not None}
        pieces = {i for i in range(self.vocab_size) if self._sp.is_control(i) or self._sp.is_unknown(i)}
        self._special = frozenset(named | pieces)

    def _piece_id(self, piece: str) -> int | None:
        # piece_to_id answers unk for unknown pieces: check the round trip.
        tid = self._sp.piece_to_id(piece)
        return tid if self._sp.id_to_piece(tid) == piece else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def _text_ids(self, ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
        """``ids`` without the special ones when skipping them; SentencePiece's own decode otherwise
        (which writes control pieces as nothing and the unknown piece as ' ⁇ ')."""
        return [i for i in ids if i not in self._special] if skip_special_tokens else list(ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._sp.decode(self._text_ids(ids, skip_special_tokens))

    def decode_batch(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool = False) -> list[str]:
        return self._sp.decode([self._text_ids(ids, skip_special_tokens) for ids in rows])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer:
    """UTF-8 bytes as tokens: the built-in models' tokenizer in plain Python, with no files (their
    ``tokenizer.json``, written by ``models/builtin.py``, gives the same ids and text).

    Ids: pad=0, bos=1, eos=2, byte b -> b + 3. Ids 259..vocab_size-1 exist in the model (a random
    model may sample them) but stand for no byte: they decode to U+FFFD so they stay visible.
    """

    PAD, BOS, EOS = range(len(BYTE_SPECIALS))
    OFFSET = len(BYTE_SPECIALS)

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256 + self.OFFSET:
            raise ValueError(
                f"ByteTokenizer needs vocab_size >= {256 + self.OFFSET} (3 special ids + 256 bytes), got {vocab_size!r}"
            )
        self.vocab_size = vocab_size
        self.bos_id: int | None = self.BOS
        self.eos_id: int | None = self.EOS
        self.adds_bos = False
        self.pad_id = self.PAD
        self.stop_ids: tuple[int, ...] = (self.EOS,)
        self.chat_template: ChatTemplate | None = None

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Either way pad/bos/eos carry no text (``skip_special_tokens`` is there for the protocol)."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range for ByteTokenizer(vocab_size={self.vocab_size})")
            if i >= 256 + self.OFFSET:
                out += "\ufffd".encode("utf-8")
            elif i >= self.OFFSET:
                out.append(i - self.OFFSET)
            # pad / bos / eos are structure, not text
        return out.decode("utf-8", errors="replace")

    def decode_batch(self, rows: Sequence[Sequence[int]], *, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids) for ids in rows]

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


PROBE_TEXT = (
    "Resume probe: Hello, world! 123 + 456 = 579.\n\tdéjà vu — ünïcödé 日本語 🙂 <|endoftext|> def f(x): return x"
)
"""Words, digits, whitespace, accents, CJK, emoji, code and a special token's text: what two
tokenizers that encode text alike give the same ids for."""


_TURN_PROBE = "The answer is 42."


def template_turn_end(tokenizer: Tokenizer, variables: Mapping[str, Any] | None = None) -> int | None:
    """The special token the chat template ends an assistant turn with (ChatML's ``<|im_end|>``,
    Llama 3's ``<|eot_id|>``); None without a template, or where a turn ends in text. It need not be
    one of ``stop_ids``: a base model's EOS (Qwen2.5's ``<|endoftext|>``) beside the template's
    ``<|im_end|>``."""
    template = tokenizer.chat_template
    if template is None:
        return None
    conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _TURN_PROBE}]
    text = template.render(conversation, variables=variables, add_generation_prompt=False)
    if text.count(_TURN_PROBE) != 1:
        return None
    for token in tokenizer.encode(text[text.index(_TURN_PROBE) + len(_TURN_PROBE) :]):
        special = tokenizer.decode([token], skip_special_tokens=True) == "" and tokenizer.decode([token]) != ""
        if special:
            return token
        if tokenizer.decode([token]).strip():
            return None  # the turn ends in text before any special token
    return None


def turn_end_warning(
    tokenizer: Tokenizer, stops: Collection[int], variables: Mapping[str, Any] | None, setting: str
) -> str | None:
    """Where prompts rendered with the chat template will be answered past the end of the turn: the
    template's turn end (``template_turn_end``) is none of the rollout's ``stops``. ``setting``: the
    key that adds stop tokens."""
    end = template_turn_end(tokenizer, variables)
    if end is None or end in stops:
        return None
    return (
        f"warning: the chat template ends an assistant turn with {tokenizer.decode([end])!r} (id {end}), which "
        f"is not a stop token here ({sorted(stops)}, from the tokenizer and the settings): a response to a "
        f"prompt the template rendered runs on past its turn until one of those or the token limit; add "
        f"{setting}=[{end}] to end responses there"
    )


def same_encoding(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ``a`` and ``b`` give text the same ids (``PROBE_TEXT``) over vocabularies of one size."""
    return a.vocab_size == b.vocab_size and a.encode(PROBE_TEXT) == b.encode(PROBE_TEXT)


def has_tokenizer(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds one of ``TOKENIZER_FILES`` (what ``load_tokenizer`` reads)."""
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer stored with a model: ``tokenizer.json`` first, else ``tokenizer.model``.

    A directory with neither raises FileNotFoundError.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"tokenizer directory '{model_dir}' does not exist or is not a directory")
    if (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    if (model_dir / "tokenizer.model").is_file():
        return SentencePieceTokenizer(model_dir)
    raise FileNotFoundError(f"no tokenizer in '{model_dir}': looked for {', '.join(TOKENIZER_FILES)}")


def resolve_tokenizer(source: Path, arch: Architecture, model_path: str) -> Tokenizer:
    """The tokenizer of a model directory (built-in models ship theirs: bytes as tokens)."""
    if not has_tokenizer(source):
        raise ConfigError(
            f"model path {model_path!r}: no tokenizer in {source} (looked for {', '.join(TOKENIZER_FILES)})"
        )
    tokenizer = load_tokenizer(source)
    log(f"tokenizer: {tokenizer!r} from {source}")
    if tokenizer.vocab_size > arch.vocab_size:
        raise ConfigError(
            f"the tokenizer in {source} has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {arch.vocab_size}: token ids would fall outside the embedding"
        )
    return tokenizer
