"""A fast path for BERT's WordPiece tokenizer on ASCII text: the same ids as ``tokenizers``.

A one-sentence query spends more time in the ``tokenizers`` call than in anything else outside
the graph: after the graph has run, its code and tables are out of the caches, and one call
costs ~0.15 ms for a short sentence (~0.03 ms when warm). The class of input that dominates
queries, ASCII text, needs little of that machinery: the normaliser reduces to dropping
control characters, spaces for tabs and newlines and (optionally) lowercasing, the
pre-tokenizer to runs of letters and digits and single punctuation characters, and the
model to greedy longest-match-first lookups in the vocabulary. That loop runs natively
(``ferrograph._core.WordPieceAscii``, one pass over the text's bytes): ~0.03 ms cold.

:meth:`FastWordPiece.from_tokenizer` accepts only the exact pipeline this reproduces (a
``BertNormalizer`` that cleans text, ``BertPreTokenizer``, a ``WordPiece`` model, a
``[CLS] $A [SEP]`` template or ``BertProcessing``, right truncation, no padding) and
:meth:`FastWordPiece.encode` returns ``None`` for text outside its class — non-ASCII text, or
text holding the first character of any added token (``[`` for BERT's ``[CLS]``, ``[MASK]``,
...) — so the caller falls back to ``tokenizers`` and the ids are always the library's.
The tests compare the two on fuzzed ASCII text.
"""

from __future__ import annotations

import json
from typing import Any

from .. import _core

__all__ = ["FastEncoding", "FastWordPiece"]


class FastEncoding:
    """The ids and token type ids of one encoded text (what :func:`~.tokenization.pad` reads
    from a ``tokenizers.Encoding``)."""

    __slots__ = ("ids", "type_ids")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.type_ids = [0] * len(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"FastEncoding(ids={self.ids!r})"


class FastWordPiece:
    """BERT's WordPiece tokenization of ASCII text, bit-exact with ``tokenizers`` (see the
    module doc). Build it with :meth:`from_tokenizer`."""

    def __init__(self, native: _core.WordPieceAscii) -> None:
        self._native = native

    def __repr__(self) -> str:
        return f"FastWordPiece({self._native!r})"

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> FastWordPiece | None:
        """The fast path for ``tokenizer`` (a ``tokenizers.Tokenizer``), or ``None`` when its
        pipeline is not exactly the one reproduced here."""
        try:
            raw = json.loads(tokenizer.to_str())
        except (AttributeError, ValueError, TypeError):
            return None
        if not isinstance(raw, dict):
            return None
        normalizer = raw.get("normalizer") or {}
        model = raw.get("model") or {}
        if (
            normalizer.get("type") != "BertNormalizer"
            or normalizer.get("clean_text") is not True
            or not isinstance(normalizer.get("lowercase"), bool)
            or (raw.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
            or model.get("type") != "WordPiece"
            or raw.get("padding") is not None
        ):
            return None
        vocab = model.get("vocab")
        prefix = model.get("continuing_subword_prefix")
        max_word_chars = model.get("max_input_chars_per_word")
        if (
            not isinstance(vocab, dict)
            or not isinstance(prefix, str)
            or not isinstance(max_word_chars, int)
            or model.get("unk_token") not in vocab
        ):
            return None
        ends = _template_ends(raw.get("post_processor"))
        if ends is None:
            return None
        truncation = raw.get("truncation")
        max_length: int | None = None
        if truncation is not None:
            if (
                truncation.get("direction") != "Right"
                or truncation.get("stride") != 0
                or not isinstance(truncation.get("max_length"), int)
                or truncation["max_length"] < 3
            ):
                return None
            max_length = truncation["max_length"]
        # Text holding the first character of an added token (either case: some are matched
        # after normalisation) goes to the library, which splits such tokens out.
        triggers: set[str] = set()
        for token in tokenizer.get_added_tokens_decoder().values():
            content = token.content
            if not content or not content[0].isascii() or content[0].isspace():
                return None
            triggers.update({content[0], content[0].lower(), content[0].upper()})
        native = _core.WordPieceAscii(
            {str(k): int(v) for k, v in vocab.items()},
            prefix=prefix,
            unk_id=int(vocab[model["unk_token"]]),
            cls_id=ends[0],
            sep_id=ends[1],
            max_word_chars=max_word_chars,
            lowercase=normalizer["lowercase"],
            max_pieces=None if max_length is None else max_length - 2,
            triggers="".join(sorted(triggers)),
        )
        return cls(native)

    def encode(self, text: str) -> FastEncoding | None:
        """``[CLS]`` + the word pieces of ``text`` (truncated) + ``[SEP]``, or ``None`` when
        ``text`` is outside the fast path's class (the caller then uses ``tokenizers``)."""
        ids = self._native.encode(text)
        return None if ids is None else FastEncoding(ids)


def _template_ends(post: Any) -> tuple[int, int] | None:
    """The ids a single-sequence post-processor puts before and after the text, when it is
    exactly ``[CLS] $A [SEP]`` with type id 0 throughout (a template or ``BertProcessing``)."""
    if not isinstance(post, dict):
        return None
    if post.get("type") == "BertProcessing":
        cls, sep = post.get("cls"), post.get("sep")
        if (
            isinstance(cls, list)
            and isinstance(sep, list)
            and len(cls) == 2
            and len(sep) == 2
            and isinstance(cls[1], int)
            and isinstance(sep[1], int)
        ):
            return cls[1], sep[1]
        return None
    if post.get("type") != "TemplateProcessing":
        return None
    single = post.get("single")
    specials = post.get("special_tokens") or {}
    if not isinstance(single, list) or len(single) != 3:
        return None
    try:
        first, middle, last = (single[0]["SpecialToken"], single[1]["Sequence"], single[2])
        last = last["SpecialToken"]
    except (KeyError, TypeError):
        return None
    if middle.get("id") != "A" or any(p.get("type_id") != 0 for p in (first, middle, last)):
        return None
    ids = []
    for part in (first, last):
        special = specials.get(part.get("id"))
        if not isinstance(special, dict) or not isinstance(special.get("ids"), list):
            return None
        if len(special["ids"]) != 1 or not isinstance(special["ids"][0], int):
            return None
        ids.append(special["ids"][0])
    return ids[0], ids[1]
