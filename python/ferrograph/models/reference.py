"""The sentence encoder in plain float64 numpy: slow, written for clarity, a reference for tests.

It follows Hugging Face's ``BertModel`` and sentence-transformers' Pooling and Normalize modules
line by line (padding masked with ``-inf`` before the softmax; pooling modes as
sentence-transformers computes them on right-padded batches).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from .settings import BertConfig, DenseConfig, PoolingConfig
from .tokenization import Batch

__all__ = ["activation", "numpy_encode", "numpy_pool"]

F64 = npt.NDArray[np.float64]


def _erf(x: F64) -> F64:
    # numpy has no erf; math.erf per element is exact (and slow, fine for a reference)
    result: F64 = np.vectorize(math.erf, otypes=[np.float64])(x)
    return result


def activation(name: str, x: F64) -> F64:
    """The function ``name`` (:attr:`BertConfig.activation` or a Dense activation) applied to
    ``x``."""
    if name == "identity":
        return x
    if name == "tanh":
        return np.tanh(x)
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if name == "gelu_erf":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "gelu_quick":
        return x / (1.0 + np.exp(-1.702 * x))
    raise ValueError(f"unknown activation {name!r}")


def numpy_pool(
    states: F64, mask: npt.NDArray[np.int32], pooling: PoolingConfig, prompt_length: int = 0
) -> F64:
    """sentence-transformers' pooling of ``states`` (batch, seq, hidden) with the attention
    ``mask`` (batch, seq; right padding): the modes' vectors concatenated. ``prompt_length``
    leading tokens are left out (a prompt with ``include_prompt`` false): the pooling mask is
    zero there, CLS pooling takes the first token after them, weighted-mean keeps every token's
    original position."""
    pooled_mask = mask.copy()
    pooled_mask[:, :prompt_length] = 0
    real = pooled_mask.astype(np.float64)[:, :, None]
    count = np.maximum(real.sum(axis=1), 1e-9)
    first = np.argmax(pooled_mask > 0, axis=1)
    last = mask.sum(axis=1) - 1
    positions = np.arange(1, states.shape[1] + 1, dtype=np.float64)[None, :, None] * real
    parts: list[F64] = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(states[np.arange(states.shape[0]), first])
        elif mode == "max":
            parts.append(np.where(real > 0, states, -np.inf).max(axis=1))
        elif mode == "mean":
            parts.append((states * real).sum(axis=1) / count)
        elif mode == "mean_sqrt_len_tokens":
            parts.append((states * real).sum(axis=1) / np.sqrt(count))
        elif mode == "weightedmean":
            weights = np.maximum(positions.sum(axis=1), 1e-9)
            parts.append((states * positions).sum(axis=1) / weights)
        elif mode == "lasttoken":
            parts.append(states[np.arange(states.shape[0]), last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return np.concatenate(parts, axis=1)


def numpy_encode(
    state: Mapping[str, npt.NDArray[np.float32]],
    config: BertConfig,
    batch: Batch,
    pooling: PoolingConfig | None = None,
    normalize: bool = True,
    dense: Sequence[DenseConfig] = (),
    prompt_length: int = 0,
) -> F64:
    """The encoder, pooling and (optionally) L2 normalisation in float64.

    Parameters
    ----------
    state
        The weights (names as :func:`~ferrograph.models.weights.expected_shapes`, and
        ``dense.N.*`` as :func:`~ferrograph.models.weights.load_dense_state` for Dense modules).
    config
        The BERT hyper-parameters.
    batch
        Token ids and attention mask.
    pooling
        Pooling modes (mean when ``None``).
    normalize
        L2-normalise the sentence vectors (a Normalize module, last).
    dense
        Dense modules applied after the pooling.
    prompt_length
        Leading tokens left out of the pooling (see :func:`numpy_pool`).

    Returns
    -------
    numpy.ndarray
        ``(batch, dim)``.
    """
    pooling = pooling or PoolingConfig()

    def w(name: str) -> F64:
        return np.asarray(state[name], dtype=np.float64)

    def layer_norm(x: F64, prefix: str) -> F64:
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        y: F64 = (x - mu) / np.sqrt(var + config.layer_norm_eps)
        return y * w(prefix + ".weight") + w(prefix + ".bias")

    def linear(x: F64, prefix: str) -> F64:
        y: F64 = x @ w(prefix + ".weight").T
        return y + w(prefix + ".bias")

    b, s = batch.shape
    heads, hd = config.num_attention_heads, config.head_dim
    x = w("embeddings.word_embeddings.weight")[batch.input_ids]
    x = x + w("embeddings.token_type_embeddings.weight")[batch.token_type_ids]
    x = x + w("embeddings.position_embeddings.weight")[:s][None]
    x = layer_norm(x, "embeddings.LayerNorm")
    real = batch.attention_mask.astype(np.float64)
    bias = np.where(real[:, None, None, :] > 0, 0.0, -np.inf)
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."

        def split(t: F64) -> F64:
            return np.ascontiguousarray(t.reshape(b, s, heads, hd).transpose(0, 2, 1, 3))

        q = split(linear(x, p + "attention.self.query"))
        k = split(linear(x, p + "attention.self.key"))
        v = split(linear(x, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + bias
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        merged = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        h = layer_norm(
            linear(merged, p + "attention.output.dense") + x, p + "attention.output.LayerNorm"
        )
        ff = activation(config.activation, linear(h, p + "intermediate.dense"))
        x = layer_norm(linear(ff, p + "output.dense") + h, p + "output.LayerNorm")
    pooled = numpy_pool(x, batch.attention_mask, pooling, prompt_length)
    for i, module in enumerate(dense):
        y = pooled @ w(f"dense.{i}.linear.weight").T
        if module.bias:
            y = y + w(f"dense.{i}.linear.bias")
        y = activation(module.activation, y)
        if module.residual:
            same = module.in_features == module.out_features
            y = y + (pooled if same else pooled @ w(f"dense.{i}.residual.weight").T)
        pooled = y
    if not normalize:
        return pooled
    norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    result: F64 = pooled / norms
    return result
