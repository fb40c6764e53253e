"""Tokenizing as sentence-transformers does (``tokenizers`` with the model's ``tokenizer.json``)
and padding batches.

sentence-transformers calls the Hugging Face tokenizer with ``truncation="longest_first"`` and
``max_length`` = the model's ``max_seq_length``, which overrides the truncation written in
``tokenizer.json``; with ``do_lower_case`` it puts a ``Lowercase`` normalizer in front when the
tokenizer has none. :func:`load_tokenizer` sets up the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .weights import INSTALL_HINT, MissingDependencyError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["Batch", "load_tokenizer", "pad", "set_truncation", "tokenize"]


def _has_lowercase(normalizer: Any) -> bool:
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as NormalizerSequence

    if normalizer is None:
        return False
    if isinstance(normalizer, Lowercase):
        return True
    if isinstance(normalizer, NormalizerSequence):
        parts: list[Any] = list(normalizer)  # type: ignore[call-overload]
        return any(isinstance(n, Lowercase) for n in parts)
    return False


def load_tokenizer(model_dir: Path, max_length: int, do_lower_case: bool = False) -> Tokenizer:
    """The model's fast tokenizer, truncating to ``max_length`` tokens, not padding.

    Raises
    ------
    MissingDependencyError
        If ``tokenizers`` is not installed.
    """
    try:
        from tokenizers import Tokenizer
        from tokenizers.normalizers import Lowercase
        from tokenizers.normalizers import Sequence as NormalizerSequence
    except ImportError as error:
        raise MissingDependencyError(f"tokenization needs tokenizers: {INSTALL_HINT}") from error
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if do_lower_case and not _has_lowercase(tokenizer.normalizer):
        current = tokenizer.normalizer
        if current is None:
            parts = [Lowercase()]
        elif isinstance(current, NormalizerSequence):
            parts = [Lowercase(), *list(current)]  # type: ignore[call-overload]
        else:
            parts = [Lowercase(), current]
        tokenizer.normalizer = NormalizerSequence(parts)
    set_truncation(tokenizer, max_length)
    tokenizer.no_padding()  # batches are padded here, to their own (bucketed) longest sequence
    return tokenizer


def set_truncation(tokenizer: Tokenizer, max_length: int) -> None:
    """Truncates to ``max_length`` tokens (special tokens included), longest first."""
    tokenizer.enable_truncation(max_length=max_length, strategy="longest_first")


@dataclass(frozen=True)
class Batch:
    """Token ids of a batch, padded to a common length (all arrays ``(batch, seq)``).

    Attributes
    ----------
    input_ids, token_type_ids
        int32 ids (padding has id 0).
    attention_mask
        1 for real tokens, 0 for padding (int32).
    """

    input_ids: npt.NDArray[np.int32]
    token_type_ids: npt.NDArray[np.int32]
    attention_mask: npt.NDArray[np.int32]

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, seq)."""
        b, s = self.input_ids.shape
        return int(b), int(s)

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        """Real tokens per sentence."""
        result: npt.NDArray[np.int64] = self.attention_mask.sum(axis=1, dtype=np.int64)
        return result


def pad(encodings: Sequence[Any], length: int | None = None) -> Batch:
    """Pads encodings (``tokenizers.Encoding``) to ``length`` (default: the longest)."""
    longest = max(len(e.ids) for e in encodings)
    seq = longest if length is None else length
    if seq < longest:
        raise ValueError(f"cannot pad {longest} tokens to {seq}")
    n = len(encodings)
    ids = np.zeros((n, seq), np.int32)
    types = np.zeros((n, seq), np.int32)
    mask = np.zeros((n, seq), np.int32)
    for i, e in enumerate(encodings):
        k = len(e.ids)
        ids[i, :k] = e.ids
        types[i, :k] = e.type_ids
        mask[i, :k] = 1
    return Batch(ids, types, mask)


def tokenize(tokenizer: Tokenizer, sentences: Sequence[str]) -> Batch:
    """Tokenizes ``sentences`` with a tokenizer from :func:`load_tokenizer` and pads them to
    the longest."""
    return pad(tokenizer.encode_batch(list(sentences)))
