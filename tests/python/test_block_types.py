"""ggml's block types against the `gguf` package's numpy reference (bit for bit), ggml's own
quantization error limits (test-quantize-fns), the CPU type traits' dot products, and hostile
inputs to the codecs."""

from __future__ import annotations

import numpy as np
import pytest

import ferrograph as fg
from block_bytes import put_f16_scale

gguf_quants = pytest.importorskip("gguf.quants", reason="pip install gguf (the reference)")
from gguf import GGMLQuantizationType  # noqa: E402

# every block type gguf can dequantize, with its gguf id
DEQUANT_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_K", "q3_K", "q4_K", "q5_K"]
DEQUANT_TYPES += ["q6_K", "iq4_nl", "iq4_xs"]
# the i-quants below 4 bits: read and multiplied, never written (ggml has no from_float for them)
READ_ONLY_TYPES = ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]
DEQUANT_TYPES += [*READ_ONLY_TYPES, "tq1_0", "tq2_0", "mxfp4", "nvfp4"]
# the ones gguf also quantizes (its quantizers port ggml's reference ones)
QUANT_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "tq1_0", "tq2_0", "mxfp4"]
# test-quantize-fns: limits on sqrt(Σ(x−x̂)²)/n and |dot − dot_ref|/n on its synthetic row
ERROR_LIMIT = {"q2_K": 0.0075, "q3_K": 0.0040, "tq1_0": 0.01, "tq2_0": 0.01}
ERROR_LIMIT |= {"mxfp4": 0.003, "nvfp4": 0.003, "q1_0": 0.025, "q2_0": 0.01}
DOT_LIMIT = {"q2_K": 0.04, "q3_K": 0.04, "iq4_nl": 0.04, "iq4_xs": 0.04, "tq1_0": 0.15}
DOT_LIMIT |= {"tq2_0": 0.15, "mxfp4": 0.03, "nvfp4": 0.03, "q1_0": 0.40, "q2_0": 0.15}


def gguf_type(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def reference_dequantize(raw: np.ndarray, name: str, n: int) -> np.ndarray:
    dt = fg.DType(name)
    rows = raw.reshape(-1, dt.type_size)
    with np.errstate(over="ignore"):  # random MXFP4 exponents reach f32's largest powers
        out = gguf_quants.dequantize(rows, gguf_type(name))
    return np.asarray(out, dtype=np.float32).reshape(-1)[:n]


def synthetic(n: int, offset: float) -> np.ndarray:
    return (0.1 + 2 * np.cos(np.arange(n) + offset)).astype(np.float32)


@pytest.mark.parametrize("name", [t for t in DEQUANT_TYPES if t not in READ_ONLY_TYPES])
def test_dequantize_equals_gguf_on_quantized_data(name: str) -> None:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    x = (rng.standard_normal(8 * 256) * rng.uniform(0.01, 10)).astype(np.float32)
    q = fg.quantize(x, name)
    dt = fg.DType(name)
    assert q.dtype == np.uint8 and q.size == dt.type_size * x.size // dt.block_size
    got = fg.dequantize(q, name, x.size)
    want = reference_dequantize(q, name, x.size)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def random_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Every bit pattern of quants and sub-block scales; the f16/f32 super-scales are made
    finite (NaN payloads are not compared)."""
    dt = fg.DType(name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, dt.type_size), dtype=np.uint8)
    # finite f16 scales where the layout puts them (d/dmin first for most types, last for
    # q2_K/q3_K/q6_K and the ternary types); written through the views below
    scales = rng.uniform(-2, 2, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if name in ("q2_K",):
        raw[:, -4:] = scales
    elif name in ("q3_K", "q6_K", "tq1_0", "tq2_0"):
        raw[:, -2:] = scales[:, :2]
    elif name == "iq1_m":
        put_f16_scale(raw, name, scales[:, :2].copy().view(np.uint16).reshape(-1))
    else:
        # d (and dmin/m) lead; where only d is a scale, the next two bytes are data anyway
        raw[:, :4] = scales
    return raw.reshape(-1)


@pytest.mark.parametrize("name", DEQUANT_TYPES)
def test_dequantize_equals_gguf_on_random_bytes(name: str) -> None:
    dt = fg.DType(name)
    n_blocks = 64
    flat = random_blocks(name, n_blocks, 7)
    n = n_blocks * dt.block_size
    got = fg.dequantize(flat, name, n)
    want = reference_dequantize(flat, name, n)
    ok = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), ok)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_quantize_equals_gguf(name: str) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 512)) * 3).astype(np.float32)
    x[0, :32] = 0.5  # a constant block
    x[1, 5] = 100.0  # an outlier
    x[2, :32] = -np.abs(x[2, :32])  # all negative
    got = fg.quantize(x, name).reshape(16, -1)
    want = gguf_quants.quantize(x, gguf_type(name))
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "name",
    [
        "q4_1",
        "q5_0",
        "q5_1",
        "q2_K",
        "q3_K",
        "q4_K",
        "q5_K",
        "q6_K",
        "iq4_nl",
        "iq4_xs",
        "tq1_0",
        "tq2_0",
        "mxfp4",
        "nvfp4",
        "q1_0",
        "q2_0",
    ],
)
def test_quantization_error_within_ggml_limits(name: str) -> None:
    n = 32 * 128
    x = synthetic(n, 0.0)
    back = fg.dequantize(fg.quantize(x, name), name, n)
    total = float(np.sqrt(np.sum((x.astype(np.float64) - back) ** 2)) / n)
    assert total < ERROR_LIMIT.get(name, 0.002), total
    # the dot product against the activation partner type (test-quantize-fns' vec_dot check)
    traits = fg.cpu.type_traits(name)
    assert traits.has_from_float and traits.has_vec_dot
    y = synthetic(n, 1.0)
    qx = traits.from_float(x)
    qy = fg.cpu.type_traits(traits.vec_dot_type).from_float(y)
    got = traits.vec_dot(qx, qy, n)
    want = float(np.dot(x.astype(np.float64), y))
    assert abs(got - want) / n < DOT_LIMIT.get(name, 0.02)


def test_partner_types() -> None:
    partner = {t: fg.cpu.type_traits(t).vec_dot_type.name for t in DEQUANT_TYPES}
    assert partner["q4_1"] == partner["q5_1"] == "q8_1"
    assert partner["q5_0"] == partner["iq4_nl"] == partner["q4_0"] == "q8_0"
    for k in ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"):
        assert partner[k] == "q8_K"
    for act in ("q8_1", "q8_K"):
        t = fg.cpu.type_traits(act)
        assert t.has_from_float and not t.has_vec_dot
    for k in [*READ_ONLY_TYPES, "tq1_0", "tq2_0"]:
        assert partner[k] == "q8_K", k
    for k in ("mxfp4", "nvfp4", "q1_0", "q2_0"):
        assert fg.cpu.type_traits(k).vec_dot_type.name == "q8_0", k


@pytest.mark.parametrize("name", READ_ONLY_TYPES)
def test_read_only_types_multiply_but_do_not_quantize(name: str) -> None:
    """The i-quants below 4 bits: a dot product and decoding, but no quantizer — quantizing
    raises a documented error naming the type, as ggml's CPU backend has no from_float."""
    traits = fg.cpu.type_traits(name)
    assert traits.has_vec_dot and not traits.has_from_float
    x = np.ones(256, np.float32)
    with pytest.raises(fg.Error, match=name):
        fg.quantize(x, name)


def test_q8_1_and_q8_k_layouts() -> None:
    x = synthetic(512, 0.3)
    q = fg.quantize(x, "q8_1").reshape(-1, 36)
    d = q[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    s = q[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    qs = q[:, 4:].view(np.int8).astype(np.int64)
    assert np.allclose(s, d * qs.sum(axis=1), rtol=2e-3, atol=1e-3)
    k = fg.quantize(x, "q8_K").reshape(-1, 292)
    dk = k[:, 0:4].copy().view(np.float32)[:, 0]
    qk = k[:, 4:260].view(np.int8).astype(np.int64)
    bsums = k[:, 260:292].copy().view(np.int16)
    assert np.array_equal(bsums, qk.reshape(-1, 16, 16).sum(axis=2))
    assert np.abs(qk * dk[:, None] - x.reshape(-1, 256)).max() <= np.abs(dk).max() * 0.5 + 1e-6
    assert np.array_equal(
        fg.dequantize(k.reshape(-1), "q8_K", 512), (qk * dk[:, None]).reshape(-1).astype(np.float32)
    )


@pytest.mark.parametrize("name", [*DEQUANT_TYPES, "q8_1", "q8_K"])
def test_codecs_refuse_bad_lengths(name: str) -> None:
    dt = fg.DType(name)
    with pytest.raises(fg.ShapeError):
        fg.quantize(np.ones(dt.block_size + 1, np.float32), name)
    with pytest.raises(fg.ShapeError):
        fg.dequantize(np.zeros(dt.type_size - 1, np.uint8), name, dt.block_size)
    with pytest.raises(fg.ShapeError):
        fg.dequantize(np.zeros(dt.type_size, np.uint8), name, 2**62)
    # non-finite input quantizes without a crash (a type without a quantizer refuses any input)
    x = np.full(dt.block_size, np.nan, np.float32)
    x[1] = np.inf
    if name in READ_ONLY_TYPES:
        with pytest.raises(fg.UnsupportedOpError, match=name):
            fg.quantize(x, name)
    else:
        fg.quantize(x, name)


@pytest.mark.parametrize("name", DEQUANT_TYPES)
def test_tensors_of_block_types_compute(name: str) -> None:
    """A MUL_MAT with the type as weights and one, two and 40 columns agrees with numpy on the
    dequantized weights; GET_ROWS dequantizes the chosen rows."""
    dt = fg.DType(name)
    k = 2 * max(dt.block_size, 32)
    rng = np.random.default_rng(11)
    w = rng.standard_normal((24, k)).astype(np.float32)
    if name in READ_ONLY_TYPES:
        raw = random_blocks(name, 24 * k // dt.block_size, 11)
    else:
        raw = fg.quantize(w, name).reshape(-1)
    wq = fg.dequantize(raw, name, w.size).reshape(w.shape)
    for n in (1, 2, 40):
        ctx = fg.Context(no_alloc=False)
        a = ctx.new_tensor(dt, (24, k))
        b = ctx.new_tensor(fg.float32, (n, k))
        fg.tensor_set(a, raw)
        x = rng.standard_normal((n, k)).astype(np.float32)
        b.set(x)
        out = fg.ops.mul_mat(a, b, ctx=ctx)
        fg.graph_compute_with_ctx(fg.Graph.build(out), n_threads=2)
        want = x.astype(np.float64) @ wq.T.astype(np.float64)
        err = np.abs(out.numpy() - want).max() / np.abs(want).max()
        assert err < 0.02, (name, n, err)
    ctx = fg.Context(no_alloc=False)
    a = ctx.new_tensor(dt, (24, k))
    fg.tensor_set(a, raw)
    ids = ctx.new_tensor(fg.int32, (3,))
    ids.set(np.array([5, 0, 23], np.int32))
    rows = fg.ops.get_rows(a, ids, ctx=ctx)
    fg.graph_compute_with_ctx(fg.Graph.build(rows), n_threads=1)
    assert np.array_equal(rows.numpy(), wq[[5, 0, 23]])
