"""A sentence-transformers model directory's settings, read as sentence-transformers reads them.

A sentence-transformers model directory holds a Hugging Face model (``config.json``, the weights,
the tokenizer files) plus the files that say how sentence-transformers turns its token states into
one vector per sentence:

* ``modules.json``: the module pipeline: Transformer -> Pooling -> any number of Dense ->
  optionally Normalize (Dropout modules, identities at inference, are skipped). Module
  types are class paths: ``sentence_transformers.models.Pooling`` in directories written by
  sentence-transformers 2-5, ``sentence_transformers.sentence_transformer.modules.pooling.Pooling``
  (and ``...base.modules.transformer.Transformer`` / ``...base.modules.normalize.Normalize``) in
  those written by 6.x. Only the class name matters. Without ``modules.json`` sentence-transformers
  builds Transformer + mean pooling, and so does :func:`read_settings`.
* ``sentence_bert_config.json`` (in the Transformer module's folder): ``max_seq_length`` and
  ``do_lower_case`` (2-5), or 6.x's keys (``transformer_task``, ``processor_kwargs``, ...).
* ``<pooling folder>/config.json``: the pooling modes, either the 2-5 flags
  (``pooling_mode_mean_tokens``, ...) or 6.x's ``pooling_mode`` (one name or a list), and
  ``include_prompt``.
* ``<dense folder>/config.json`` and ``model.safetensors``: a linear layer (``in_features``,
  ``out_features``, ``bias``, ``use_residual``) and its ``activation_function`` (``torch.nn``'s
  Tanh, the default, Identity, ReLU, GELU, Sigmoid or SiLU).
* ``config_sentence_transformers.json``: ``model_type``, the named ``prompts`` and the
  ``default_prompt_name`` whose prompt :meth:`~ferrograph.models.SentenceEncoder.encode`
  prepends when it is given no other.

The truncation length follows sentence-transformers 6.x (which gives the same answer as 2-5 on the
directories 2-5 wrote), highest priority first:

1. ``model_max_length`` in the Transformer's ``processor_kwargs`` (2-5: ``tokenizer_args``);
2. ``max_seq_length`` in ``sentence_bert_config.json``;
3. ``model_max_length`` of ``tokenizer_config.json`` (no limit when absent), capped at the model's
   ``max_position_embeddings``.

The truncation written in ``tokenizer.json`` itself is ignored, as the Hugging Face tokenizer call
sentence-transformers makes overrides it.

Anything this package cannot compute exactly as sentence-transformers would (another module, a
non-BERT architecture, an activation or a position-embedding kind it lacks, another tokenizer
class, ...) raises :class:`UnsupportedModelError` naming the file and the setting: never a
silently different vector.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import ferrograph as fg

__all__ = [
    "ACTIVATIONS",
    "DENSE_ACTIVATIONS",
    "POOLING_MODES",
    "BertConfig",
    "DenseConfig",
    "ModelNotFoundError",
    "ModelSettings",
    "PoolingConfig",
    "UnsupportedModelError",
    "read_settings",
]

logger = logging.getLogger("ferrograph.models.settings")

POOLING_MODES: Final = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
"""Pooling modes, in the order the 2-5 flags concatenate them."""
_LEGACY_POOLING_FLAGS: Final = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
ACTIVATIONS: Final = {
    "gelu": "gelu_erf",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "quick_gelu": "gelu_quick",
}
"""``hidden_act`` values of ``config.json`` and the function each computes (Hugging Face's
names; ``gelu`` is the exact erf form, ``gelu_new`` & co. the tanh approximation)."""

_SENTENCE_BERT_CONFIG_NAMES: Final = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
# Keys of the Transformer's kwargs dictionaries that do not change the vectors.
_HARMLESS_MODEL_KWARGS: Final = frozenset(
    {"torch_dtype", "dtype", "attn_implementation", "low_cpu_mem_usage", "device_map"}
)
_HARMLESS_PROCESSOR_KWARGS: Final = frozenset(
    {"use_fast", "clean_up_tokenization_spaces", "model_max_length", "padding_side"}
)
_SKIPPED_MODULES: Final = frozenset({"Dropout"})  # identity at inference
DENSE_ACTIVATIONS: Final = {
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu_erf",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.SiLU": "silu",
}
"""Dense ``activation_function`` class paths and the function each computes (sentence-transformers
creates them without arguments, so GELU is the exact erf form)."""
_MAX_DIM: Final = 1 << 20  # sizes above this in config.json are treated as corrupt


class UnsupportedModelError(fg.Error, ValueError):
    """A model directory asks for something ferrograph cannot compute exactly as
    sentence-transformers does (another module, architecture, activation, setting); the
    message names the file and the setting."""


class ModelNotFoundError(fg.Error, FileNotFoundError):
    """A model directory, or a file it must hold, was not found."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise UnsupportedModelError(f"{path} is not valid JSON: {error}") from error


def _read_json_object(path: Path) -> dict[str, Any]:
    value = _read_json(path)
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{path} must hold a JSON object")
    return value


def _positive_int(raw: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_DIM:
        raise UnsupportedModelError(f"{where}: {key} must be an integer in [1, {_MAX_DIM}]")
    return value


@dataclass(frozen=True)
class BertConfig:
    """The BERT hyper-parameters of ``config.json``.

    Attributes
    ----------
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
    max_position_embeddings, type_vocab_size
        Sizes, as in Hugging Face's ``BertConfig``.
    layer_norm_eps
        Epsilon of every layer norm.
    hidden_act
        The feed-forward activation, a key of :data:`ACTIVATIONS`.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def activation(self) -> str:
        """The function ``hidden_act`` names: ``gelu_erf``, ``gelu_tanh``, ``relu``, ``silu`` or
        ``gelu_quick``."""
        return ACTIVATIONS[self.hidden_act]

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertConfig:
        """Reads and checks ``config.json`` of a model directory.

        Raises
        ------
        UnsupportedModelError
            If the model is not a BERT encoder this package computes exactly (the message
            names the setting).
        ModelNotFoundError
            If there is no ``config.json``.
        """
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{model_dir} has no config.json")
        raw = _read_json_object(path)
        model_type = raw.get("model_type", "bert")
        if model_type != "bert":
            raise UnsupportedModelError(
                f"{path}: model_type {model_type!r} is not supported (only 'bert')"
            )
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"{path}: hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        position_kind = raw.get("position_embedding_type", "absolute")
        if position_kind != "absolute":
            raise UnsupportedModelError(
                f"{path}: position_embedding_type {position_kind!r} is not supported "
                "(only 'absolute')"
            )
        for flag in ("is_decoder", "add_cross_attention"):
            if raw.get(flag):
                raise UnsupportedModelError(f"{path}: {flag} is not supported")
        eps = raw.get("layer_norm_eps", 1e-12)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise UnsupportedModelError(f"{path}: layer_norm_eps must be in (0, 1), got {eps!r}")
        config = cls(
            vocab_size=_positive_int(raw, "vocab_size", path),
            hidden_size=_positive_int(raw, "hidden_size", path),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers", path),
            num_attention_heads=_positive_int(raw, "num_attention_heads", path),
            intermediate_size=_positive_int(raw, "intermediate_size", path),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", path, 512),
            type_vocab_size=_positive_int(raw, "type_vocab_size", path, 2),
            layer_norm_eps=float(eps),
            hidden_act=act,
        )
        if config.hidden_size % config.num_attention_heads:
            raise UnsupportedModelError(
                f"{path}: hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_attention_heads}"
            )
        return config


@dataclass(frozen=True)
class PoolingConfig:
    """The Pooling module's settings.

    Attributes
    ----------
    modes
        Pooling modes (names of :data:`POOLING_MODES`) whose vectors are concatenated, in order.
    include_prompt
        Whether prompt tokens are pooled (only matters with a prompt; see
        :class:`ModelSettings`).
    """

    modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True

    @classmethod
    def from_file(cls, path: Path, hidden_size: int) -> PoolingConfig:
        """Reads a Pooling ``config.json`` of either layout.

        Raises
        ------
        UnsupportedModelError
            For an unknown mode or a dimension that is not the model's hidden size.
        """
        raw = _read_json_object(path) if path.is_file() else {}
        dim = raw.get("embedding_dimension", raw.get("word_embedding_dimension", hidden_size))
        if dim != hidden_size:
            raise UnsupportedModelError(
                f"{path}: pooling dimension {dim!r} differs from the model's hidden_size "
                f"{hidden_size}"
            )
        mode: Any = raw.get("pooling_mode")
        if mode is None:
            # 2-5 layout: one flag per mode, concatenated in the flags' order; none set = mean
            flags = [name for key, name in _LEGACY_POOLING_FLAGS.items() if raw.get(key)]
            modes = tuple(flags) or ("mean",)
        elif isinstance(mode, str):
            modes = (mode,)
        elif isinstance(mode, list) and mode and all(isinstance(m, str) for m in mode):
            modes = tuple(mode)
        else:
            raise UnsupportedModelError(f"{path}: pooling_mode {mode!r} is not a mode name or list")
        for name in modes:
            if name not in POOLING_MODES:
                raise UnsupportedModelError(
                    f"{path}: pooling mode {name!r} is not supported "
                    f"(supported: {', '.join(POOLING_MODES)})"
                )
        include_prompt = raw.get("include_prompt", True)
        if not isinstance(include_prompt, bool):
            raise UnsupportedModelError(f"{path}: include_prompt must be true or false")
        return cls(modes, include_prompt)


@dataclass(frozen=True)
class DenseConfig:
    """A Dense module: ``activation(x @ weight.T + bias)`` (plus ``x``, or ``x @ residual.T``
    when the widths differ, with ``use_residual``).

    Attributes
    ----------
    folder
        The module's folder (``config.json``, ``model.safetensors``).
    in_features, out_features
        Widths of its input and output.
    bias, residual
        Whether it has a bias and a residual connection.
    activation
        A value of :data:`DENSE_ACTIVATIONS`.
    """

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str
    residual: bool

    @classmethod
    def from_dir(cls, folder: Path, in_features: int) -> DenseConfig:
        """Reads a Dense module's ``config.json``; ``in_features`` is the width it receives.

        Raises
        ------
        UnsupportedModelError
            For another activation, input or output key, or a width that does not fit.
        """
        path = folder / "config.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{folder} has no config.json (a Dense module's settings)")
        raw = _read_json_object(path)
        width_in = _positive_int(raw, "in_features", path)
        width_out = _positive_int(raw, "out_features", path)
        if width_in != in_features:
            raise UnsupportedModelError(
                f"{path}: in_features {width_in} but the previous module gives {in_features}"
            )
        act = raw.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in DENSE_ACTIVATIONS:
            raise UnsupportedModelError(
                f"{path}: activation_function {act!r} is not supported "
                f"(supported: {', '.join(DENSE_ACTIVATIONS)})"
            )
        for key in ("module_input_name", "module_output_name"):
            if raw.get(key) not in (None, "sentence_embedding"):
                raise UnsupportedModelError(f"{path}: Dense {key} {raw[key]!r} is not supported")
        flags = {
            key: raw.get(key, default) for key, default in (("bias", True), ("use_residual", False))
        }
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise UnsupportedModelError(f"{path}: {key} must be true or false")
        return cls(
            folder,
            width_in,
            width_out,
            flags["bias"],
            DENSE_ACTIVATIONS[act],
            flags["use_residual"],
        )


@dataclass(frozen=True)
class ModelSettings:
    """Everything :class:`~ferrograph.models.SentenceEncoder` needs to know about a model
    directory.

    Attributes
    ----------
    model_dir
        The sentence-transformers model directory.
    transformer_dir
        The Transformer module's folder (``config.json``, weights, tokenizer); usually
        ``model_dir`` itself.
    bert
        ``config.json``'s hyper-parameters.
    max_seq_length
        Tokens per sentence after truncation (special tokens included), as sentence-transformers
        would truncate.
    do_lower_case
        Lower-case the text before tokenizing (``sentence_bert_config.json``); applied as a
        ``Lowercase`` normalizer when the tokenizer has none, as sentence-transformers 6 does.
    pooling
        The Pooling module's settings.
    normalize
        Whether a Normalize module L2-normalises the sentence vector (last).
    dense
        The Dense modules after the pooling, in order.
    prompts, default_prompt_name
        Named prompts (text prepended to every sentence) and the one used by default
        (``config_sentence_transformers.json``).
    modules
        The class names of the modules, in order (``["Transformer", "Pooling", ...]``).
    """

    model_dir: Path
    transformer_dir: Path
    bert: BertConfig
    max_seq_length: int
    do_lower_case: bool
    pooling: PoolingConfig
    normalize: bool
    modules: tuple[str, ...]
    dense: tuple[DenseConfig, ...] = ()
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    @property
    def pooled_dim(self) -> int:
        """Width of the pooled vector (hidden size times the number of pooling modes)."""
        return self.bert.hidden_size * len(self.pooling.modes)

    @property
    def dim(self) -> int:
        """Width of a sentence vector (the last Dense module's output, else the pooled one)."""
        return self.dense[-1].out_features if self.dense else self.pooled_dim


def _module_class_name(path: Path, entry: dict[str, Any]) -> str:
    class_ref = entry.get("type")
    if not isinstance(class_ref, str) or not class_ref.startswith("sentence_transformers."):
        raise UnsupportedModelError(
            f"{path}: module {entry.get('name', '?')!r} has type {class_ref!r}; only "
            "sentence-transformers' own Transformer, Pooling and Normalize modules are supported"
        )
    return class_ref.rsplit(".", 1)[-1]


def _module_dir(model_dir: Path, entry: dict[str, Any], where: Path) -> Path:
    sub = entry.get("path", "")
    if not isinstance(sub, str):
        raise UnsupportedModelError(f"{where}: module path {sub!r} is not a string")
    folder = (model_dir / sub).resolve()
    root = model_dir.resolve()
    if folder != root and root not in folder.parents:
        raise UnsupportedModelError(f"{where}: module path {sub!r} leaves the model directory")
    return folder


def _check_kwargs(where: Path, name: str, value: Any, harmless: frozenset[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{where}: {name} must be an object")
    unknown = sorted(set(value) - harmless - {"trust_remote_code"})
    if unknown:
        raise UnsupportedModelError(
            f"{where}: {name} {', '.join(unknown)} not supported (they may change the vectors)"
        )
    return value


def _transformer_settings(folder: Path, bert: BertConfig) -> tuple[int, bool]:
    """(max_seq_length, do_lower_case) of the Transformer module in ``folder``."""
    raw: dict[str, Any] = {}
    where = folder / _SENTENCE_BERT_CONFIG_NAMES[0]
    for name in _SENTENCE_BERT_CONFIG_NAMES:
        if (folder / name).is_file():
            where = folder / name
            raw = _read_json_object(where)
            break
    task = raw.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise UnsupportedModelError(f"{where}: transformer_task {task!r} is not supported")
    for key in ("query_length", "document_length", "query_expansion"):
        if raw.get(key) is not None:
            raise UnsupportedModelError(f"{where}: {key} (multi-vector models) is not supported")
    if raw.get("processing_kwargs"):
        raise UnsupportedModelError(f"{where}: processing_kwargs is not supported")
    modality = raw.get("modality_config")
    if modality is not None and (not isinstance(modality, dict) or set(modality) != {"text"}):
        raise UnsupportedModelError(
            f"{where}: modality_config {modality!r} is not supported (text only)"
        )
    output_name = raw.get("module_output_name", "token_embeddings")
    if output_name != "token_embeddings":
        raise UnsupportedModelError(f"{where}: module_output_name {output_name!r} is not supported")
    processor: dict[str, Any] = {}
    for key in ("tokenizer_args", "processor_kwargs"):
        processor.update(_check_kwargs(where, key, raw.get(key), _HARMLESS_PROCESSOR_KWARGS))
    for key in ("model_args", "model_kwargs"):
        _check_kwargs(where, key, raw.get(key), _HARMLESS_MODEL_KWARGS)
    for key in ("config_args", "config_kwargs"):
        _check_kwargs(where, key, raw.get(key), frozenset())
    do_lower_case = raw.get("do_lower_case", False)
    if not isinstance(do_lower_case, bool):
        raise UnsupportedModelError(f"{where}: do_lower_case must be true or false")

    length: Any
    if "model_max_length" in processor:
        length, source = processor["model_max_length"], "processor_kwargs.model_max_length"
    elif raw.get("max_seq_length") is not None:
        length, source = raw["max_seq_length"], f"{where.name} max_seq_length"
    else:
        # the tokenizer's own limit (none when absent), capped at the position table
        tokenizer_config = folder / "tokenizer_config.json"
        tok = _read_json_object(tokenizer_config) if tokenizer_config.is_file() else {}
        length = tok.get("model_max_length", math.inf)
        if isinstance(length, bool) or not isinstance(length, (int, float)):
            raise UnsupportedModelError(f"{tokenizer_config}: model_max_length {length!r}")
        length = min(length, bert.max_position_embeddings)
        source = "tokenizer_config.json model_max_length, capped at max_position_embeddings"
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise UnsupportedModelError(f"{where}: truncation length {length!r} ({source})")
    logger.debug("max_seq_length %d from %s", length, source)
    return length, do_lower_case


def _prompts(path: Path, raw: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    """``prompts`` (a missing prompt text counts as empty) and ``default_prompt_name``."""
    listed = raw.get("prompts") or {}
    if not isinstance(listed, dict) or not all(isinstance(k, str) for k in listed):
        raise UnsupportedModelError(f"{path}: prompts must map names to texts")
    prompts: dict[str, str] = {}
    for name, text in listed.items():
        if text is not None and not isinstance(text, str):
            raise UnsupportedModelError(f"{path}: prompt {name!r} is not a string")
        prompts[name] = text or ""
    default = raw.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise UnsupportedModelError(
            f"{path}: default_prompt_name {default!r} is not one of the prompts {list(prompts)}"
        )
    return prompts, default


def read_settings(model_dir: str | Path) -> ModelSettings:
    """Reads a sentence-transformers model directory's settings (see the module docstring).

    Raises
    ------
    ModelNotFoundError
        If the directory or its ``config.json`` does not exist.
    UnsupportedModelError
        If a module or setting is one this package cannot compute exactly.
    """
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise ModelNotFoundError(f"model directory {root} does not exist")
    st_config_path = root / "config_sentence_transformers.json"
    if st_config_path.is_file():
        st_config = _read_json_object(st_config_path)
        kind = st_config.get("model_type", "SentenceTransformer")
        if kind != "SentenceTransformer":
            raise UnsupportedModelError(f"{st_config_path}: model_type {kind!r} is not supported")
        prompts, default_prompt_name = _prompts(st_config_path, st_config)
    else:
        prompts, default_prompt_name = {}, None

    modules_path = root / "modules.json"
    entries: list[dict[str, Any]]
    if modules_path.is_file():
        listed = _read_json(modules_path)
        if not isinstance(listed, list) or not all(isinstance(e, dict) for e in listed):
            raise UnsupportedModelError(f"{modules_path} must hold a list of module objects")
        entries = listed
    else:
        # what sentence-transformers builds for a plain Hugging Face model: mean pooling
        entries = [
            {"type": "sentence_transformers.models.Transformer", "path": ""},
            {"type": "sentence_transformers.models.Pooling", "path": None},
        ]

    names: list[str] = []
    transformer_dir: Path | None = None
    bert: BertConfig | None = None
    pooling: PoolingConfig | None = None
    dense: list[DenseConfig] = []
    normalize = False
    for entry in entries:
        name = _module_class_name(modules_path, entry)
        if name in _SKIPPED_MODULES:
            continue
        if not names:
            allowed = {"Transformer"}
        elif names == ["Transformer"]:
            allowed = {"Pooling"}
        elif names[-1] == "Normalize":
            allowed = set()
        else:
            allowed = {"Dense", "Normalize"}
        if name not in allowed:
            raise UnsupportedModelError(
                f"{modules_path}: module {name!r} ({entry.get('type')}) is not supported here "
                f"(supported pipeline: Transformer, Pooling, any Dense, optionally Normalize; "
                f"found after {names or 'nothing'})"
            )
        names.append(name)
        if name == "Transformer":
            transformer_dir = _module_dir(root, entry, modules_path)
            bert = BertConfig.from_dir(transformer_dir)
        elif name == "Pooling":
            assert bert is not None
            if entry.get("path") is None:
                pooling = PoolingConfig()
            else:
                folder = _module_dir(root, entry, modules_path)
                pooling = PoolingConfig.from_file(folder / "config.json", bert.hidden_size)
        elif name == "Dense":
            assert bert is not None and pooling is not None
            width = dense[-1].out_features if dense else bert.hidden_size * len(pooling.modes)
            dense.append(DenseConfig.from_dir(_module_dir(root, entry, modules_path), width))
        else:
            folder = _module_dir(root, entry, modules_path)
            config = folder / "config.json"
            raw = _read_json_object(config) if config.is_file() else {}
            for key in ("module_input_name", "module_output_name"):
                if raw.get(key, "sentence_embedding") != "sentence_embedding":
                    raise UnsupportedModelError(f"{config}: Normalize {key} {raw[key]!r}")
            normalize = True
    if transformer_dir is None or bert is None or pooling is None:
        raise UnsupportedModelError(
            f"{modules_path}: a Transformer and a Pooling module are required, found {names}"
        )
    max_seq_length, do_lower_case = _transformer_settings(transformer_dir, bert)
    if not (transformer_dir / "tokenizer.json").is_file():
        raise ModelNotFoundError(
            f"{transformer_dir} has no tokenizer.json (the fast-tokenizer file is required)"
        )
    return ModelSettings(
        model_dir=root,
        transformer_dir=transformer_dir,
        bert=bert,
        max_seq_length=max_seq_length,
        do_lower_case=do_lower_case,
        pooling=pooling,
        normalize=normalize,
        modules=tuple(names),
        dense=tuple(dense),
        prompts=prompts,
        default_prompt_name=default_prompt_name,
    )
