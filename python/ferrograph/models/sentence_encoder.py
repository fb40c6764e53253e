"""Sentence embeddings from any BERT-family sentence-transformers model directory, computed with
ferrograph.

>>> from ferrograph.models import SentenceEncoder
>>> model = SentenceEncoder("path/to/model", weights_dtype="f16")   # doctest: +SKIP
>>> model.encode(["A cat sits.", "A dog runs."]).shape                # doctest: +SKIP
(2, 384)

The settings come from the directory as sentence-transformers reads them
(:mod:`ferrograph.models.settings`): the truncation length, lower-casing, the pooling modes,
Dense and Normalize modules, the prompts. The weights (``model.safetensors``) and the tokenizer
(``tokenizer.json``) are read with ``safetensors`` and ``tokenizers``; PyTorch is never imported.

How it runs
-----------
* The weights live in one context whose tensors are allocated together in a backend buffer
  marked ``fg.BufferUsage.WEIGHTS``; the matrix weights and the word-embedding table are
  optionally converted to f16, bf16 or q8_0 at load time (q8_0 only for matrices whose rows are
  a multiple of 32 wide; others stay f32), biases, layer norms and the position / token-type
  tables stay f32.
* :meth:`SentenceEncoder.encode` tokenizes everything, sorts the sentences by token count
  (longest first) and cuts batches from that order, so a batch pads little; results come back
  in the input order. Each batch is padded to its longest sentence rounded up to a **length
  bucket** (:meth:`SentenceEncoder.padded_length`): exact below 16 tokens, then steps of 1/8 to
  1/16 of the length (16, 18, ..., 32, 36, ..., 64, 72, ..., 128, 144, ..., 256, 288, ...), so
  a batch is padded by at most 1/8 more tokens while all lengths up to 512 share at most 56
  graph shapes. Padding never changes a vector (padded keys are masked out of the attention,
  padded tokens get no pooling weight).
* One graph is built (metadata only) per (batch, padded length) shape and kept in a cache of at
  most :data:`GRAPH_CACHE_SIZE` shapes, least recently used evicted first, so the cache stays
  bounded whatever the inputs. The graphs run through a :class:`ferrograph.Scheduler` reserved
  once for the largest shape of an :meth:`encode` call (the first batch); smaller shapes fit
  that reservation.
* Threads may share a model: each batch is allocated, filled, computed and read under the
  model's lock (tokenizing and preparing inputs happen outside it).
* The graph: ``get_rows`` on the word and token-type tables plus a view of the position
  table, layer norm as ``norm`` then ``mul`` / ``add``, multi-head attention with the padding
  mask in ``soft_max(kq, mask, scale)`` (or one ``flash_attn_ext``), the configured activation
  (``gelu_erf`` for BERT's ``gelu``, ``gelu`` for ``gelu_new``, ``relu``, ...), residuals. Pooling:
  every weighted mode (mean, mean-sqrt-len, weighted-mean, CLS, last token) is one row of
  per-sequence token weights, all applied by one ``mul_mat``; max pooling gathers padded (and
  left-out prompt) positions onto the sentence's first pooled token and halves the sequence with
  ``max(a, b) = b + relu(a - b)``. Then each Dense module (``mul_mat``, bias, activation,
  residual) and ``l2_norm`` when the model has a Normalize module.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

import ferrograph as fg

from ._progress import ProgressBar
from .settings import ModelSettings, read_settings
from .tokenization import (
    Batch,
    check_unicode,
    load_tokenizer,
    pad,
    set_truncation,
    special_token_ids,
    tokenize,
)
from .weights import device_backends, load_weights, place_layer_weights, weights_dtype_name
from .wordpiece import FastWordPiece

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "ATTENTION_MODES",
    "GRAPH_CACHE_SIZE",
    "Progress",
    "SentenceEncoder",
    "blas_backend",
]

logger = logging.getLogger("ferrograph.models.sentence_encoder")

ATTENTION_MODES: Final = ("soft_max", "flash")
"""The ``attention`` values :class:`SentenceEncoder` accepts."""
GRAPH_CACHE_SIZE: Final = 64
"""Most (batch, padded length) graphs kept at once (least recently used evicted)."""
_WEIGHTED_MODES: Final = frozenset(
    {"cls", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"}
)

Progress = Callable[[int, int], None]
"""A progress callback: called with (sentences done, sentences in total)."""


def blas_backend(n_threads: int) -> fg.Backend | None:
    """The in-process BLAS accelerator with `n_threads` threads, registered on first use;
    None (and a log line saying why) when no BLAS library is found."""
    if not fg.blas_available():
        logger.info("no BLAS library (%s): running on the CPU alone", fg.blas_unavailable_reason())
        return None
    if fg.dev_by_name("BLAS") is None:
        fg.register_blas()
    return fg.init_backend("BLAS", n_threads=n_threads)


# Batches of at most this many attention-mask elements (batch x seq x seq) keep their graph
# inputs cached: a query after another of the same length then builds none.
INPUT_CACHE_ELEMENTS: Final = 64 * 64
# Padding patterns kept.
INPUT_CACHE_SIZE: Final = 16

# A batch's graph inputs: the attention mask, the pooling weights and the max-pooling indices.
_Inputs = tuple[
    npt.NDArray[np.float32], npt.NDArray[np.float32] | None, npt.NDArray[np.int32] | None
]


class _Stages:
    """Adds the time since the previous lap to a stage of ``stages`` (nothing when None)."""

    def __init__(self, stages: dict[str, float] | None) -> None:
        self.stages = stages
        self.last = time.perf_counter() if stages is not None else 0.0

    def lap(self, stage: str) -> None:
        if self.stages is not None:
            now = time.perf_counter()
            self.stages[stage] = self.stages.get(stage, 0.0) + now - self.last
            self.last = now


@dataclass
class ShapeGraph:
    """The graph of one (batch, seq) shape and its input / output tensors.

    ``pool_weights`` is ``None`` without a weighted pooling mode, ``max_index`` ``None``
    without max pooling.
    """

    batch: int
    seq: int
    ctx: fg.Context
    graph: fg.Graph
    input_ids: fg.Tensor
    token_type_ids: fg.Tensor
    attn_mask: fg.Tensor
    pool_weights: fg.Tensor | None
    max_index: fg.Tensor | None
    output: fg.Tensor


def _encoder_layer(name: str) -> int | None:
    """The encoder layer a weight belongs to (``encoder.layer.{i}.…``), if any."""
    part = name.split(".")
    if len(part) > 2 and part[0] == "encoder" and part[1] == "layer" and part[2].isdigit():
        return int(part[2])
    return None


class SentenceEncoder:
    """A BERT-family sentence-transformers model on a ferrograph backend.

    Parameters
    ----------
    model_dir
        A sentence-transformers model directory (either layout; see
        :mod:`ferrograph.models.settings`), or a plain Hugging Face BERT directory (then mean
        pooling, as sentence-transformers does).
    weights_dtype
        Element type of the matrix weights and the word-embedding table: ``"f32"`` (as
        shipped), ``"f16"``, ``"bf16"`` or ``"q8_0"`` (converted at load time).
    n_threads
        Threads of the CPU backend.
    max_seq_length
        Tokens per sentence after truncation ([CLS] and [SEP] included); the model's own
        setting when ``None``. Can be changed later through :attr:`max_seq_length`.
    backend
        A backend to compute on (for example ``fg.init_backend("CPU", n_threads=4)``);
        ``n_threads`` is ignored when given. It must be a CPU backend (the scheduler's last).
    blas
        Put the BLAS accelerator before the CPU in the scheduler (ignored, with a log
        message, when no BLAS library is available).
    attention
        ``"flash"`` (default): one ``flash_attn_ext`` node per layer (keys and values read in
        place, no copies of the heads; measured faster than ``"soft_max"`` at every batch size).
        ``"soft_max"``: ``mul_mat``, ``soft_max`` with mask and scale, ``mul_mat``.
    fuse_qkv
        Concatenate each layer's query, key and value projections at load time and compute
        them as one ``mul_mat`` and one bias ``add`` (default; the heads are strided views of
        its result, which ``flash_attn_ext`` reads in place). Each output element is computed
        exactly as by the three separate products, so the results are the same bits.
    bucket_lengths
        Pad each batch to its length bucket (:meth:`padded_length`; default) rather than to
        its exact longest sentence: fewer distinct shapes to build and plan, at most 1/8 more
        tokens.

    Raises
    ------
    ModelNotFoundError
        If the directory or a required file is missing.
    UnsupportedModelError
        If the directory asks for a module or setting this class cannot compute exactly.
    MissingDependencyError
        If ``safetensors`` or ``tokenizers`` is not installed.
    fg.InvalidArgumentError
        For a bad ``weights_dtype``, ``max_seq_length`` or ``attention``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        weights_dtype: str | fg.DType = "f32",
        n_threads: int = 2,
        max_seq_length: int | None = None,
        backend: fg.Backend | None = None,
        blas: bool = False,
        attention: str = "flash",
        fuse_qkv: bool = True,
        bucket_lengths: bool = True,
    ) -> None:
        dtype_name = weights_dtype_name(weights_dtype)
        if attention not in ATTENTION_MODES:
            raise fg.InvalidArgumentError(
                f"attention must be one of {ATTENTION_MODES}, got {attention!r}"
            )
        self.settings: ModelSettings = read_settings(model_dir)
        self.model_dir: Path = self.settings.model_dir
        self.config = self.settings.bert
        self.weights_dtype = dtype_name
        self.attention = attention
        self.fuse_qkv = fuse_qkv
        self.bucket_lengths = bool(bucket_lengths)
        self._max_seq_length = self.settings.max_seq_length
        self.tokenizer = load_tokenizer(
            self.settings.transformer_dir, self._max_seq_length, self.settings.do_lower_case
        )
        self._special_ids = special_token_ids(self.tokenizer, self.settings.transformer_dir)
        if max_seq_length is not None:
            self.max_seq_length = max_seq_length
        if backend is None:
            backend = fg.init_backend("CPU", n_threads=n_threads)
        self.backend: fg.Backend = backend
        self.n_threads = backend.n_threads if backend.is_cpu else n_threads
        start = time.perf_counter()
        loaded = load_weights(
            self.settings.transformer_dir,
            self.config,
            dtype_name,
            backend,
            fuse_qkv,
            self.settings.dense,
        )
        self.weights_ctx = loaded.ctx
        self.weights_buffer = loaded.buffer
        #: The linear layers' q8_0/q4_0 matrices as packed panels (CPU backend), else ``None``.
        self.packed_weights: tuple[fg.Context, fg.Buffer] | None = None
        if loaded.packed is not None and loaded.packed_ctx is not None:
            self.packed_weights = (loaded.packed_ctx, loaded.packed)
        self.weights: dict[str, fg.Tensor] = loaded.tensors
        logger.info(
            "loaded %s (%d layers, hidden %d, %s) as %s: %.1f MiB of weights in %.2f s",
            self.model_dir,
            self.config.num_hidden_layers,
            self.config.hidden_size,
            "+".join(self.settings.pooling.modes),
            dtype_name,
            self.weights_nbytes / 2**20,
            time.perf_counter() - start,
        )
        backends = [self.backend]
        if blas:
            accelerator = blas_backend(self.n_threads)
            if accelerator is not None:
                backends.insert(0, accelerator)
        self._local_backends = list(backends)
        self.scheduler = fg.Scheduler(backends)
        self.backends: list[fg.Backend] = [self.backend]
        """The backends holding weights: the model's own first, then one per device given to
        :meth:`place_layers`."""
        self.layer_homes: list[int] = [0] * self.config.num_hidden_layers
        """Per encoder layer, the index into :attr:`backends` of the backend holding its
        weights (all 0 until :meth:`place_layers`)."""
        self.placed_weights: list[tuple[fg.Context, fg.Buffer]] = []
        """The (context, buffer) pairs holding the weights :meth:`place_layers` copied."""
        self.last_profile: fg.Profile | None = None
        """The per-op profile of the last ``encode(..., profile=True)`` (all its batches)."""
        self.last_stages: dict[str, float] | None = None
        """Seconds per stage of the last ``encode(..., profile=True)`` (all its batches):
        ``tokenize``, ``inputs`` (checks, padding, masks, pooling weights), ``setup``
        (allocation and input upload), ``compute`` (the graph runs), ``output`` (reading the
        embeddings) and
        ``total`` (the whole call); ``total - compute`` is the per-call cost outside the graph."""
        self._reserved: tuple[int, int] = (0, 0)
        self._graphs: OrderedDict[tuple[int, int], ShapeGraph] = OrderedDict()
        # Graph inputs of small batches by padding pattern (see `_graph_inputs`).
        self._inputs: OrderedDict[tuple[Any, ...], _Inputs] = OrderedDict()
        self._inputs_lock = threading.Lock()
        # One scheduler and one compute buffer serve every call: a batch is allocated, filled,
        # computed and read under this lock, so threads sharing the model take turns.
        self._lock = threading.RLock()

    # ----- properties -----

    @property
    def tokenizer(self) -> Tokenizer:
        """The ``tokenizers`` tokenizer (truncating to :attr:`max_seq_length`, no padding).

        One-sentence queries of ASCII text take a fast path with the same ids
        (:class:`~ferrograph.models.wordpiece.FastWordPiece`), built from this tokenizer's
        pipeline when it is set; after changing the pipeline in place, set the tokenizer
        again (``encoder.tokenizer = encoder.tokenizer``) so the fast path follows it."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Tokenizer) -> None:
        self._tokenizer = value
        self._fast_tokenizer = FastWordPiece.from_tokenizer(value)

    @property
    def max_seq_length(self) -> int:
        """Tokens per sentence after truncation (special tokens included). Settable, from 2
        up to the model's ``max_position_embeddings``."""
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        limit = self.config.max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= limit:
            raise fg.InvalidArgumentError(f"max_seq_length must be in [2, {limit}], got {value!r}")
        self._max_seq_length = value
        set_truncation(self.tokenizer, value)
        # the fast path truncates as the tokenizer does
        self._fast_tokenizer = FastWordPiece.from_tokenizer(self.tokenizer)

    @property
    def dim(self) -> int:
        """Width of a sentence vector."""
        return self.settings.dim

    @property
    def normalize(self) -> bool:
        """Whether vectors are L2-normalised (the model has a Normalize module)."""
        return self.settings.normalize

    @property
    def pooling_modes(self) -> tuple[str, ...]:
        """The pooling modes, concatenated in this order."""
        return self.settings.pooling.modes

    @property
    def weights_nbytes(self) -> int:
        """Bytes of every weight tensor."""
        return sum(t.nbytes for t in self.weights.values())

    @property
    def memory_plan(self) -> dict[str, Any] | None:
        """The reserved compute memory plan (``None`` before the first :meth:`encode`)."""
        return self.scheduler.memory_plan

    @property
    def split_plan(self) -> fg.SchedPlan | None:
        """The scheduler's plan for the last graph: backends per node, splits, copies."""
        return self.scheduler.plan

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_dir='{self.model_dir}', "
            f"weights_dtype={self.weights_dtype!r}, n_threads={self.n_threads}, "
            f"max_seq_length={self.max_seq_length}, dim={self.dim}, "
            f"pooling={'+'.join(self.pooling_modes)}, normalize={self.normalize}, "
            f"attention={self.attention!r})"
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

    def _activation(self, x: fg.Tensor, kind: str | None = None) -> fg.Tensor:
        """``kind`` (the encoder's ``hidden_act`` by default) applied to ``x``."""
        ops = fg.ops
        kind = kind or self.config.activation
        if kind == "identity":
            return x
        if kind == "tanh":
            return ops.tanh(x)
        if kind == "sigmoid":
            return ops.sigmoid(x)
        if kind == "gelu_erf":
            return ops.gelu_erf(x)
        if kind == "gelu_tanh":
            return ops.gelu(x)
        if kind == "relu":
            return ops.relu(x)
        if kind == "silu":
            return ops.silu(x)
        return ops.gelu_quick(x)

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
            # (batch, seq, hidden) -> (batch, heads, seq, head_dim); swapping two axes is the
            # same permutation whichever way ``permute`` counts them
            if self.fuse_qkv:
                t = ops.view(
                    qkv,
                    (batch, seq, heads, head_dim),
                    (seq * row, row, head_dim * 4, 4),
                    part[name] * cfg.hidden_size * 4,
                )
            else:
                t = self._linear(x, f"{prefix}attention.self.{name}")
                t = ops.reshape(t, (batch, seq, heads, head_dim))
            return ops.permute(t, (0, 2, 1, 3))

        q = heads_of("query")
        k = heads_of("key")
        if self.attention == "flash":
            # result (batch, seq, heads, head_dim)
            out = ops.flash_attn_ext(q, k, heads_of("value"), attn_mask, scale)
            return ops.reshape(out, (batch, seq, cfg.hidden_size))
        v = ops.cont(ops.transpose(heads_of("value")))  # (batch, heads, head_dim, seq)
        kq = ops.mul_mat(k, q)  # (batch, heads, seq_q, seq_k)
        kq = ops.soft_max(kq, attn_mask, scale)
        kqv = ops.mul_mat(v, kq)  # (batch, heads, seq_q, head_dim)
        return ops.cont(ops.permute(kqv, (0, 2, 1, 3)), (batch, seq, cfg.hidden_size))

    def _encoder_layer(
        self, x: fg.Tensor, index: int, attn_mask: fg.Tensor, batch: int, seq: int
    ) -> fg.Tensor:
        """One transformer layer: attention, residual, layer norm, feed-forward, residual,
        layer norm. Self-contained, so layers can be placed on different devices."""
        ops = fg.ops
        p = f"encoder.layer.{index}."
        merged = self._self_attention(x, p, attn_mask, batch, seq)
        attn = self._linear(merged, p + "attention.output.dense")
        h = self._layer_norm(ops.add(attn, x), p + "attention.output.LayerNorm")
        ff = self._activation(self._linear(h, p + "intermediate.dense"))
        ff = self._linear(ff, p + "output.dense")
        out = self._layer_norm(ops.add(ff, h), p + "output.LayerNorm")
        out.name = f"layer_out.{index}"
        return out

    def _embeddings(
        self, input_ids: fg.Tensor, type_ids: fg.Tensor, batch: int, seq: int
    ) -> fg.Tensor:
        ops = fg.ops
        hidden = self.config.hidden_size
        x = ops.get_rows(self._w("embeddings.word_embeddings.weight"), input_ids)
        x = ops.add(x, ops.get_rows(self._w("embeddings.token_type_embeddings.weight"), type_ids))
        x = ops.reshape(x, (batch, seq, hidden))
        positions = ops.view(self._w("embeddings.position_embeddings.weight"), (seq, hidden))
        x = self._layer_norm(ops.add(x, positions), "embeddings.LayerNorm")
        x.name = "embeddings_out"
        return x

    def _max_pool(self, x: fg.Tensor, max_index: fg.Tensor, batch: int, seq: int) -> fg.Tensor:
        """Per sentence and feature, the maximum over its real tokens: (batch, hidden)."""
        ops = fg.ops
        hidden = self.config.hidden_size
        # padded positions take the sentence's first token, so they never win
        flat = ops.reshape(x, (batch * seq, hidden))
        cur = ops.reshape(ops.get_rows(flat, max_index), (batch, seq, hidden))
        length = seq
        while length > 1:
            half = (length + 1) // 2  # the halves overlap in the middle when length is odd
            strides = (length * hidden * 4, hidden * 4, 4)
            a = ops.view(cur, (batch, half, hidden), strides, 0)
            b = ops.view(cur, (batch, half, hidden), strides, (length - half) * hidden * 4)
            cur = ops.add(b, ops.relu(ops.sub(a, b)))  # max(a, b)
            length = half
        return ops.reshape(cur, (batch, hidden))

    def _pool(
        self,
        x: fg.Tensor,
        pool_weights: fg.Tensor | None,
        max_index: fg.Tensor | None,
        batch: int,
        seq: int,
    ) -> fg.Tensor:
        """The pooling modes' vectors concatenated: (batch, dim)."""
        ops = fg.ops
        hidden = self.config.hidden_size
        modes = self.pooling_modes
        weighted_modes = [m for m in modes if m in _WEIGHTED_MODES]
        weighted: fg.Tensor | None = None
        if pool_weights is not None:
            states_t = ops.cont(ops.transpose(x))  # (batch, hidden, seq)
            # per sentence: (k, seq) token weights times (seq, hidden) states
            weighted = ops.mul_mat(states_t, pool_weights)  # (batch, k, hidden)
            if len(weighted_modes) == len(modes):
                return ops.reshape(weighted, (batch, len(modes) * hidden))
        parts: list[fg.Tensor] = []
        for mode in modes:
            if mode == "max":
                assert max_index is not None
                parts.append(self._max_pool(x, max_index, batch, seq))
            else:
                assert weighted is not None
                j = weighted_modes.index(mode)
                k = len(weighted_modes)
                view = ops.view(weighted, (batch, hidden), (k * hidden * 4, 4), j * hidden * 4)
                parts.append(ops.cont(view))
        # Concatenate the (batch, hidden) vectors as (batch, hidden, 1) along the middle axis:
        # axis 1 of a 3-D tensor is the same axis whether ``concat`` counts numpy's way or
        # ggml's (reversed), so this does not depend on the convention.
        out = ops.reshape(parts[0], (batch, hidden, 1))
        for part in parts[1:]:
            out = ops.concat(out, ops.reshape(part, (batch, hidden, 1)), 1)
        return ops.reshape(out, (batch, len(modes) * hidden))

    def _dense(self, x: fg.Tensor, index: int) -> fg.Tensor:
        """Dense module ``index`` applied to ``x`` (batch, in_features)."""
        ops = fg.ops
        module = self.settings.dense[index]
        p = f"dense.{index}."
        y = ops.mul_mat(self._w(p + "linear.weight"), x)
        if module.bias:
            y = ops.add(y, self._w(p + "linear.bias"))
        y = self._activation(y, module.activation)
        if module.residual:
            if module.in_features == module.out_features:
                y = ops.add(y, x)
            else:
                y = ops.add(y, ops.mul_mat(self._w(p + "residual.weight"), x))
        y.name = f"dense_out.{index}"
        return y

    def build_graph(self, batch: int, seq: int) -> ShapeGraph:
        """Builds (without caching) the graph for ``batch`` sentences of ``seq`` tokens.

        The inputs are ``input_ids`` and ``token_type_ids`` (int32, ``(batch * seq,)``),
        ``attn_mask`` (f32, ``(batch, 1, seq, seq)``: 0 or -inf per key), ``pool_weights``
        (f32, ``(batch, k, seq)``: one row of token weights per weighted pooling mode) and
        ``max_index`` (int32, ``(batch * seq,)``: the row each position's state is read from
        for max pooling); the output ``embeddings`` is ``(batch, dim)``.

        Raises
        ------
        fg.InvalidArgumentError
            If ``batch < 1`` or ``seq`` is not in [1, max_position_embeddings].
        """
        if batch < 1 or not 1 <= seq <= self.config.max_position_embeddings:
            raise fg.InvalidArgumentError(
                f"bad graph shape: batch {batch}, seq {seq} (at most "
                f"{self.config.max_position_embeddings} positions)"
            )
        n_weighted = sum(m in _WEIGHTED_MODES for m in self.pooling_modes)
        ctx = fg.Context()
        with ctx:
            input_ids = ctx.new_tensor(fg.int32, (batch * seq,), name="input_ids").set_input()
            type_ids = ctx.new_tensor(fg.int32, (batch * seq,), name="token_type_ids").set_input()
            attn_mask = ctx.new_tensor(
                fg.float32, (batch, 1, seq, seq), name="attn_mask"
            ).set_input()
            pool_weights = None
            if n_weighted:
                pool_weights = ctx.new_tensor(
                    fg.float32, (batch, n_weighted, seq), name="pool_weights"
                ).set_input()
            max_index = None
            if "max" in self.pooling_modes:
                max_index = ctx.new_tensor(fg.int32, (batch * seq,), name="max_index").set_input()

            x = self._embeddings(input_ids, type_ids, batch, seq)
            for i in range(self.config.num_hidden_layers):
                x = self._encoder_layer(x, i, attn_mask, batch, seq)
            out = self._pool(x, pool_weights, max_index, batch, seq)
            out.name = "pooled"
            for i in range(len(self.settings.dense)):
                out = self._dense(out, i)
            if self.normalize:
                out = fg.ops.l2_norm(out, 1e-12)
                out.name = "embeddings"
            out.set_output()
        graph = fg.Graph.build(out)
        return ShapeGraph(
            batch, seq, ctx, graph, input_ids, type_ids, attn_mask, pool_weights, max_index, out
        )

    def graph(self, batch: int, seq: int) -> ShapeGraph:
        """The cached graph for a shape, built on first use (at most
        :data:`GRAPH_CACHE_SIZE` kept, least recently used evicted)."""
        key = (batch, seq)
        with self._lock:
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
            while len(self._graphs) > GRAPH_CACHE_SIZE:
                self._graphs.popitem(last=False)
            return built

    def reserve(self, batch: int, seq: int) -> None:
        """Sizes the compute buffer for ``batch`` x ``seq`` (graphs of smaller shapes then
        replay this plan)."""
        with self._lock:
            rb, rs = self._reserved
            if batch <= rb and seq <= rs:
                return
            shape = (max(batch, rb), max(seq, rs))
            g = self.graph(*shape)
            self.scheduler.reserve(g.graph)
            self._reserved = shape
            logger.debug("reserved compute memory for batch %d seq %d", *shape)

    def set_scheduler(self, scheduler: fg.Scheduler) -> None:
        """Computes later batches with ``scheduler`` (e.g. one whose backends hold some of the
        layers' weights); the cached graphs and the compute reservation are dropped, since
        they belong to the previous scheduler."""
        with self._lock:
            self.scheduler = scheduler
            self._graphs.clear()
            self._reserved = (0, 0)

    def place_layers(self, devices: Sequence[fg.Device | fg.Backend]) -> list[int]:
        """Spreads the encoder layers over ``devices`` (devices, e.g. the remote ones of
        :func:`ferrograph.remote.connect` or :attr:`ferrograph.distributed.Cluster.devices`, or
        backends opened on them); returns :attr:`layer_homes`.

        With ``k`` devices, consecutive runs of about ``n_layers / k`` layers go to one device
        each: their weights are copied once into a weights buffer on that device, so the
        scheduler runs those layers there. Embeddings, pooling and normalisation stay on the
        model's own backend; the scheduler copies activations between the devices. Sets
        :attr:`backends` (the local backend first, then one per device), :attr:`layer_homes`
        (per layer, an index into :attr:`backends`), :attr:`placed_weights` and a new
        scheduler (:meth:`set_scheduler`). ``MiniLM(devices=...)`` calls it.

        Raises
        ------
        ferrograph.InvalidArgumentError
            If ``devices`` is empty.
        ferrograph.DeviceLostError
            If a remote device's server is gone.
        ferrograph.AllocationError
            If a device gives no buffer for the weights.
        """
        backends = device_backends(self.backend, devices)
        with self._lock:
            # the copies keep the devices' weights alive with the model
            homes, self.placed_weights = place_layer_weights(
                self.weights, _encoder_layer, self.config.num_hidden_layers, backends
            )
            self.backends = backends
            self.layer_homes = homes
            self.set_scheduler(fg.Scheduler([*backends[1:], *self._local_backends]))
        logger.info(
            "layers of %s over %s: %s",
            type(self).__name__,
            [b.name for b in backends[1:]],
            homes,
        )
        return list(homes)

    # ----- running -----

    def padded_length(self, longest: int) -> int:
        """The length a batch whose longest sentence has ``longest`` tokens is padded to.

        With ``bucket_lengths``: ``longest`` rounded up to a multiple of the power of two
        nearest below ``longest / 8`` (so exact below 16 tokens, at most 1/8 more tokens above),
        never beyond ``max_position_embeddings``; without, ``longest`` itself.
        """
        if not self.bucket_lengths or longest < 16:
            return longest
        step = 1 << (longest.bit_length() - 4)  # 2 ** (floor(log2(longest)) - 3)
        bucketed = -(-longest // step) * step
        return max(longest, min(bucketed, self.config.max_position_embeddings))

    def _pool_inputs(
        self, real: npt.NDArray[np.float32], prompt_length: int = 0
    ) -> tuple[npt.NDArray[np.float32] | None, npt.NDArray[np.int32] | None]:
        """Token weights per weighted mode (batch, k, seq) and max-pooling row indices, for
        the attention mask ``real`` (1 on real tokens); the first ``prompt_length`` tokens are
        left out of the pooling (a prompt with ``include_prompt`` false)."""
        b, s = real.shape
        mask = real
        if prompt_length:
            mask = real.copy()
            mask[:, :prompt_length] = 0.0
            if not mask.any(axis=1).all():
                raise fg.InvalidArgumentError(
                    f"the prompt ({prompt_length} tokens) leaves a sentence with no token to "
                    f"pool within max_seq_length {self.max_seq_length}"
                )
        modes = self.pooling_modes
        # Only what the modes use (a query of one sentence pays for every numpy call).
        counts = np.maximum(mask.sum(axis=1, keepdims=True), np.float32(1e-9))
        if "cls" in modes or "max" in modes:
            first = np.argmax(mask > 0, axis=1)  # the first pooled token (after a prompt)
        if "lasttoken" in modes:
            last = real.sum(axis=1).astype(np.int64) - 1
        rows: list[npt.NDArray[np.float32]] = []
        for mode in modes:
            if mode == "mean":
                rows.append(mask / counts)
            elif mode == "mean_sqrt_len_tokens":
                rows.append(mask / np.sqrt(counts))
            elif mode == "weightedmean":
                positions = np.arange(1, s + 1, dtype=np.float32)[None, :] * mask
                rows.append(positions / np.maximum(positions.sum(axis=1, keepdims=True), 1e-9))
            elif mode == "cls":
                one_hot = np.zeros((b, s), np.float32)
                one_hot[np.arange(b), first] = 1.0
                rows.append(one_hot)
            elif mode == "lasttoken":
                one_hot = np.zeros((b, s), np.float32)
                one_hot[np.arange(b), last] = 1.0
                rows.append(one_hot)
        weights: npt.NDArray[np.float32] | None = None
        if len(rows) == 1:
            weights = np.ascontiguousarray(rows[0][:, None, :], np.float32)
        elif rows:
            weights = np.ascontiguousarray(np.stack(rows, axis=1), np.float32)
        index = None
        if "max" in self.pooling_modes:
            own = np.arange(b * s, dtype=np.int32).reshape(b, s)
            stand_in = (np.arange(b, dtype=np.int32) * s + first)[:, None]
            index = np.where(mask > 0, own, stand_in).astype(np.int32).reshape(-1)
        return weights, index

    def run_batch(self, batch: Batch, prompt_length: int = 0) -> npt.NDArray[np.float32]:
        """Embeds one tokenized, padded batch; returns ``(batch, dim)`` float32.
        ``prompt_length`` leading tokens are left out of the pooling."""
        return self._run_batch(batch, prompt_length, False)[0]

    def _graph_inputs(self, batch: Batch, prompt_length: int) -> _Inputs:
        """The attention mask and pooling inputs of ``batch``; for small batches cached by
        padding pattern (read-only arrays: ``Tensor.set`` copies them)."""
        b, s = batch.shape
        key: tuple[Any, ...] | None = None
        if b * s * s <= INPUT_CACHE_ELEMENTS:
            key = (prompt_length, b, s, batch.attention_mask.tobytes())
            with self._inputs_lock:
                hit = self._inputs.get(key)
            if hit is not None:
                return hit
        real = batch.attention_mask.astype(np.float32)
        mask = np.where(real[:, None, None, :] > 0, np.float32(0.0), np.float32(-np.inf))
        mask = np.ascontiguousarray(np.broadcast_to(mask, (b, 1, s, s)), dtype=np.float32)
        weights, index = self._pool_inputs(real, prompt_length)
        if key is not None:
            for array in (mask, weights, index):
                if array is not None:
                    array.flags.writeable = False
            with self._inputs_lock:
                self._inputs[key] = (mask, weights, index)
                while len(self._inputs) > INPUT_CACHE_SIZE:
                    self._inputs.popitem(last=False)
        return mask, weights, index

    def _run_batch(
        self,
        batch: Batch,
        prompt_length: int,
        profile: bool,
        clock: _Stages | None = None,
    ) -> tuple[npt.NDArray[np.float32], fg.Profile | None]:
        if clock is None:
            clock = _Stages(None)
        mask, weights, index = self._graph_inputs(batch, prompt_length)
        b, s = batch.shape
        clock.lap("inputs")
        with self._lock:
            self.reserve(b, s)
            g = self.graph(b, s)
            # The same shape as the last batch (one query after another): its plan is still
            # allocated, so only the inputs change (allocating again would redo the same plan).
            if not self.scheduler.is_allocated(g.graph):
                self.scheduler.alloc_graph(g.graph)
            g.input_ids.set(batch.input_ids.reshape(-1))
            g.token_type_ids.set(batch.token_type_ids.reshape(-1))
            g.attn_mask.set(mask)
            if g.pool_weights is not None and weights is not None:
                g.pool_weights.set(weights)
            if g.max_index is not None and index is not None:
                g.max_index.set(index)
            clock.lap("setup")
            timings = self.scheduler.graph_compute(g.graph, profile=profile)
            clock.lap("compute")
            # `numpy()` returns a new array: no second copy.
            result: npt.NDArray[np.float32] = np.asarray(g.output.numpy(), dtype=np.float32)
            clock.lap("output")
        return result, timings

    def _check_encodings(self, encodings: Sequence[Any]) -> list[int]:
        """Token counts of ``encodings``; InvalidArgumentError past the model's positions."""
        lengths = [len(e) for e in encodings]
        limit = self.config.max_position_embeddings
        if max(lengths) > limit:
            raise fg.InvalidArgumentError(
                f"a sentence has {max(lengths)} tokens, more than the model's "
                f"{limit} positions (max_seq_length {self.max_seq_length})"
            )
        return lengths

    def _pad(self, encodings: Sequence[Any], seq: int) -> Batch:
        """:func:`pad` plus the token-type check (InvalidArgumentError for a type the model
        has no embedding for)."""
        types = self.config.type_vocab_size
        for e in encodings:
            largest = max(e.type_ids, default=0)
            if largest >= types:
                raise fg.InvalidArgumentError(
                    f"token type {largest} outside the model's {types} token types"
                )
        return pad(encodings, seq)

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        show_progress_bar: bool | Progress | None = None,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        convert_to_numpy: bool = True,
        normalize_embeddings: bool = False,
        profile: bool = False,
        progress: bool | Progress | None = None,
    ) -> Any:
        """Embeds sentences.

        Parameters
        ----------
        sentences
            One sentence or a sequence of them.
        batch_size
            Sentences per graph run. Sentences are sorted by token count first so a batch
            pads little; the result keeps the input order.
        show_progress_bar
            ``True`` draws a bar on stderr; a callable is called with (done, total) after
            each batch; ``None``/``False`` reports nothing (sentence-transformers' name).
        prompt_name, prompt
            Text prepended to every sentence, as sentence-transformers' ``encode`` takes it:
            ``prompt`` itself, else the model's prompt named ``prompt_name``, else the
            model's default prompt (:attr:`prompts`, ``default_prompt_name``) if it has one.
            With the Pooling module's ``include_prompt`` false the prompt's tokens are left
            out of the pooling (they still take part in the attention).
        profile
            ``True`` times every graph node (see :class:`ferrograph.Profile`; the run is
            slower while profiled) and leaves the profile of all batches in
            :attr:`last_profile`.
        convert_to_numpy
            ``True`` (the default): one array; ``False``: a list of 1-d arrays, one per
            sentence (sentence-transformers' meaning, with numpy arrays for its tensors).
        normalize_embeddings
            Scale every embedding to unit length (as sentence-transformers does); models
            with a Normalize module already return unit vectors.
        progress
            The older name of ``show_progress_bar`` (used when that is not given).

        Returns
        -------
        numpy.ndarray
            ``(len(sentences), dim)`` float32, or ``(dim,)`` for a single string (as
            sentence-transformers returns it); unit vectors when the model has a Normalize
            module or ``normalize_embeddings`` is true.

        Raises
        ------
        fg.InvalidArgumentError
            For a ``batch_size`` below 1, a sentence that is not a ``str`` or not valid
            Unicode (a lone surrogate), an unknown ``prompt_name``, a sentence longer than
            the model's positions (possible only when the model's own ``max_seq_length``
            exceeds them), or a left-out prompt that fills a whole sentence.
        """
        single = isinstance(sentences, str)
        if single:
            sentences = [sentences]  # type: ignore[list-item]
        if show_progress_bar is None:
            show_progress_bar = progress
        out = self._encode_all(
            sentences, batch_size, show_progress_bar, prompt_name, prompt, profile
        )
        if normalize_embeddings and len(out):
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = (out / np.where(norms == 0, 1, norms)).astype(np.float32)
        if single:
            return out[0]
        return out if convert_to_numpy else list(out)

    def _encode_all(
        self,
        sentences: Sequence[str],
        batch_size: int,
        progress: bool | Progress | None,
        prompt_name: str | None,
        prompt: str | None,
        profile: bool,
    ) -> npt.NDArray[np.float32]:
        """:meth:`encode` for a list of sentences: ``(n, dim)``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise fg.InvalidArgumentError(f"batch_size must be at least 1, got {batch_size!r}")
        sentences = list(sentences)
        for i, s in enumerate(sentences):
            if not isinstance(s, str):
                raise fg.InvalidArgumentError(f"sentence {i} is a {type(s).__name__}, not a str")
        text = self._resolve_prompt(prompt_name, prompt)
        prompt_length = 0
        if text:
            sentences = [text + s for s in sentences]
            if not self.settings.pooling.include_prompt:
                prompt_length = self.prompt_length(text)
        n = len(sentences)
        out = np.zeros((n, self.dim), np.float32)
        if n == 0:
            return out
        report: Progress | None
        if progress is True:
            report = ProgressBar("embedding")
        elif progress is False or progress is None:
            report = None
        else:
            report = progress
        stages: dict[str, float] | None = None
        if profile:
            stages = dict.fromkeys(("tokenize", "inputs", "setup", "compute", "output"), 0.0)
        clock = _Stages(stages)
        began = clock.last
        try:
            if n == 1:
                # One query: the fast path for ASCII text, else the single-text call (which
                # skips encode_batch's hand-off to its thread pool).
                fast = self._fast_tokenizer
                one = None if fast is None else fast.encode(sentences[0])
                encodings: Sequence[Any] = [
                    self.tokenizer.encode(sentences[0]) if one is None else one
                ]
            else:
                encodings = self.tokenizer.encode_batch(sentences)
        except TypeError:  # tokenizers' answer to a lone surrogate names no sentence
            check_unicode((f"sentence {i}", text) for i, text in enumerate(sentences))
            raise
        clock.lap("tokenize")
        lengths = self._check_encodings(encodings)
        # Longest first (stable): batches pad little and the first is the largest shape.
        order = sorted(range(n), key=lambda i: -lengths[i]) if n > 1 else [0]
        # the first batch is the largest shape: reserve once for it, the others replay
        self.reserve(min(batch_size, n), self.padded_length(lengths[order[0]]))
        done = 0
        total: fg.Profile | None = None
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            seq = self.padded_length(lengths[idx[0]])
            batch = self._pad([encodings[i] for i in idx], seq)
            if profile:
                rows, timings = self._run_batch(batch, prompt_length, True, clock)
                if timings is not None:
                    total = timings if total is None else total + timings
            else:
                rows = self.run_batch(batch, prompt_length)  # the public hook, as before
            if n == 1:
                # one query: its own array (an indexed assignment costs ~0.08 ms, cold)
                out = np.asarray(rows, np.float32).reshape(1, self.dim)
            else:
                out[idx] = rows
            done += len(idx)
            if report is not None:
                report(done, n)
        if profile:
            self.last_profile = total
            if stages is not None:
                stages["total"] = time.perf_counter() - began
            self.last_stages = stages
        return out

    @property
    def prompts(self) -> dict[str, str]:
        """The model's named prompts (``config_sentence_transformers.json``)."""
        return dict(self.settings.prompts)

    def _resolve_prompt(self, prompt_name: str | None, prompt: str | None) -> str | None:
        """The prompt text :meth:`encode` prepends (sentence-transformers' precedence)."""
        if prompt is not None:
            if not isinstance(prompt, str):
                raise fg.InvalidArgumentError(f"prompt must be a str, got {type(prompt).__name__}")
            if prompt_name is not None:
                logger.warning("both prompt and prompt_name given: prompt_name is ignored")
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.settings.prompts:
                raise fg.InvalidArgumentError(
                    f"prompt_name {prompt_name!r} is not one of the model's prompts "
                    f"{list(self.settings.prompts)}"
                )
            return self.settings.prompts[prompt_name]
        name = self.settings.default_prompt_name
        return self.settings.prompts.get(name) if name is not None else None

    def prompt_length(self, prompt: str) -> int:
        """Tokens of ``prompt`` at the start of a sentence, as sentence-transformers counts
        them: the prompt tokenized alone (truncated as any text), less its trailing special
        token ([SEP])."""
        try:
            ids = self.tokenizer.encode(prompt).ids
        except TypeError:
            check_unicode([("the prompt", prompt)])
            raise
        return len(ids) - 1 if ids and ids[-1] in self._special_ids else len(ids)

    def tokenize(self, sentences: Sequence[str]) -> Batch:
        """Tokenizes and pads ``sentences`` as :meth:`encode` does (without sorting or
        bucketing)."""
        return tokenize(self.tokenizer, sentences)
