from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrograph as fg
from conftest import needs_ml_dtypes


def _bits32(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.uint32).view(np.float32)


# ----- f16 -----


def test_all_f16_patterns_to_f32_match_numpy() -> None:
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = fg.fp16_to_fp32(h)
    want = h.astype(np.float32)
    assert got.dtype == np.float32 and got.shape == h.shape
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


F32_EDGES = [
    0x00000000,
    0x80000000,  # ±0
    0x7F800000,
    0xFF800000,  # ±inf
    0x7FC00000,
    0xFFC00000,
    0x7F800001,  # NaNs
    0x00000001,
    0x807FFFFF,  # f32 subnormals
    0x33800000,
    0x33000000,
    0x33000001,
    0x337FFFFF,  # around the smallest f16 subnormal
    0x387FC000,
    0x38800000,  # f16 subnormal / normal boundary
    0x477FE000,
    0x477FEFFF,
    0x477FF000,
    0x47800000,  # around f16 max / overflow
    0x3F801000,
    0x3F803000,
    0x3F801001,
    0x3F802FFF,  # halfway cases (ties to even)
    0x3F800000,
    0xBF800000,
    0x40490FDB,
]


def _check_f32_to_f16(x: np.ndarray) -> None:
    got = fg.fp32_to_fp16(x)
    want = x.astype(np.float16)
    assert got.dtype == np.float16
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


def test_f32_to_f16_edge_values_bit_exact() -> None:
    with np.errstate(over="ignore"):
        _check_f32_to_f16(_bits32(F32_EDGES))


def test_f32_to_f16_random_bit_patterns(rng: np.random.Generator) -> None:
    x = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        _check_f32_to_f16(x)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_f32_to_f16_property(bits: list[int]) -> None:
    with np.errstate(over="ignore", invalid="ignore"):
        _check_f32_to_f16(_bits32(bits))


def test_f16_round_trip_keeps_shape() -> None:
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    h = fg.fp32_to_fp16(x)
    assert h.shape == (2, 3, 4)
    np.testing.assert_array_equal(fg.fp16_to_fp32(h), h.astype(np.float32))


def test_non_contiguous_input_and_lists() -> None:
    x = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(fg.fp32_to_fp16(x), x.astype(np.float16))
    np.testing.assert_array_equal(fg.fp32_to_fp16([1.0, 2.5]), np.array([1, 2.5], np.float16))


def test_large_conversion_releases_the_interpreter() -> None:
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    np.testing.assert_array_equal(fg.fp32_to_fp16(x), x.astype(np.float16))


# ----- bf16 -----


@needs_ml_dtypes
def test_f32_to_bf16_matches_ml_dtypes(rng: np.random.Generator) -> None:
    import ml_dtypes

    x = np.concatenate(
        [
            _bits32(F32_EDGES),
            rng.integers(0, 2**32, size=1 << 16, dtype=np.uint64)
            .astype(np.uint32)
            .view(np.float32),
            _bits32([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF]),  # ties
        ]
    )
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    for function in (fg.fp32_to_bf16, fg.fp32_to_bf16_ref):
        got = function(x)
        assert got.dtype == np.dtype(ml_dtypes.bfloat16)
        nan = np.isnan(x)
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


@needs_ml_dtypes
def test_bf16_to_f32_all_patterns() -> None:
    import ml_dtypes

    b = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = b.view(ml_dtypes.bfloat16).astype(np.float32)
    for source in (b, b.view(ml_dtypes.bfloat16)):
        got = fg.bf16_to_fp32(source)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_bf16_bits_are_the_top_half() -> None:
    x = np.array([1.0, -2.0, 0.5], np.float32)
    bits = fg.fp32_to_bf16(x).view(np.uint16)
    np.testing.assert_array_equal(bits, (x.view(np.uint32) >> 16).astype(np.uint16))
    out = np.empty(3, np.uint16)
    assert fg.fp32_to_bf16(x, out=out) is out
    np.testing.assert_array_equal(fg.bf16_to_fp32(out), x)


# ----- i32 -----


def test_fp32_to_i32() -> None:
    x = np.array([0.0, 1.9, -1.9, 1e6, -7.0], np.float32)
    got = fg.fp32_to_i32(x)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, x.astype(np.int32))


# ----- out= -----


def test_out_is_filled_and_returned() -> None:
    x = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    out = np.empty((3, 4), np.float16)
    assert fg.fp32_to_fp16(x, out=out) is out
    np.testing.assert_array_equal(out, x.astype(np.float16))
    back = np.empty((3, 4), np.float32)
    assert fg.fp16_to_fp32(out, out=back) is back


def test_out_errors() -> None:
    x = np.ones((3, 4), np.float32)
    with pytest.raises(fg.DTypeError):
        fg.fp32_to_fp16(x, out=np.empty((3, 4), np.float32))
    with pytest.raises(fg.ShapeError):
        fg.fp32_to_fp16(x, out=np.empty((4, 3), np.float16))
    with pytest.raises(fg.ShapeError):
        fg.fp32_to_fp16(x, out=np.empty(12, np.float16))
    with pytest.raises(fg.ShapeError):
        fg.fp32_to_fp16(x, out=np.empty((3, 8), np.float16)[:, ::2])
    readonly = np.empty((3, 4), np.float16)
    readonly.flags.writeable = False
    with pytest.raises(fg.InvalidArgumentError):
        fg.fp32_to_fp16(x, out=readonly)
    with pytest.raises(fg.DTypeError):
        fg.fp32_to_fp16(x, out=[0.0] * 12)  # type: ignore[arg-type]


def test_input_dtype_errors() -> None:
    with pytest.raises(fg.DTypeError):
        fg.fp32_to_fp16(np.ones(4, np.float64))
    with pytest.raises(fg.DTypeError):
        fg.fp16_to_fp32(np.ones(4, np.float32))
    with pytest.raises(fg.DTypeError):
        fg.bf16_to_fp32(np.ones(4, np.int16))


# ----- quantization -----


@pytest.mark.parametrize("dtype", [fg.q8_0, fg.q4_0])
def test_quantize_round_trip_within_one_step(dtype: fg.DType, rng: np.random.Generator) -> None:
    x = rng.standard_normal(32 * 64).astype(np.float32) * rng.uniform(0.1, 10)
    data = fg.quantize(x, dtype)
    assert data.dtype == np.uint8 and data.shape == (dtype.row_size(x.size),)
    back = fg.dequantize(data, dtype, x.size)
    assert back.dtype == np.float32 and back.shape == x.shape
    levels = 127 if dtype is fg.q8_0 else 8
    blocks = x.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / levels
    err = np.abs(back.reshape(-1, 32) - blocks)
    assert np.all(err <= step * 1.01 + 1e-6)


def test_quantize_errors() -> None:
    with pytest.raises(fg.ShapeError):
        fg.quantize(np.ones(33, np.float32), fg.q8_0)
    with pytest.raises(fg.DTypeError):
        fg.quantize(np.ones(32, np.int32), "q8_0")
    with pytest.raises(fg.ShapeError):
        fg.dequantize(np.zeros(33, np.uint8), fg.q8_0, 32)
    with pytest.raises(fg.DTypeError):
        fg.dequantize(np.zeros(34, np.float32), fg.q8_0, 32)


def test_quantize_plain_types_encode_bytes() -> None:
    x = np.array([1.0, -2.0], np.float32)
    np.testing.assert_array_equal(fg.quantize(x, fg.float16), x.astype(np.float16).view(np.uint8))
    np.testing.assert_array_equal(fg.dequantize(fg.quantize(x, "f16"), "f16", 2), x)
