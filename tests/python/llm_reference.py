"""A float64 numpy forward pass of a LLaMA-family decoder (the test oracle of test_llm.py).

Weights are a dict of numpy arrays in numpy order (``attn_q.weight`` is ``(n_head * hd, d)``);
the whole prompt is evaluated at once with a causal mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


def _angles(pos: npt.NDArray[Any], n_rot: int, base: float) -> tuple[F64, F64]:
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]


def rope_normal(x: F64, pos: npt.NDArray[Any], n_rot: int, base: float) -> F64:
    """Rotates the pairs (2i, 2i+1) of the first ``n_rot`` dims of ``x`` (tokens, heads, hd)."""
    out = x.copy()
    c, s = _angles(pos, n_rot, base)
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = x0 * c - x1 * s
    out[..., 1:n_rot:2] = x0 * s + x1 * c
    return out


def rope_neox(x: F64, pos: npt.NDArray[Any], n_rot: int, base: float) -> F64:
    """Rotates the pairs (i, i + n_rot/2) of the first ``n_rot`` dims of ``x``."""
    out = x.copy()
    half = n_rot // 2
    c, s = _angles(pos, n_rot, base)
    x0, x1 = x[..., :half], x[..., half:n_rot]
    out[..., :half] = x0 * c - x1 * s
    out[..., half:n_rot] = x0 * s + x1 * c
    return out


def forward(weights: dict[str, F64], cfg: dict[str, Any], tokens: npt.NDArray[Any]) -> F64:
    """Logits ``(len(tokens), vocab)`` of every position."""
    n = len(tokens)
    pos = np.arange(n)
    x = weights["token_embd.weight"][tokens]
    eps = cfg["eps"]
    heads, heads_kv, hd = cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
    rope = rope_neox if cfg.get("neox") else rope_normal
    causal = np.tril(np.ones((n, n), bool))

    def rms(v: F64, w: F64) -> F64:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def lin(name: str, v: F64) -> F64:
        y = v @ weights[name + ".weight"].T
        b = weights.get(name + ".bias")
        return y + b if b is not None else y

    for i in range(cfg["n_layer"]):
        p = f"blk.{i}."
        h = rms(x, weights[p + "attn_norm.weight"])
        q = lin(p + "attn_q", h).reshape(n, heads, hd)
        k = lin(p + "attn_k", h).reshape(n, heads_kv, hd)
        # qwen3: RMS norms over each head's values before RoPE
        if p + "attn_q_norm.weight" in weights:
            q = rms(q, weights[p + "attn_q_norm.weight"])
            k = rms(k, weights[p + "attn_k_norm.weight"])
        q = rope(q, pos, cfg["n_rot"], cfg["base"])
        k = rope(k, pos, cfg["n_rot"], cfg["base"])
        v = lin(p + "attn_v", h).reshape(n, heads_kv, hd)
        group = heads // heads_kv
        out = np.empty((n, heads, hd))
        for head in range(heads):
            kk, vv = k[:, head // group], v[:, head // group]
            s = np.where(causal, q[:, head] @ kk.T / np.sqrt(hd), -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            out[:, head] = s @ vv
        x = x + lin(p + "attn_output", out.reshape(n, heads * hd))
        h = rms(x, weights[p + "ffn_norm.weight"])
        gate, up = lin(p + "ffn_gate", h), lin(p + "ffn_up", h)
        x = x + lin(p + "ffn_down", gate / (1 + np.exp(-gate)) * up)
    x = rms(x, weights["output_norm.weight"])
    out_w = weights.get("output.weight", weights["token_embd.weight"])
    logits: F64 = x @ out_w.T
    return logits
