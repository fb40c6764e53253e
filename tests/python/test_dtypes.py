from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import ferrograph as fg

SPELLINGS: dict[fg.DType, list[object]] = {
    fg.float32: ["f32", "float32", "F32", np.float32, np.dtype("float32"), "fp32"],
    fg.float16: ["f16", "float16", "half", np.float16, np.dtype(np.float16)],
    fg.bfloat16: ["bf16", "bfloat16"],
    fg.int8: ["i8", "int8", np.int8],
    fg.int16: ["i16", "int16", np.int16],
    fg.int32: ["i32", "int32", np.int32],
    fg.int64: ["i64", "int64", np.int64],
    fg.q8_0: ["q8_0", "Q8_0"],
    fg.q4_0: ["q4_0"],
}


@pytest.mark.parametrize("dtype", list(SPELLINGS))
def test_every_spelling_gives_the_singleton(dtype: fg.DType) -> None:
    for spelling in SPELLINGS[dtype]:
        assert fg.DType(spelling) is dtype, spelling
    assert fg.DType(dtype) is dtype
    assert fg.DType(dtype.name) is dtype


def test_brief_examples() -> None:
    assert fg.DType("f16") is fg.float16
    assert fg.DType("float16") is fg.float16
    assert fg.DType(np.float16) is fg.float16
    assert fg.f32 is fg.float32 and fg.f16 is fg.float16
    assert fg.bf16 is fg.bfloat16 and fg.i32 is fg.int32


def test_ml_dtypes_bfloat16_spelling() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed")
    assert fg.DType(ml_dtypes.bfloat16) is fg.bfloat16
    assert fg.bfloat16.numpy_dtype == np.dtype(ml_dtypes.bfloat16)


def test_attributes() -> None:
    assert fg.float32.name == "f32"
    assert fg.float32.numpy_dtype == np.dtype(np.float32)
    assert (fg.float32.type_size, fg.float32.block_size) == (4, 1)
    assert not fg.float32.is_quantized
    assert fg.q8_0.numpy_dtype is None and fg.q8_0.is_quantized
    assert (fg.q8_0.type_size, fg.q8_0.block_size) == (34, 32)
    assert (fg.q4_0.type_size, fg.q4_0.block_size) == (18, 32)
    assert fg.q4_0.row_size(64) == 36
    assert fg.float16.row_size(10) == 20
    with pytest.raises(fg.ShapeError):
        fg.q8_0.row_size(33)


def test_repr_str_and_copies() -> None:
    assert repr(fg.float16) == "fg.float16"
    assert repr(fg.q8_0) == "fg.q8_0"
    assert str(fg.float16) == "f16"
    assert pickle.loads(pickle.dumps(fg.float16)) is fg.float16
    assert copy.deepcopy(fg.q4_0) is fg.q4_0


@pytest.mark.parametrize("bad", ["complex64", "float128", np.complex128, 3, object()])
def test_unknown_dtypes_raise_dtype_error(bad: object) -> None:
    with pytest.raises(fg.DTypeError):
        fg.DType(bad)
    with pytest.raises(TypeError):  # DTypeError is a TypeError too
        fg.DType(bad)
