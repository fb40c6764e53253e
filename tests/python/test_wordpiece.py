"""The ASCII fast path of BERT's WordPiece tokenizer (ferrograph.models.wordpiece) against the
``tokenizers`` library it stands in for: the same ids on fuzzed text, for every pipeline it
accepts (lowercasing or not, a template or BertProcessing, truncation or none), ``None`` for text
outside its class, and no fast path at all for pipelines it does not reproduce."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers"
)

from ferrograph import _core  # noqa: E402
from ferrograph.models.wordpiece import FastWordPiece  # noqa: E402

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_WORDS = ["the", "cat", "sat", "on", "mat", "run", "##s", "##ing", "##ed", "hello", "Hello", "##o"]
_CHARS = list("abcdefghijklmnopqrstuvwxyzABC0123456789.,!?'-#$~")
VOCAB = _SPECIALS + _WORDS + _CHARS + ["##" + c for c in _CHARS if c.isalnum()]


def _tokenizer(
    lowercase: bool = True,
    bert_processing: bool = False,
    truncation: int | None = None,
    clean_text: bool = True,
) -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(VOCAB)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=12))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=clean_text, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if bert_processing:
        tok.post_processor = processors.BertProcessing(
            ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0",
            pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
    tok.add_special_tokens(_SPECIALS)
    if truncation is not None:
        tok.enable_truncation(truncation)
    return tok


def _texts(rng: random.Random, vocab: list[str], count: int) -> list[str]:
    """ASCII text of every kind the fast path takes: vocabulary words (pieces glued
    together), unknown runs, long words around the per-word limit, punctuation, every control
    character, and separators of several kinds."""
    out = []
    alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = [w for w in vocab if w.isascii() and "[" not in w]
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 30)):
            r = rng.random()
            if r < 0.35:
                parts.append(rng.choice(words).replace("##", ""))
            elif r < 0.5:
                parts.append("".join(rng.choice(alnum) for _ in range(rng.randint(1, 20))))
            elif r < 0.7:
                # any ASCII but "[" (which starts the added tokens: the library's case)
                parts.append(
                    "".join(
                        chr(c)
                        for c in (rng.randint(0, 127) for _ in range(rng.randint(1, 6)))
                        if c != ord("[")
                    )
                )
            elif r < 0.75:
                parts.append(rng.choice("aZ9") * rng.randint(10, 14))  # around the word limit
            else:
                parts.append(rng.choice([" ", "\t", "\n", "\r", "\x0b", "\x0c", "\x7f", "\x00"]))
        out.append(rng.choice(["", " ", "  ", "\n", "\x01"]).join(parts))
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"lowercase": False},
        {"bert_processing": True},
        {"truncation": 6},
        {"truncation": 3, "lowercase": False},
    ],
)
def test_the_fast_path_gives_the_library_ids(settings: dict[str, Any]) -> None:
    tok = _tokenizer(**settings)
    fast = FastWordPiece.from_tokenizer(tok)
    assert fast is not None, settings
    rng = random.Random(7)
    taken = 0
    for text in [*_texts(rng, VOCAB, 3000), "", " ", "Hello, World!", "x" * 13, "x" * 12]:
        got = fast.encode(text)
        assert got is not None, repr(text)
        taken += 1
        want = tok.encode(text)
        assert got.ids == want.ids, (repr(text), settings)
        assert got.type_ids == want.type_ids
        assert len(got) == len(want)
    assert taken > 3000


def test_long_unknown_words_take_bounded_work_and_the_library_ids() -> None:
    # A tokenizer that allows long words: the greedy split never looks up a piece longer than
    # the longest vocabulary entry (the same result, with work linear in the word's length).
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(VOCAB)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=2000))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
    )
    fast = FastWordPiece.from_tokenizer(tok)
    assert fast is not None
    for text in ["ab" * 300, "hello" * 100 + "z", "a" * 1999, "the" + "x" * 700 + "sat"]:
        got = fast.encode(text)
        assert got is not None and got.ids == tok.encode(text).ids, text[:20]
    # far past the word limit: one unknown token, at once
    assert fast.encode("q" * 500_000) is not None


def test_text_outside_the_class_goes_to_the_library() -> None:
    fast = FastWordPiece.from_tokenizer(_tokenizer())
    assert fast is not None
    for text in ["café", "naïve words", "日本", "a [MASK] b", "[CLS]", "x[y", "\u00a0", "a\ud800"]:
        assert fast.encode(text) is None, text
    assert fast.encode("a" * (1 << 20 + 1)) is None  # over the native side's bound


def test_pipelines_it_does_not_reproduce_get_no_fast_path() -> None:
    from tokenizers import normalizers, pre_tokenizers, processors

    assert FastWordPiece.from_tokenizer(_tokenizer(clean_text=False)) is None
    tok = _tokenizer()
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.NFD()])
    assert FastWordPiece.from_tokenizer(tok) is None
    tok = _tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert FastWordPiece.from_tokenizer(tok) is None
    tok = _tokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:1 [SEP]:0", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    assert FastWordPiece.from_tokenizer(tok) is None
    tok = _tokenizer()
    tok.enable_padding()
    assert FastWordPiece.from_tokenizer(tok) is None
    tok = _tokenizer()
    tok.enable_truncation(8, direction="left")
    assert FastWordPiece.from_tokenizer(tok) is None
    tok = _tokenizer()
    tok.enable_truncation(2)  # no room for a piece
    assert FastWordPiece.from_tokenizer(tok) is None
    tok = _tokenizer()
    tok.add_tokens(["élan"])  # an added token starting outside ASCII
    assert FastWordPiece.from_tokenizer(tok) is None
    assert FastWordPiece.from_tokenizer(object()) is None


def test_an_added_token_sends_its_text_to_the_library() -> None:
    tok = _tokenizer()
    tok.add_tokens(["xyz"])  # normalized: matched after lowercasing
    fast = FastWordPiece.from_tokenizer(tok)
    assert fast is not None
    for text in ["an xyz here", "an XYZ here", "a Xylophone"]:
        assert fast.encode(text) is None
    assert fast.encode("hello") is not None


def test_the_native_class_checks_its_triggers() -> None:
    with pytest.raises(Exception, match="ASCII"):
        _core.WordPieceAscii(
            {"[UNK]": 0},
            prefix="##",
            unk_id=0,
            cls_id=0,
            sep_id=0,
            max_word_chars=10,
            lowercase=True,
            max_pieces=None,
            triggers="é",
        )


def test_the_packaged_minilm_vocabulary() -> None:
    minilm = pytest.importorskip("ferrograph.models.minilm")
    try:
        model_dir = minilm.find_model_dir()
    except Exception:
        pytest.skip("the MiniLM package is not installed")
    from ferrograph.models.tokenization import load_tokenizer

    tok = load_tokenizer(model_dir, 256)
    fast = FastWordPiece.from_tokenizer(tok)
    assert fast is not None
    vocab = list(tok.get_vocab())
    texts = _texts(random.Random(3), vocab, 1500)
    texts += ["A man is eating food.", "It's 3:45pm -- don't be late!!", "x" * 101, "x" * 100]
    for text in texts:
        got = fast.encode(text)
        assert got is not None and got.ids == tok.encode(text).ids, repr(text)


def test_a_sentence_that_is_not_unicode_is_named(tmp_path: Any) -> None:
    minilm = pytest.importorskip("ferrograph.models.minilm")
    try:
        model_dir = minilm.find_model_dir()
    except Exception:
        pytest.skip("the MiniLM package is not installed")
    import ferrograph as fg

    enc = fg.models.SentenceEncoder(model_dir, n_threads=1)
    for batch in (["a\ud800"], ["fine", "x\udfff y"]):
        with pytest.raises(fg.InvalidArgumentError, match="not valid Unicode"):
            enc.encode(batch)
    with pytest.raises(fg.InvalidArgumentError, match="sentence 1 is not valid Unicode"):
        enc.tokenize(["fine", "y\ud800"])
    with pytest.raises(fg.InvalidArgumentError, match="prompt is not valid Unicode"):
        enc.prompt_length("q\udc80: ")
    with pytest.raises(fg.InvalidArgumentError, match="not valid Unicode"):
        enc.encode(["fine"], prompt="q\udc80: ")
    assert enc.encode("still fine").shape == (enc.dim,)
