"""dtypes equal numpy's both ways, ``np.dtype(fg.float32)`` works, block types say they have
no numpy equivalent; ``dir(fg)`` and ``dir(fg.ops)`` list the API."""

from __future__ import annotations

import numpy as np
import pytest

import ferrograph as fg
from conftest import needs_ml_dtypes

PLAIN = {
    fg.float32: np.float32,
    fg.float16: np.float16,
    fg.int8: np.int8,
    fg.int16: np.int16,
    fg.int32: np.int32,
    fg.int64: np.int64,
}


@pytest.mark.parametrize(("ours", "theirs"), list(PLAIN.items()))
def test_plain_dtypes_equal_numpys_both_ways(ours: fg.DType, theirs: type) -> None:
    assert ours == theirs and theirs == ours
    assert ours == np.dtype(theirs) and np.dtype(theirs) == ours
    assert ours == np.dtype(theirs).name and ours == ours.name
    assert np.dtype(ours) == np.dtype(theirs)
    assert np.zeros(2, ours).dtype == np.dtype(theirs)
    assert hash(ours) == hash(np.dtype(theirs))
    assert ours != np.uint8 and ours == theirs
    others = [d for d in PLAIN.values() if d is not theirs]
    assert all(ours != o and o != ours for o in others)


def test_a_tensors_dtype_compares_with_numpy() -> None:
    t = fg.Context().new_tensor(fg.float32, (2,))
    assert t.dtype == np.float32
    assert t.dtype == np.dtype("float32")
    assert np.dtype(t.dtype) == np.float32
    assert t.dtype != np.float64 and t.dtype != "q8_0"
    assert t.dtype != object() and t.dtype != 3


@needs_ml_dtypes
def test_bf16_equals_ml_dtypes_bfloat16() -> None:
    import ml_dtypes

    assert fg.bfloat16 == ml_dtypes.bfloat16 and np.dtype(ml_dtypes.bfloat16) == fg.bfloat16
    assert np.dtype(fg.bfloat16) == np.dtype(ml_dtypes.bfloat16)
    assert fg.bfloat16 != np.uint16


@pytest.mark.parametrize("block", [fg.q8_0, fg.q4_0, fg.q4_K, fg.iq4_nl])
def test_block_types_say_they_have_no_numpy_equivalent(block: fg.DType) -> None:
    with pytest.raises(fg.DTypeError, match="no numpy equivalent"):
        np.dtype(block)
    with pytest.raises(fg.DTypeError, match="no numpy equivalent"):
        _ = block.dtype
    assert block != np.float32 and block == block.name
    assert {block: 1}[fg.DType(block.name)] == 1


def test_dir_lists_the_api_not_imported_modules() -> None:
    names = dir(fg)
    for private in ("np", "os", "sys", "npt", "logging", "Any"):
        assert private not in names
    for public in ("Tensor", "Context", "ops", "float32", "StaleTensorError", "models"):
        assert public in names
    op_names = dir(fg.ops)
    for private in ("np", "functools", "Parameter", "Signature", "Callable", "signature"):
        assert private not in op_names
    assert "matmul" in op_names and "mul_mat" in op_names and "add" in op_names
    assert set(op_names) == set(fg.ops.__all__)
