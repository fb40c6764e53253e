"""Tokenizers of GGUF language models, built from the vocabulary in the file's metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

* ``gpt2``: byte-level BPE (tokens are strings over GPT-2's byte alphabet, merges are
  listed). The pre-tokenizer (how text is cut before BPE) is the one ``tokenizer.ggml.pre``
  names; :data:`PRE_TOKENIZERS` lists those known.
* ``llama``: SentencePiece-style BPE (tokens carry scores; spaces are ``▁``; bytes missing from
  the vocabulary fall back to ``<0xXX>`` tokens). Merges are derived from the scores: a pair
  merges with the rank of the token it forms, higher scores first — the way SentencePiece's
  BPE picks its merges.

The ``tokenizers`` library does the splitting and merging. Control tokens (token type 3) and
user-defined tokens (type 4) are matched as single tokens in text only when asked
(``parse_special=True``), as llama.cpp does. Detokenization works on bytes, so a character
split over several tokens is assembled correctly; :class:`StreamDecoder` holds back an
incomplete UTF-8 sequence until its last byte arrives.
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ferrograph as fg

from .settings import UnsupportedModelError
from .tokenization import check_unicode

# Token types of tokenizer.ggml.token_type (llama.cpp's numbering).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` values understood for ``gpt2`` vocabularies: the regular expressions
#: applied one after the other (each piece of the previous split is split again).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_PATTERN,),
    "gpt2": (_GPT2_PATTERN,),
    "gpt-2": (_GPT2_PATTERN,),
    "smollm": (r"\p{N}", _GPT2_PATTERN),
    "starcoder": (r"\p{N}", _GPT2_PATTERN),
    "llama-bpe": (_LLAMA3_PATTERN,),
    "llama3": (_LLAMA3_PATTERN,),
    "qwen2": (_QWEN2_PATTERN,),
    "deepseek-r1-qwen": (_QWEN2_PATTERN,),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModelError(f"the file has no {key!r}: it carries no tokenizer")
    return meta[key]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (restored after, as it was).

    Reading a vocabulary makes ~100k small container objects (tuples of merge pairs, list and
    dict entries), none of them in a cycle; the collector's passes over them were ~30% of a
    49k-token tokenizer's build (measured in a fresh process: 97 ms with it, 70 ms without).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class GGUFTokenizer:
    """Text ↔ token ids for a GGUF language model.

    Parameters
    ----------
    metadata:
        The file's metadata (``GGUFFile.metadata``).

    Raises
    ------
    UnsupportedModelError
        For a vocabulary kind or pre-tokenizer this module does not implement (the message
        names the metadata key and value).
    """

    def __init__(self, metadata: dict[str, Any]) -> None:
        try:
            import tokenizers  # noqa: F401
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise ImportError("GGUF tokenizers need the 'tokenizers' package") from e
        with _collector_paused():
            self._read(metadata)

    def _read(self, metadata: dict[str, Any]) -> None:
        """Reads the vocabulary from ``metadata`` and builds the tokenizer."""
        self.model: str = str(_require(metadata, "tokenizer.ggml.model"))
        tokens = list(_require(metadata, "tokenizer.ggml.tokens"))
        self.tokens: list[str] = [str(t) for t in tokens]
        n = len(self.tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        self.token_types: list[int] = (
            [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * n
        )
        if len(self.token_types) != n:
            raise UnsupportedModelError(
                f"tokenizer.ggml.token_type has {len(self.token_types)} entries for {n} tokens"
            )
        self.pre: str = str(metadata.get("tokenizer.ggml.pre", "default"))
        self.bos_id: int | None = _opt_id(metadata, "tokenizer.ggml.bos_token_id", n)
        self.eos_id: int | None = _opt_id(metadata, "tokenizer.ggml.eos_token_id", n)
        self.eot_id: int | None = _opt_id(metadata, "tokenizer.ggml.eot_token_id", n)
        self.eom_id: int | None = _opt_id(metadata, "tokenizer.ggml.eom_token_id", n)
        self.unk_id: int | None = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", n)
        self.pad_id: int | None = _opt_id(metadata, "tokenizer.ggml.padding_token_id", n)
        default_bos = self.model == "llama"
        self.add_bos: bool = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
        self.add_eos: bool = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix: bool = bool(
            metadata.get("tokenizer.ggml.add_space_prefix", self.model == "llama")
        )
        if self.model == "gpt2":
            merges = _require(metadata, "tokenizer.ggml.merges")
            if not all(isinstance(m, str) for m in merges):
                raise UnsupportedModelError("tokenizer.ggml.merges must be strings")
            self._build_plain, self._special = self._build_gpt2(list(merges))
        elif self.model == "llama":
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != n:
                raise UnsupportedModelError(
                    "a 'llama' (SentencePiece) vocabulary needs tokenizer.ggml.scores, one per "
                    "token"
                )
            self._build_plain, self._special = self._build_spm([float(s) for s in scores])
        else:
            raise UnsupportedModelError(
                f"tokenizer.ggml.model {self.model!r} is not supported (supported: 'gpt2' "
                "byte-level BPE, 'llama' SentencePiece BPE)"
            )
        # end-of-generation tokens: EOS, EOT, EOM
        self.eog_ids: frozenset[int] = frozenset(
            i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None
        )
        # built when first asked for (a model's load does not pay for 50k tokens' bytes, nor
        # for the tokenizer that reads control-token text as plain text, which prompts of
        # generate and chat never use)
        self._token_bytes: list[bytes | None] = [None] * n
        self._plain_tokenizer: Any = None

    @property
    def _plain(self) -> Any:
        """The tokenizer that reads control-token text as plain text (built on first use)."""
        if self._plain_tokenizer is None:
            self._plain_tokenizer = self._build_plain()
        return self._plain_tokenizer

    # ----- construction -----

    def _special_tokens(self) -> list[Any]:
        """Control and user-defined tokens, matched whole in text with ``parse_special``."""
        from tokenizers import AddedToken

        return [
            AddedToken(tok, special=True, normalized=False)
            for tok, kind in zip(self.tokens, self.token_types, strict=True)
            if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and tok
        ]

    def _build_gpt2(self, merges: list[str]) -> tuple[Callable[[], Any], Any]:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        patterns = PRE_TOKENIZERS.get(self.pre)
        if patterns is None:
            raise UnsupportedModelError(
                f"tokenizer.ggml.pre {self.pre!r} is not supported (known: "
                f"{', '.join(sorted(PRE_TOKENIZERS))})"
            )
        for m in merges:
            if " " not in m:
                raise UnsupportedModelError(f"tokenizer.ggml.merges has a bad entry {m!r}")

        def build() -> Any:
            # The vocabulary and merge pairs are made per build and dropped after it (about
            # 13 MB for a 49k vocabulary): the merges list itself is the metadata's.
            vocab = {tok: i for i, tok in enumerate(self.tokens)}
            pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
            # llama-3-style vocabularies take a pre-token that is itself a token whole
            whole = self.pre in ("llama-bpe", "llama3")
            tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=whole))
            splits: list[Any] = [
                pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns
            ]
            splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
            tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
            tok.decoder = decoders.ByteLevel()
            return tok

        special = build()
        special.add_special_tokens(self._special_tokens())
        return build, special

    def _build_spm(self, scores: list[float]) -> tuple[Callable[[], Any], Any]:
        from tokenizers import Tokenizer, models, normalizers

        vocab = {tok: i for i, tok in enumerate(self.tokens)}
        # merges from scores: every split of a normal token into two vocabulary tokens, ranked
        # by the score of the token it forms (higher first), then by the pieces' ids
        ranked: list[tuple[float, int, int, str, str]] = []
        for i, tok in enumerate(self.tokens):
            if self.token_types[i] != TOKEN_NORMAL or len(tok) < 2:
                continue
            for cut in range(1, len(tok)):
                left, right = tok[:cut], tok[cut:]
                li, ri = vocab.get(left), vocab.get(right)
                if li is not None and ri is not None:
                    ranked.append((-scores[i], li, ri, left, right))
        ranked.sort()
        pairs = [(left, right) for _, _, _, left, right in ranked]
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None

        def build() -> Any:
            tok = Tokenizer(
                models.BPE(vocab, pairs, unk_token=unk, byte_fallback=True, fuse_unk=True)
            )
            steps: list[Any] = [normalizers.Replace(" ", "▁")]
            if self.add_space_prefix:
                steps.insert(0, normalizers.Prepend("▁"))
            tok.normalizer = normalizers.Sequence(steps)
            return tok

        special = build()
        special.add_special_tokens(self._special_tokens())
        return build, special

    def _bytes_of(self, i: int) -> bytes:
        tok, kind = self.tokens[i], self.token_types[i]
        if kind == TOKEN_CONTROL:
            return b""
        if self.model == "gpt2":
            if kind == TOKEN_USER_DEFINED:
                return tok.encode("utf-8")
            try:
                return bytes(_CHAR_TO_BYTE[c] for c in tok)
            except KeyError:
                return tok.encode("utf-8")
        if kind == TOKEN_BYTE:
            m = _BYTE_TOKEN.fullmatch(tok)
            if m:
                return bytes([int(m.group(1), 16)])
        return tok.replace("▁", " ").encode("utf-8")

    # ----- public API -----

    @property
    def n_vocab(self) -> int:
        """The number of tokens."""
        return len(self.tokens)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_special``: add BOS/EOS as the file's ``add_bos_token``/``add_eos_token`` say.
        ``parse_special``: read control-token text (``<|im_start|>``) as that one token; else
        it is tokenized as plain text. Text with a lone surrogate (not valid Unicode) raises
        :class:`ferrograph.InvalidArgumentError`.
        """
        if not isinstance(text, str):
            raise fg.ArgumentTypeError(f"tokenize expects a str, got {type(text).__name__}")
        tok = self._special if parse_special else self._plain
        try:
            ids: list[int] = list(tok.encode(text, add_special_tokens=False).ids) if text else []
        except TypeError:  # tokenizers' answer to a lone surrogate says nothing of why
            check_unicode([("the text", text)])
            raise
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def check_ids(self, ids: Iterable[int]) -> list[int]:
        """``ids`` as a list, each checked to be a token of the vocabulary."""
        out = []
        n = self.n_vocab
        for t in ids:
            i = int(t)
            if not 0 <= i < n:
                raise fg.InvalidArgumentError(f"token id {i} is outside the vocabulary (0..{n})")
            out.append(i)
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (empty for control tokens)."""
        cached = self._token_bytes[token_id]
        if cached is None:
            cached = self._token_bytes[token_id] = self._bytes_of(token_id)
        return cached

    def detokenize(self, ids: Sequence[int], remove_space_prefix: bool = True) -> str:
        """The text of ``ids``; invalid UTF-8 becomes U+FFFD. For SentencePiece vocabularies
        the space added before the first word is removed (``remove_space_prefix``)."""
        data = b"".join(self.token_bytes(i) for i in self.check_ids(ids))
        if (
            remove_space_prefix
            and self.model == "llama"
            and self.add_space_prefix
            and data.startswith(b" ")
        ):
            data = data[1:]
        return data.decode("utf-8", errors="replace")


def _opt_id(meta: dict[str, Any], key: str, n: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    i = int(value)
    return i if 0 <= i < n else None


class StreamDecoder:
    """Turns token ids into text pieces as they come, holding back an incomplete UTF-8
    sequence until it is complete (a multi-byte character split over tokens is never cut)."""

    def __init__(self, tokenizer: GGUFTokenizer, first: bool = True) -> None:
        self._tok = tokenizer
        self._pending = b""
        self._first = first

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text that is now complete (may be empty)."""
        data = self._pending + self._tok.token_bytes(token_id)
        if (
            self._first
            and self._tok.model == "llama"
            and self._tok.add_space_prefix
            and data.startswith(b" ")
        ):
            data = data[1:]
        if data:
            self._first = False
        cut = _complete_prefix(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """The held-back bytes (an unfinished character becomes U+FFFD)."""
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")


def _complete_prefix(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence."""
    n = len(data)
    # look back at most 3 bytes for the start of a multi-byte sequence
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:
            continue  # continuation byte: keep looking for the lead byte
        if b & 0x80 == 0:
            return n  # ASCII: complete
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n if back >= need else n - back
    return n
