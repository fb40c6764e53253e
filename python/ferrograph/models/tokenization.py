"""Tokenizing as sentence-transformers does (``tokenizers`` with the model's ``tokenizer.json``)
and padding batches.

sentence-transformers calls the Hugging Face tokenizer with ``truncation="longest_first"`` and
``max_length`` = the model's ``max_seq_length``, which overrides the truncation written in
``tokenizer.json``; with ``do_lower_case`` it puts a ``Lowercase`` normalizer in front when the
tokenizer has none. :func:`load_tokenizer` sets up the same.

The Hugging Face BERT tokenizer (``tokenizer_class`` ``BertTokenizer`` / ``BertTokenizerFast``,
or none: the class a ``bert`` model gets) takes its text normalisation from
``tokenizer_config.json`` (``do_lower_case``, ``strip_accents``, ``tokenize_chinese_chars``, with
BERT's defaults), not from ``tokenizer.json``'s normalizer, so the normalizer is rebuilt from those
here too. A generic fast tokenizer (``PreTrainedTokenizerFast``) uses ``tokenizer.json`` as it is.
Other tokenizer classes raise :class:`~ferrograph.models.UnsupportedModelError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .settings import UnsupportedModelError
from .weights import INSTALL_HINT, MissingDependencyError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "Batch",
    "check_unicode",
    "load_tokenizer",
    "pad",
    "set_truncation",
    "special_token_ids",
    "tokenize",
    "unicode_problem",
]


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


_BERT_CLASSES = (None, "BertTokenizer", "BertTokenizerFast")
_VERBATIM_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _apply_tokenizer_config(tokenizer: Tokenizer, model_dir: Path) -> None:
    """Gives ``tokenizer`` the normaliser the Hugging Face tokenizer class would use."""
    from tokenizers import normalizers

    path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise UnsupportedModelError(f"{path} is not valid JSON: {error}") from error
        if not isinstance(loaded, dict):
            raise UnsupportedModelError(f"{path} must hold a JSON object")
        config = loaded
    kind = config.get("tokenizer_class")
    if kind in _VERBATIM_CLASSES:
        return
    if kind not in _BERT_CLASSES:
        raise UnsupportedModelError(
            f"{path}: tokenizer_class {kind!r} is not supported (BertTokenizer, "
            "BertTokenizerFast or PreTrainedTokenizerFast)"
        )
    raw = json.loads(tokenizer.to_str())
    model_type = (raw.get("model") or {}).get("type")
    pre_type = (raw.get("pre_tokenizer") or {}).get("type")
    if model_type != "WordPiece" or pre_type != "BertPreTokenizer":
        raise UnsupportedModelError(
            f"{model_dir / 'tokenizer.json'}: a {model_type} model with a {pre_type} "
            "pre-tokenizer, but tokenizer_config.json asks for BERT's WordPiece tokenizer"
        )
    lowercase, strip_accents = config.get("do_lower_case", True), config.get("strip_accents")
    chinese = config.get("tokenize_chinese_chars", True)
    for key, value in (("do_lower_case", lowercase), ("tokenize_chinese_chars", chinese)):
        if not isinstance(value, bool):
            raise UnsupportedModelError(f"{path}: {key} must be true or false")
    if strip_accents is not None and not isinstance(strip_accents, bool):
        raise UnsupportedModelError(f"{path}: strip_accents must be true, false or null")
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=chinese,
        strip_accents=strip_accents,
        lowercase=lowercase,
    )


def load_tokenizer(model_dir: Path, max_length: int, do_lower_case: bool = False) -> Tokenizer:
    """The model's fast tokenizer, truncating to ``max_length`` tokens, not padding.

    Raises
    ------
    MissingDependencyError
        If ``tokenizers`` is not installed.
    UnsupportedModelError
        For a tokenizer class other than BERT's or the generic fast one.
    """
    try:
        from tokenizers import Tokenizer
        from tokenizers.normalizers import Lowercase
        from tokenizers.normalizers import Sequence as NormalizerSequence
    except ImportError as error:
        raise MissingDependencyError(f"tokenization needs tokenizers: {INSTALL_HINT}") from error
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    _apply_tokenizer_config(tokenizer, model_dir)
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


_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def special_token_ids(tokenizer: Tokenizer, model_dir: Path) -> set[int]:
    """Ids of the special tokens, as the Hugging Face tokenizer knows them: the special added
    tokens of ``tokenizer.json`` and the tokens ``tokenizer_config.json`` names (``cls_token``,
    ``sep_token``, ..., ``additional_special_tokens``)."""
    ids = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    path = model_dir / "tokenizer_config.json"
    config: Any = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            config = {}  # load_tokenizer reports a broken file
    if not isinstance(config, dict):
        return ids
    names: list[Any] = [config.get(key) for key in _SPECIAL_TOKEN_KEYS]
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        names.extend(extra)
    for name in names:
        if isinstance(name, dict):  # an AddedToken written out
            name = name.get("content")
        if isinstance(name, str):
            token_id = tokenizer.token_to_id(name)
            if token_id is not None:
                ids.add(token_id)
    return ids


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode, or ``None``. A Python ``str`` may hold lone
    surrogates (JSON's ``\\ud800`` escapes decode to them, and so does argv that is not UTF-8);
    no UTF-8 text can carry them, and ``tokenizers`` refuses them with a bare ``TypeError``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"{error.reason} at position {error.start}"
    return None


def check_unicode(named: Iterable[tuple[str, str]]) -> None:
    """Raises :class:`ferrograph.InvalidArgumentError` naming the first ``(name, text)`` whose
    text is not valid Unicode (see :func:`unicode_problem`); callers use it to explain a
    tokenizer's ``TypeError``."""
    import ferrograph as fg

    for name, text in named:
        problem = unicode_problem(text)
        if problem is not None:
            raise fg.InvalidArgumentError(f"{name} is not valid Unicode text ({problem})")


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
    longest = max(len(e) for e in encodings)
    seq = longest if length is None else length
    if seq < longest:
        raise ValueError(f"cannot pad {longest} tokens to {seq}")
    n = len(encodings)
    if n == 1 and seq == longest:
        # One sentence, nothing to pad (a query): one numpy call, three row views.
        e = encodings[0]
        rows = np.array([e.ids, e.type_ids, [1] * seq], np.int32)
        return Batch(rows[0:1], rows[1:2], rows[2:3])
    ids = np.zeros((n, seq), np.int32)
    types = np.zeros((n, seq), np.int32)
    mask = np.zeros((n, seq), np.int32)
    for i, e in enumerate(encodings):
        k = len(e)
        ids[i, :k] = e.ids
        types[i, :k] = e.type_ids
        mask[i, :k] = 1
    return Batch(ids, types, mask)


def tokenize(tokenizer: Tokenizer, sentences: Sequence[str]) -> Batch:
    """Tokenizes ``sentences`` with a tokenizer from :func:`load_tokenizer` and pads them to
    the longest."""
    texts = list(sentences)
    try:
        encodings = tokenizer.encode_batch(texts)
    except TypeError:
        check_unicode((f"sentence {i}", text) for i, text in enumerate(texts))
        raise
    return pad(encodings)
