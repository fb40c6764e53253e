"""SentenceEncoder (python/ferrograph/models) on BERT models of several shapes made here.

Each model directory is written the way sentence-transformers writes one (random weights as
``model.safetensors``, ``config.json``, a WordPiece ``tokenizer.json``, ``tokenizer_config.json``,
``modules.json``, ``sentence_bert_config.json``, the Pooling config), in the 2-5 layout or the 6.x
layout. Without PyTorch the vectors are checked against the package's float64 numpy reference
(:mod:`ferrograph.models.reference`), one unpadded sentence at a time. When sentence-transformers
can be run (importable here, or an interpreter named by ``FERROGRAPH_ST_PYTHON``) the same
directories are loaded by sentence-transformers and compared with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferrograph as fg

_MISSING = [n for n in ("tokenizers", "safetensors") if importlib.util.find_spec(n) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"the sentence encoder needs {', '.join(_MISSING)}"
)

from ferrograph.models import (  # noqa: E402  (the imports themselves need neither)
    GRAPH_CACHE_SIZE,
    ModelNotFoundError,
    PoolingConfig,
    SentenceEncoder,
    UnsupportedModelError,
    read_settings,
)
from ferrograph.models.reference import numpy_encode  # noqa: E402
from ferrograph.models.weights import load_dense_state, load_state_dict  # noqa: E402

# ----------------------------------------------------------------------------------------------
# building model directories
# ----------------------------------------------------------------------------------------------

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-") + list(
    "абвгдежзийклмнопрстуфхцчшщыьэюяαβγδεζηθικλμνξοπρστυφχψω我喜欢在周末阅读书籍和喝茶東京は日本の首都です"
)
_WORDS = ["the", "cat", "dog", "sat", "on", "mat", "runs", "fast", "##s", "##ing", "##ed", "hello"]
VOCAB = _SPECIALS + _WORDS + _CHARS + ["##" + c for c in _CHARS]
SENTENCES = [
    "Hello!",
    "The cat sat on the mat.",
    "",
    "   ",
    "the dogs running fast, the cats sitting",
    "Быстрая лиса прыгает.",
    "Γειά σου κόσμε",
    "我喜欢在周末阅读书籍和喝茶。",
    "東京は日本の首都です。",
    "a b c",
    " ".join(["the cat sat on the mat"] * 12),  # longer than every model's truncation
    "word " * 40,
]


@dataclass
class Spec:
    """A model directory to write."""

    layout: str = "v6"  # "v2": sentence-transformers 2-5 files; "v6": 6.x files
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    inter: int = 64
    act: str = "gelu"
    modes: tuple[str, ...] = ("mean",)
    normalize: bool = True
    max_pos: int = 64
    type_vocab: int = 2
    eps: float = 1e-12
    seed: int = 0
    max_seq_length: int | None = None  # sentence_bert_config.json
    model_max_length: int | None = 20  # tokenizer_config.json
    tokenizer_truncation: int | None = None  # tokenizer.json's own (ignored by s-t)
    bert_prefix: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)
    json_lowercase: bool = True  # tokenizer.json's BertNormalizer
    tokenizer_config: dict[str, Any] = field(default_factory=dict)  # None values remove a key
    sbert_lower_case: bool | None = None  # sentence_bert_config.json do_lower_case
    # Dense modules after the pooling: (out_features, torch activation class, bias, residual)
    dense: tuple[tuple[int, str, bool, bool], ...] = ()
    transformer_path: str = ""  # the Transformer module's folder ("0_Transformer" before s-t 2)
    prompts: dict[str, str] | None = None  # config_sentence_transformers.json
    default_prompt: str | None = None
    include_prompt: bool = True  # Pooling config


def _write_tokenizer(path: Path, spec: Spec) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(VOCAB)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=None,
        lowercase=spec.json_lowercase,
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(_SPECIALS)  # as Hugging Face's files list them (ids unchanged)
    if spec.tokenizer_truncation is not None:
        tok.enable_truncation(spec.tokenizer_truncation)
    tok.save(str(path / "tokenizer.json"))
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    config: dict[str, Any] = {
        "cls_token": "[CLS]",
        "do_lower_case": True,
        "mask_token": "[MASK]",
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "tokenizer_class": "BertTokenizer",
        "unk_token": "[UNK]",
    }
    if spec.model_max_length is not None:
        config["model_max_length"] = spec.model_max_length
    for key, value in spec.tokenizer_config.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _write_weights(path: Path, spec: Spec) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(spec.seed)
    h, inner = spec.hidden, spec.inter

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def vec(n: int, scale: float = 0.1, center: float = 0.0) -> np.ndarray:
        return (center + scale * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": mat(len(VOCAB), h) * 4,
        "embeddings.position_embeddings.weight": mat(spec.max_pos, h) * 2,
        "embeddings.LayerNorm.weight": vec(h, 0.2, 1.0),
        "embeddings.LayerNorm.bias": vec(h),
        "embeddings.position_ids": np.arange(spec.max_pos, dtype=np.int64)[None],
    }
    t["embeddings.token_type_embeddings.weight"] = mat(spec.type_vocab, h)
    for i in range(spec.layers):
        p = f"encoder.layer.{i}."
        for name, (rows, cols) in {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (inner, h),
            "output.dense": (h, inner),
        }.items():
            t[p + name + ".weight"] = mat(rows, cols) * (2.0 if "query" in name else 1.0)
            t[p + name + ".bias"] = vec(rows)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + norm + ".weight"] = vec(h, 0.2, 1.0)
            t[p + norm + ".bias"] = vec(h)
    t["pooler.dense.weight"] = mat(h, h)  # BERT's pooler: present in files, never used
    t["pooler.dense.bias"] = vec(h)
    if spec.bert_prefix:
        t = {"bert." + k: v for k, v in t.items()}
    save_file(t, str(path / "model.safetensors"))


def _write_dense_weights(
    folder: Path, width_in: int, width_out: int, bias: bool, residual: bool, seed: int
) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    t = {"linear.weight": (rng.standard_normal((width_out, width_in)) / np.sqrt(width_in))}
    if bias:
        t["linear.bias"] = 0.1 * rng.standard_normal(width_out)
    if residual and width_in != width_out:
        t["residual.weight"] = rng.standard_normal((width_out, width_in)) / np.sqrt(width_in)
    save_file({k: v.astype(np.float32) for k, v in t.items()}, str(folder / "model.safetensors"))


def write_model(path: Path, spec: Spec) -> Path:
    """Writes a sentence-transformers model directory for ``spec``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    transformer = path / spec.transformer_path
    transformer.mkdir(exist_ok=True)
    config = {
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": spec.act,
        "hidden_dropout_prob": 0.1,
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.inter,
        "layer_norm_eps": spec.eps,
        "max_position_embeddings": spec.max_pos,
        "model_type": "bert",
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "type_vocab_size": spec.type_vocab,
        "vocab_size": len(VOCAB),
        **spec.extra_config,
    }
    (transformer / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _write_tokenizer(transformer, spec)
    _write_weights(transformer, spec)
    v6 = spec.layout == "v6"
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": spec.transformer_path,
            "type": "sentence_transformers.base.modules.transformer.Transformer"
            if v6
            else "sentence_transformers.models.Transformer",
        },
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
            if v6
            else "sentence_transformers.models.Pooling",
        },
    ]
    width = spec.hidden * len(spec.modes)
    for out_features, act, bias, residual in spec.dense:
        k = len(modules)
        folder = path / f"{k}_Dense"
        folder.mkdir(exist_ok=True)
        dense_config: dict[str, Any] = {
            "in_features": width,
            "out_features": out_features,
            "bias": bias,
            "activation_function": act,
        }
        if residual:
            dense_config["use_residual"] = True
        (folder / "config.json").write_text(json.dumps(dense_config), "utf-8")
        _write_dense_weights(folder, width, out_features, bias, residual, spec.seed + k)
        kind = "base.modules.dense.Dense" if v6 else "models.Dense"
        modules.append(
            {"idx": k, "name": str(k), "path": folder.name, "type": f"sentence_transformers.{kind}"}
        )
        width = out_features
    if spec.normalize:
        k = len(modules)
        modules.append(
            {
                "idx": k,
                "name": str(k),
                "path": f"{k}_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize"
                if v6
                else "sentence_transformers.models.Normalize",
            }
        )
        (path / f"{k}_Normalize").mkdir(exist_ok=True)
        if v6:
            (path / f"{k}_Normalize" / "config.json").write_text(
                json.dumps(
                    {
                        "module_input_name": "sentence_embedding",
                        "module_output_name": "sentence_embedding",
                    }
                ),
                encoding="utf-8",
            )
    (path / "modules.json").write_text(json.dumps(modules, indent=2), encoding="utf-8")
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling: dict[str, Any]
    sbert: dict[str, Any]
    if v6:
        mode: Any = spec.modes[0] if len(spec.modes) == 1 else list(spec.modes)
        pooling = {
            "embedding_dimension": spec.hidden,
            "pooling_mode": mode,
            "include_prompt": spec.include_prompt,
        }
        sbert = {
            "transformer_task": "feature-extraction",
            "modality_config": {
                "text": {"method": "forward", "method_output_name": "last_hidden_state"}
            },
            "module_output_name": "token_embeddings",
        }
        st_version = "6.2.0"
    else:
        flags = {
            "pooling_mode_cls_token": "cls",
            "pooling_mode_mean_tokens": "mean",
            "pooling_mode_max_tokens": "max",
            "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens": "weightedmean",
            "pooling_mode_lasttoken": "lasttoken",
        }
        pooling = {"word_embedding_dimension": spec.hidden}
        pooling.update({flag: mode in spec.modes for flag, mode in flags.items()})
        pooling["include_prompt"] = spec.include_prompt
        sbert = {"do_lower_case": False}
        st_version = "2.2.2"
    if spec.max_seq_length is not None:
        sbert["max_seq_length"] = spec.max_seq_length
    if spec.sbert_lower_case is not None:
        sbert["do_lower_case"] = spec.sbert_lower_case
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2), "utf-8")
    (transformer / "sentence_bert_config.json").write_text(json.dumps(sbert, indent=2), "utf-8")
    st_config: dict[str, Any] = {"__version__": {"sentence_transformers": st_version}}
    if v6:
        st_config.update(
            {
                "model_type": "SentenceTransformer",
                "default_prompt_name": None,
                "prompts": {"query": "", "document": ""},
                "similarity_fn_name": "cosine",
            }
        )
    if spec.prompts is not None:
        st_config["prompts"] = spec.prompts
        st_config["default_prompt_name"] = spec.default_prompt
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config), "utf-8")
    return path


# The shapes and settings the encoder is checked on; ids name them in test output.
SPECS: dict[str, Spec] = {
    "v2-gelu-mean-norm": Spec(layout="v2", max_seq_length=24, model_max_length=512),
    "v6-gelu_new-cls": Spec(
        hidden=48, heads=3, layers=1, inter=96, act="gelu_new", modes=("cls",), normalize=False
    ),
    "v6-relu-max-norm": Spec(hidden=64, heads=8, layers=3, inter=128, act="relu", modes=("max",)),
    "v2-meansqrt": Spec(
        layout="v2", modes=("mean_sqrt_len_tokens",), normalize=False, max_seq_length=16
    ),
    "v6-weightedmean-eps": Spec(modes=("weightedmean",), eps=1e-5, seed=3, type_vocab=1),
    "v6-lasttoken-2heads": Spec(modes=("lasttoken",), seed=4, heads=2, type_vocab=3),
    "v6-mean+max+cls": Spec(modes=("mean", "max", "cls"), seed=5, act="gelu_new"),
    "v2-cls+max+mean-flags": Spec(
        layout="v2", modes=("cls", "max", "mean"), seed=6, max_seq_length=30, act="relu"
    ),
    "v6-prefixed-truncation": Spec(
        seed=7, bert_prefix=True, tokenizer_truncation=8, model_max_length=None, max_pos=28
    ),
    # text normalisation: tokenizer_config.json's BERT settings beat tokenizer.json's normalizer
    "v6-cased-by-config": Spec(layers=1, seed=8, tokenizer_config={"do_lower_case": False}),
    "v6-uncased-by-default": Spec(
        layers=1, seed=9, json_lowercase=False, tokenizer_config={"do_lower_case": None}
    ),
    "v6-strip-accents-cased": Spec(
        layers=1, seed=10, tokenizer_config={"do_lower_case": False, "strip_accents": True}
    ),
    "v2-sbert-lower-case": Spec(
        layout="v2",
        layers=1,
        seed=11,
        json_lowercase=False,
        tokenizer_config={"do_lower_case": False},
        sbert_lower_case=True,
    ),
    # Dense heads (LaBSE-like CLS + Dense(tanh) + Normalize; stacks with residuals)
    "v6-cls-dense-tanh-norm": Spec(
        layers=1,
        seed=13,
        modes=("cls",),
        dense=((24, "torch.nn.modules.activation.Tanh", True, False),),
    ),
    "v2-dense-stack": Spec(
        layout="v2",
        layers=1,
        seed=14,
        normalize=False,
        modes=("mean", "max"),
        dense=(
            (40, "torch.nn.modules.linear.Identity", False, False),
            (16, "torch.nn.modules.activation.ReLU", True, True),
            (16, "torch.nn.modules.activation.GELU", True, True),
            (12, "torch.nn.modules.activation.Sigmoid", True, False),
            (12, "torch.nn.modules.activation.SiLU", False, True),
        ),
    ),
    "v2-transformer-subfolder": Spec(
        layout="v2", layers=1, seed=15, max_seq_length=12, transformer_path="0_Transformer"
    ),
    # prompts: the default one prepended; left out of the pooling or not
    "v6-prompt-left-out": Spec(
        layers=1,
        seed=16,
        modes=("mean", "cls", "max", "weightedmean", "lasttoken"),
        prompts={"query": "query: ", "passage": "the passage: "},
        default_prompt="query",
        include_prompt=False,
    ),
    "v2-prompt-pooled": Spec(
        layout="v2",
        layers=1,
        seed=17,
        prompts={"query": "search query: "},
        default_prompt="query",
        max_seq_length=24,
    ),
    "v6-generic-fast-tokenizer": Spec(
        layers=1,
        seed=12,
        json_lowercase=False,
        tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast"},
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert_models")
    return {name: write_model(root / name, spec) for name, spec in SPECS.items()}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))


def reference_vectors(
    model: SentenceEncoder, sentences: Sequence[str], prompt: str | None = None
) -> np.ndarray:
    """The float64 numpy reference, one unpadded sentence at a time, with ``prompt`` (the
    model's default prompt when ``None``) prepended."""
    settings = model.settings
    state = load_state_dict(settings.transformer_dir, model.config)
    state.update(load_dense_state(settings.dense))
    if prompt is None and settings.default_prompt_name is not None:
        prompt = settings.prompts[settings.default_prompt_name]
    prompt_length = 0
    if prompt and not settings.pooling.include_prompt:
        ids = model.tokenizer.encode(prompt).ids
        prompt_length = len(ids) - (ids[-1] == VOCAB.index("[SEP]"))
    rows = [
        numpy_encode(
            state,
            model.config,
            model.tokenize([(prompt or "") + s]),
            settings.pooling,
            model.normalize,
            settings.dense,
            prompt_length,
        )[0]
        for s in sentences
    ]
    return np.stack(rows)


# ----------------------------------------------------------------------------------------------
# settings
# ----------------------------------------------------------------------------------------------


def test_settings_of_both_layouts(model_dirs: dict[str, Path]) -> None:
    s = read_settings(model_dirs["v2-gelu-mean-norm"])
    assert s.modules == ("Transformer", "Pooling", "Normalize")
    assert s.pooling.modes == ("mean",) and s.normalize
    assert s.max_seq_length == 24  # sentence_bert_config beats tokenizer_config (512)
    assert s.bert.hidden_act == "gelu" and s.bert.activation == "gelu_erf"
    s = read_settings(model_dirs["v6-gelu_new-cls"])
    assert s.modules == ("Transformer", "Pooling") and not s.normalize
    assert s.pooling.modes == ("cls",)
    assert s.max_seq_length == 20  # no max_seq_length: tokenizer_config's model_max_length
    assert s.bert.activation == "gelu_tanh"
    flags = read_settings(model_dirs["v2-cls+max+mean-flags"])
    assert flags.pooling.modes == ("cls", "max", "mean")
    assert read_settings(model_dirs["v6-mean+max+cls"]).pooling.modes == ("mean", "max", "cls")
    assert read_settings(model_dirs["v6-mean+max+cls"]).dim == 3 * 32
    # no model_max_length anywhere: the position table (28), not tokenizer.json's 8
    assert read_settings(model_dirs["v6-prefixed-truncation"]).max_seq_length == 28


def test_max_seq_length_precedence(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", Spec(model_max_length=1000, max_pos=40))
    assert read_settings(path).max_seq_length == 40  # capped at max_position_embeddings
    sbert = path / "sentence_bert_config.json"
    raw = json.loads(sbert.read_text())
    raw["max_seq_length"] = 12
    sbert.write_text(json.dumps(raw))
    assert read_settings(path).max_seq_length == 12
    raw["processor_kwargs"] = {"model_max_length": 9}
    sbert.write_text(json.dumps(raw))
    assert read_settings(path).max_seq_length == 9
    raw.pop("processor_kwargs")
    raw["tokenizer_args"] = {"model_max_length": 7}  # the 2-5 name
    sbert.write_text(json.dumps(raw))
    assert read_settings(path).max_seq_length == 7


def test_pooling_config_layouts(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"word_embedding_dimension": 8}))
    assert PoolingConfig.from_file(path, 8).modes == ("mean",)  # no flag set: mean
    path.write_text(json.dumps({"pooling_mode_lasttoken": True, "pooling_mode_cls_token": True}))
    assert PoolingConfig.from_file(path, 8).modes == ("cls", "lasttoken")
    path.write_text(json.dumps({"pooling_mode": ["max", "cls"], "pooling_mode_mean_tokens": True}))
    assert PoolingConfig.from_file(path, 8).modes == ("max", "cls")  # pooling_mode wins
    path.write_text(json.dumps({"pooling_mode": "weightedmean", "include_prompt": False}))
    config = PoolingConfig.from_file(path, 8)
    assert config.modes == ("weightedmean",) and not config.include_prompt


def _edit_json(path: Path, **changes: Any) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("file", "changes", "named"),
    [
        ("config.json", {"model_type": "roberta"}, "model_type"),
        ("config.json", {"hidden_act": "tanh"}, "hidden_act"),
        ("config.json", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ("config.json", {"num_attention_heads": 5}, "num_attention_heads"),
        ("config.json", {"is_decoder": True}, "is_decoder"),
        ("config.json", {"hidden_size": 33}, "hidden_size"),
        ("config.json", {"vocab_size": -3}, "vocab_size"),
        ("config.json", {"type_vocab_size": 0}, "type_vocab_size"),
        ("1_Pooling/config.json", {"pooling_mode": "median"}, "median"),
        ("1_Pooling/config.json", {"embedding_dimension": 16}, "dimension"),
        ("sentence_bert_config.json", {"transformer_task": "fill-mask"}, "transformer_task"),
        ("sentence_bert_config.json", {"config_kwargs": {"hidden_act": "relu"}}, "config_kwargs"),
        ("sentence_bert_config.json", {"query_expansion": {"length": 4}}, "query_expansion"),
        ("sentence_bert_config.json", {"max_seq_length": 1}, "max_seq_length"),
        ("config_sentence_transformers.json", {"default_prompt_name": "nope"}, "prompt"),
        ("config_sentence_transformers.json", {"prompts": {"q": 3}}, "prompt"),
        ("config_sentence_transformers.json", {"model_type": "SparseEncoder"}, "model_type"),
        ("tokenizer_config.json", {"tokenizer_class": "XLMRobertaTokenizer"}, "tokenizer_class"),
        ("tokenizer_config.json", {"do_lower_case": "yes"}, "do_lower_case"),
    ],
)
def test_unsupported_settings_are_named(
    tmp_path: Path, file: str, changes: dict[str, Any], named: str
) -> None:
    path = write_model(tmp_path / "m", Spec(layers=1))
    _edit_json(path / file, **changes)
    with pytest.raises(UnsupportedModelError, match=named) as info:
        SentenceEncoder(path)
    assert isinstance(info.value, fg.Error) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("module_type", "named"),
    [
        ("sentence_transformers.models.WordWeights", "WordWeights"),
        ("sentence_transformers.models.Normalize", "Normalize"),  # twice
        ("sentence_transformers.sentence_transformer.modules.layer_norm.LayerNorm", "LayerNorm"),
        ("my_package.CustomPooling", "CustomPooling"),
    ],
)
def test_unsupported_modules_are_named(tmp_path: Path, module_type: str, named: str) -> None:
    path = write_model(tmp_path / "m", Spec(layers=1))
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "x", "path": "2_X", "type": module_type})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match=named):
        read_settings(path)


def test_text_normalisation_follows_the_tokenizer_class(model_dirs: dict[str, Path]) -> None:
    def tokens(name: str, text: str) -> list[int]:
        return SentenceEncoder(model_dirs[name]).tokenize([text]).input_ids[0].tolist()

    unk, hello = VOCAB.index("[UNK]"), VOCAB.index("hello")
    assert tokens("v6-gelu_new-cls", "HELLO")[1] == hello  # uncased
    assert tokens("v6-cased-by-config", "HELLO")[1] == unk  # tokenizer_config says cased
    assert tokens("v6-uncased-by-default", "HELLO")[1] == hello  # BERT's default: uncased
    assert tokens("v2-sbert-lower-case", "HELLO")[1] == hello  # sentence_bert_config lowers
    assert tokens("v6-generic-fast-tokenizer", "HELLO")[1] == unk  # tokenizer.json as it is
    accented = tokens("v6-strip-accents-cased", "ά")[1]
    assert accented == VOCAB.index("α")  # accents stripped although cased
    assert tokens("v6-cased-by-config", "ά")[1] == unk


def test_dense_settings(tmp_path: Path) -> None:
    tanh = "torch.nn.modules.activation.Tanh"
    path = write_model(tmp_path / "m", Spec(layers=1, dense=((8, tanh, True, False),)))
    settings = read_settings(path)
    assert settings.modules == ("Transformer", "Pooling", "Dense", "Normalize")
    assert settings.dim == 8 and settings.pooled_dim == 32
    assert settings.dense[0].activation == "tanh" and settings.dense[0].bias
    config = path / "2_Dense" / "config.json"
    _edit_json(config, activation_function="my_package.Swish")
    with pytest.raises(UnsupportedModelError, match="activation_function"):
        read_settings(path)
    _edit_json(config, activation_function=tanh, in_features=31)
    with pytest.raises(UnsupportedModelError, match="in_features"):
        read_settings(path)
    _edit_json(config, in_features=32, module_input_name="token_embeddings")
    with pytest.raises(UnsupportedModelError, match="module_input_name"):
        read_settings(path)
    _edit_json(config, module_input_name="sentence_embedding", out_features=9)
    with pytest.raises(UnsupportedModelError, match=r"linear\.weight has shape"):
        SentenceEncoder(path)
    modules = json.loads((path / "modules.json").read_text())
    modules[2], modules[3] = modules[3], modules[2]  # Dense after Normalize
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="'Dense'"):
        read_settings(path)


def test_prompts(model_dirs: dict[str, Path]) -> None:
    model = SentenceEncoder(model_dirs["v6-prompt-left-out"])
    assert model.prompts == {"query": "query: ", "passage": "the passage: "}
    # [CLS] q ##u ##e ##r ##y : -- the trailing [SEP] is not counted
    assert model.prompt_length("query: ") == 7
    default = model.encode(SENTENCES[:6])
    np.testing.assert_allclose(default, model.encode(SENTENCES[:6], prompt_name="query"))
    np.testing.assert_allclose(default, model.encode(SENTENCES[:6], prompt="query: "))
    assert cosines(default, model.encode(SENTENCES[:6], prompt="")).min() < 0.9999
    passage = model.encode(SENTENCES[:6], prompt_name="passage")
    expected = reference_vectors(model, SENTENCES[:6], "the passage: ")
    np.testing.assert_allclose(passage, expected, atol=2e-5)
    with pytest.raises(fg.InvalidArgumentError, match="prompt_name"):
        model.encode("x", prompt_name="nope")
    # truncation cutting into the prompt: the prompt's length is counted truncated too, so
    # only the final [SEP] is pooled
    model.max_seq_length = 7
    assert model.prompt_length("query: ") == 6
    np.testing.assert_allclose(
        model.encode(["a b c"]), reference_vectors(model, ["a b c"], "query: "), atol=2e-5
    )


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        SentenceEncoder(tmp_path / "nowhere")
    path = write_model(tmp_path / "m", Spec(layers=1))
    (path / "modules.json").write_text("[{")
    with pytest.raises(UnsupportedModelError, match="JSON"):
        read_settings(path)
    (path / "modules.json").write_text(
        '[{"type": "sentence_transformers.models.Transformer", "path": "../.."}]'
    )
    with pytest.raises(UnsupportedModelError, match="leaves"):
        read_settings(path)
    (path / "modules.json").unlink()  # a plain Hugging Face directory: mean pooling
    settings = read_settings(path)
    assert settings.pooling.modes == ("mean",) and not settings.normalize

    from safetensors.numpy import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    weights["encoder.layer.0.output.dense.weight"] = weights["encoder.layer.0.output.dense.weight"][
        :, :5
    ]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"output\.dense\.weight has shape"):
        SentenceEncoder(path)
    del weights["encoder.layer.0.output.dense.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="lacks"):
        SentenceEncoder(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"model\.safetensors"):
        SentenceEncoder(path)


# ----------------------------------------------------------------------------------------------
# vectors against the float64 numpy reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_vectors_match_numpy_reference(model_dirs: dict[str, Path], name: str) -> None:
    spec = SPECS[name]
    model = SentenceEncoder(model_dirs[name], n_threads=2)
    got = model.encode(SENTENCES, batch_size=5)
    dim = spec.dense[-1][0] if spec.dense else spec.hidden * len(spec.modes)
    assert got.shape == (len(SENTENCES), dim)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    expected = reference_vectors(model, SENTENCES)
    cos = cosines(got, expected)
    worst = int(np.argmin(cos))
    assert cos.min() >= 0.99999, f"{name}: cosine {cos[worst]:.7f} for {SENTENCES[worst]!r}"
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, atol=5e-5 * scale, rtol=1e-4)
    norms = np.linalg.norm(got, axis=1)
    if spec.normalize:
        np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    else:
        assert np.abs(norms - 1.0).max() > 1e-3  # really not normalised
    # the long sentences were truncated at the model's length
    lengths = model.tokenize(SENTENCES).lengths
    assert lengths.max() == model.max_seq_length


def test_max_pooling_is_the_maximum_over_real_tokens(model_dirs: dict[str, Path]) -> None:
    # odd and even lengths, padding inside a batch: the halving tree must see every token
    model = SentenceEncoder(model_dirs["v6-relu-max-norm"], bucket_lengths=False)
    sentences = ["a", "a b", "a b c", "a b c d e", "the cat sat on the mat " * 3]
    got = model.encode(sentences, batch_size=5)
    np.testing.assert_allclose(got, reference_vectors(model, sentences), atol=2e-5)


def test_attention_variants_and_dtypes(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["v6-relu-max-norm"]  # hidden 64: q8_0 applies to every matrix
    base = SentenceEncoder(path, attention="soft_max", fuse_qkv=False).encode(
        SENTENCES, batch_size=4
    )
    flash = SentenceEncoder(path, attention="flash")  # the default: fused QKV
    assert "encoder.layer.0.attention.self.qkv.weight" in flash.weights
    fused = flash.encode(SENTENCES, batch_size=4)
    np.testing.assert_allclose(fused, base, atol=2e-5)
    # one product over the concatenated weights computes each element as the three did
    separate = SentenceEncoder(path, attention="flash", fuse_qkv=False)
    assert "encoder.layer.0.attention.self.query.weight" in separate.weights
    np.testing.assert_array_equal(separate.encode(SENTENCES, batch_size=4), fused)
    for dtype, limit in (("f16", 0.999), ("bf16", 0.99), ("q8_0", 0.99)):
        model = SentenceEncoder(path, weights_dtype=dtype)
        assert model.weights["encoder.layer.0.intermediate.dense.weight"].dtype == fg.DType(dtype)
        assert cosines(model.encode(SENTENCES, batch_size=4), base).min() >= limit, dtype
    with pytest.raises(fg.InvalidArgumentError, match="weights_dtype"):
        SentenceEncoder(path, weights_dtype="q4_1")
    with pytest.raises(fg.InvalidArgumentError, match="attention"):
        SentenceEncoder(path, attention="sparse")


def test_threads_give_the_same_vectors(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["v2-gelu-mean-norm"]
    results = [SentenceEncoder(path, n_threads=n).encode(SENTENCES) for n in (1, 2, 3)]
    np.testing.assert_allclose(results[1], results[0], atol=1e-6)
    np.testing.assert_allclose(results[2], results[0], atol=1e-6)


def test_one_query_after_another_and_the_stages_of_a_profiled_call(
    model_dirs: dict[str, Path],
) -> None:
    model = SentenceEncoder(model_dirs["v2-gelu-mean-norm"])
    batched = model.encode(SENTENCES, batch_size=len(SENTENCES))
    # The same shape twice in a row computes the allocated graph again with the new inputs
    # (the second call of a sentence, or the next sentence of the same length); shapes
    # changing in between allocate again. Same bits either way.
    for order in (SENTENCES, SENTENCES[::-1]):
        for sentence in order:
            first = model.encode(sentence)
            np.testing.assert_array_equal(model.encode(sentence), first)
            np.testing.assert_allclose(first, batched[SENTENCES.index(sentence)], atol=1e-5)
    assert model.last_stages is None
    model.encode(SENTENCES[:3], batch_size=2, profile=True)
    stages = model.last_stages
    assert stages is not None and model.last_profile is not None
    assert set(stages) == {"tokenize", "inputs", "setup", "compute", "output", "total"}
    assert all(v >= 0 for v in stages.values())
    assert stages["total"] >= sum(v for k, v in stages.items() if k != "total")
    assert stages["compute"] >= model.last_profile.node_seconds * 0.5


def test_threads_sharing_a_model(model_dirs: dict[str, Path]) -> None:
    import threading

    model = SentenceEncoder(model_dirs["v6-mean+max+cls"])
    inputs = [SENTENCES[i:] + SENTENCES[:i] for i in range(4)]
    expected = [model.encode(x, batch_size=3) for x in inputs]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(10):  # without the model's lock this fails often (stale tensors)
                results[i] = model.encode(inputs[i], batch_size=3)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(4):
        np.testing.assert_allclose(results[i], expected[i], atol=1e-6)


def test_max_seq_length_override(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["v2-gelu-mean-norm"]
    model = SentenceEncoder(path, max_seq_length=10)
    assert model.max_seq_length == 10
    long = SENTENCES[-2]
    assert model.tokenize([long]).lengths[0] == 10
    short = model.encode([long])
    model.max_seq_length = 40
    assert model.tokenize([long]).lengths[0] == 40
    longer = model.encode([long])
    assert cosines(short, longer)[0] < 0.9999  # the setting really changed the input
    np.testing.assert_allclose(longer, reference_vectors(model, [long]), atol=2e-5)
    for bad in (1, 65, 2.5, True):
        with pytest.raises(fg.InvalidArgumentError, match="max_seq_length"):
            model.max_seq_length = bad  # type: ignore[assignment]
    with pytest.raises(fg.InvalidArgumentError, match="max_seq_length"):
        SentenceEncoder(path, max_seq_length=1000)


def test_model_length_beyond_positions_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", Spec(layers=1, max_seq_length=100, max_pos=16))
    model = SentenceEncoder(path)
    assert model.max_seq_length == 100  # as sentence-transformers reads it
    assert model.encode(["short one"]).shape == (1, 32)  # fits the positions: fine
    with pytest.raises(fg.InvalidArgumentError, match="positions"):
        model.encode(["the cat sat on the mat " * 10])


def test_graph_cache_is_bounded_and_lengths_bucketed(model_dirs: dict[str, Path]) -> None:
    wide = SentenceEncoder(model_dirs["v2-gelu-mean-norm"])  # 64 positions
    lengths = (1, 15, 16, 17, 19, 31, 32, 33, 37, 63, 64)
    assert [wide.padded_length(n) for n in lengths] == [1, 15, 16, 18, 20, 32, 32, 36, 40, 64, 64]
    for n in range(1, 65):  # at most 1/8 more tokens, never past the positions
        assert n <= wide.padded_length(n) <= min(64, n + n // 8)
    assert len({wide.padded_length(n) for n in range(1, 65)}) == 15 + 8 + 8 + 1

    model = SentenceEncoder(model_dirs["v6-prefixed-truncation"])  # 28 positions
    assert model.padded_length(27) == 28
    built: list[tuple[int, int]] = []
    build = model.build_graph

    def counting(batch: int, seq: int) -> Any:
        built.append((batch, seq))
        return build(batch, seq)

    model.build_graph = counting  # type: ignore[method-assign]
    words = ["the", "cat", "sat", "on", "mat", "dog", "runs"]
    sentences = [" ".join(words[: 1 + i % 7] * (1 + i // 7)) for i in range(30)]
    for batch_size in range(1, 31):  # many (batch, length) combinations
        model.encode(sentences, batch_size=batch_size)
    assert len(set(built)) > GRAPH_CACHE_SIZE  # more shapes than the cache holds ...
    assert len(model._graphs) == GRAPH_CACHE_SIZE  # ... and it stayed at its bound
    # Small batches' graph inputs are kept by padding pattern, bounded, and read-only (a
    # caller's array could never alias them: `Tensor.set` copies).
    from ferrograph.models.sentence_encoder import INPUT_CACHE_SIZE

    assert 0 < len(model._inputs) <= INPUT_CACHE_SIZE
    cached = [a for entry in model._inputs.values() for a in entry if a is not None]
    assert cached and not any(a.flags.writeable for a in cached)
    allowed = set(range(1, 16)) | {16, 18, 20, 22, 24, 26, 28}
    assert {seq for _, seq in built} <= allowed
    exact = SentenceEncoder(model_dirs["v6-prefixed-truncation"], bucket_lengths=False)
    assert exact.padded_length(17) == 17
    np.testing.assert_allclose(
        exact.encode(sentences, batch_size=7), model.encode(sentences, batch_size=7), atol=2e-6
    )


def test_sorted_batches_pad_little(model_dirs: dict[str, Path]) -> None:
    model = SentenceEncoder(model_dirs["v2-gelu-mean-norm"], bucket_lengths=False)
    shapes: list[tuple[int, int]] = []
    run = model.run_batch

    def spy(batch: Any, prompt_length: int = 0) -> np.ndarray:
        shapes.append(batch.shape)
        return run(batch, prompt_length)

    model.run_batch = spy  # type: ignore[method-assign]
    sentences = ["a"] * 6 + [" ".join(["cat"] * 40)] * 2
    model.encode(sentences, batch_size=4)
    # the two long sentences share a batch; the short ones are not padded to 24
    assert shapes == [(4, 24), (4, 3)]


def test_encode_arguments(model_dirs: dict[str, Path]) -> None:
    model = SentenceEncoder(model_dirs["v6-gelu_new-cls"])
    assert model.dim == 48
    assert model.encode([]).shape == (0, 48)
    one = model.encode("one")
    assert one.shape == (48,)  # a single string gives one vector, as sentence-transformers
    np.testing.assert_array_equal(one, model.encode(["one"])[0])
    seen: list[tuple[int, int]] = []
    model.encode(["a", "b", "c"], batch_size=2, show_progress_bar=lambda d, t: seen.append((d, t)))
    assert seen == [(2, 3), (3, 3)]
    # sentence-transformers' argument names, with its meanings
    many = model.encode(["a b", "c"], convert_to_numpy=True, normalize_embeddings=True)
    np.testing.assert_allclose(np.linalg.norm(many, axis=1), 1, rtol=1e-5)
    plain = model.encode(["a b", "c"])
    np.testing.assert_allclose(
        many, plain / np.linalg.norm(plain, axis=1, keepdims=True), rtol=1e-5
    )
    listed = model.encode(["a b", "c"], convert_to_numpy=False)
    assert isinstance(listed, list) and len(listed) == 2 and listed[0].shape == (48,)
    np.testing.assert_array_equal(np.stack(listed), plain)
    # the older name still reports progress
    older: list[tuple[int, int]] = []
    model.encode(["a"], progress=lambda d, t: older.append((d, t)))
    assert older == [(1, 1)]
    with pytest.raises(fg.InvalidArgumentError, match="batch_size"):
        model.encode(["x"], batch_size=0)
    with pytest.raises(fg.InvalidArgumentError, match="sentence 1"):
        model.encode(["x", 3])  # type: ignore[list-item]
    assert "SentenceEncoder(" in repr(model) and "cls" in repr(model)


def test_cli_embed_with_model_dir(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from ferrograph.__main__ import main

    rc = main(["embed", "--model", str(model_dirs["v6-mean+max+cls"]), "the cat", "the dog"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "cosine similarity" in out and "dim 96" in out
    rc = main(["embed", "--model", str(model_dirs["v6-gelu_new-cls"]), "x", "--max-length", "1"])
    assert rc == 2
    assert "max_seq_length" in capsys.readouterr().err
    rc = main(["embed", "--model", str(model_dirs["v6-gelu_new-cls"] / "nowhere"), "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist" in err and "pip install" not in err


# ----------------------------------------------------------------------------------------------
# against sentence-transformers itself
# ----------------------------------------------------------------------------------------------


def _peer_python() -> str | None:
    """An interpreter that can import sentence-transformers: this one, or
    ``FERROGRAPH_ST_PYTHON``."""
    if importlib.util.find_spec("sentence_transformers") is not None:
        return sys.executable
    candidate = os.environ.get("FERROGRAPH_ST_PYTHON")
    return candidate if candidate and Path(candidate).is_file() else None


_PEER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from sentence_transformers import SentenceTransformer
    dirs, sentences, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    result = {}
    for name, path in dirs.items():
        model = SentenceTransformer(path, device="cpu")
        result[name + "/vectors"] = model.encode(sentences, batch_size=5, convert_to_numpy=True)
        result[name + "/prompted"] = model.encode(sentences, batch_size=5, prompt="note: the ")
        result[name + "/max_seq_length"] = np.array(model.max_seq_length)
        features = model.tokenize(sentences)
        ids = features["input_ids"].numpy().astype(np.int32)
        ids[features["attention_mask"].numpy() == 0] = -1
        result[name + "/ids"] = ids
    np.savez(out, **result)
    """
)


@pytest.fixture(scope="module")
def peer_results(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    python = _peer_python()
    if python is None:
        pytest.skip(
            "sentence-transformers is not importable (set FERROGRAPH_ST_PYTHON to an "
            "interpreter that has it); the numpy reference checks the same directories"
        )
    out = tmp_path_factory.mktemp("peer") / "peer.npz"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    args = [json.dumps({k: str(v) for k, v in model_dirs.items()}), json.dumps(SENTENCES)]
    done = subprocess.run(
        [python, "-c", _PEER_SCRIPT, *args, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(out)


@pytest.mark.parametrize("name", list(SPECS))
def test_against_sentence_transformers(
    model_dirs: dict[str, Path], peer_results: Any, name: str
) -> None:
    model = SentenceEncoder(model_dirs[name])
    assert model.max_seq_length == int(peer_results[name + "/max_seq_length"])
    batch = model.tokenize(SENTENCES)
    ids = np.where(batch.attention_mask > 0, batch.input_ids, -1)
    np.testing.assert_array_equal(ids, peer_results[name + "/ids"])
    got = model.encode(SENTENCES, batch_size=5)
    cos = cosines(got, peer_results[name + "/vectors"])
    worst = int(np.argmin(cos))
    assert cos.min() >= 0.9999, f"{name}: cosine {cos[worst]:.6f} for {SENTENCES[worst]!r}"
    prompted = model.encode(SENTENCES, batch_size=5, prompt="note: the ")
    assert cosines(prompted, peer_results[name + "/prompted"]).min() >= 0.9999
