"""Element types.

``DType(spec)`` returns the singleton for any accepted spelling: ggml's short names (``"f16"``),
numpy's (``"float16"``), numpy types and dtypes (``np.float16``, ``np.dtype("float16")``),
``ml_dtypes.bfloat16``, or a ``DType``::

    >>> import numpy as np, ferrograph as fg
    >>> fg.DType("f16") is fg.DType(np.float16) is fg.float16
    True
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import numpy as np

from . import _core
from .errors import DTypeError

__all__ = [
    "DType",
    "bf16",
    "bfloat16",
    "f16",
    "f32",
    "f64",
    "float16",
    "float32",
    "float64",
    "i8",
    "i16",
    "i32",
    "i64",
    "int8",
    "int16",
    "int32",
    "int64",
    "iq1_m",
    "iq1_s",
    "iq2_s",
    "iq2_xs",
    "iq2_xxs",
    "iq3_s",
    "iq3_xxs",
    "iq4_nl",
    "iq4_xs",
    "mxfp4",
    "nvfp4",
    "q1_0",
    "q2_0",
    "q2_K",
    "q3_K",
    "q4_0",
    "q4_1",
    "q4_K",
    "q5_0",
    "q5_1",
    "q5_K",
    "q6_K",
    "q8_0",
    "q8_1",
    "q8_K",
    "tq1_0",
    "tq2_0",
]


def _bf16_numpy_dtype() -> np.dtype[Any]:
    try:
        import ml_dtypes
    except ImportError:
        return np.dtype(np.uint16)
    bf16_dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16_dtype


class DType:
    """An element type: a singleton per type (compare with ``is`` or ``==``).

    Attributes
    ----------
    name : str
        ggml's short name (``"f32"``, ``"q8_0"``).
    numpy_dtype : numpy.dtype or None
        The numpy dtype of the elements; bf16 is ``ml_dtypes.bfloat16`` when that package is
        installed, else ``uint16`` bit patterns; ``None`` for block-quantized types.
    type_size : int
        Bytes per block (per element for plain types).
    block_size : int
        Elements per block (1 for plain types).
    is_quantized : bool
        Whether values are stored in quantized blocks.
    """

    __slots__ = ("_long_name", "block_size", "is_quantized", "name", "numpy_dtype", "type_size")

    _registry: ClassVar[dict[str, DType]] = {}

    name: str
    numpy_dtype: np.dtype[Any] | None
    type_size: int
    block_size: int
    is_quantized: bool
    _long_name: str

    def __new__(cls, spec: object) -> DType:
        if isinstance(spec, DType):
            return spec
        if not cls._registry:
            _create_singletons()
        name = _core.dtype_info(spec)[0]  # type: ignore[arg-type]  # any spelling; checked natively
        return cls._registry[name]

    @classmethod
    def _make(cls, name: str) -> DType:
        self = object.__new__(cls)
        short, numpy_name, type_size, block_size, is_quantized = _core.dtype_info(name)
        self.name = short
        self.type_size = type_size
        self.block_size = block_size
        self.is_quantized = is_quantized
        self._long_name = numpy_name if numpy_name is not None else short
        if numpy_name is None:
            self.numpy_dtype = None
        elif numpy_name == "bfloat16":
            self.numpy_dtype = _bf16_numpy_dtype()
        else:
            self.numpy_dtype = np.dtype(numpy_name)
        return self

    @property
    def dtype(self) -> np.dtype[Any]:
        """The equivalent numpy dtype, so ``np.dtype(fg.float32)`` works (numpy reads this
        attribute). Block-quantized types have none: DTypeError says so; bf16 needs the
        ``ml_dtypes`` package."""
        if self.is_quantized:
            raise DTypeError(
                f"{self.name} is a block-quantized type ({self.block_size} values in "
                f"{self.type_size} bytes) with no numpy equivalent; its tensors read as float32"
            )
        if self.name == "bf16" and self.numpy_dtype is not None and self.numpy_dtype.kind == "u":
            raise DTypeError(
                "bf16 has a numpy equivalent only with the ml_dtypes package (pip install "
                "ml_dtypes); without it bf16 tensors read as uint16 bit patterns"
            )
        assert self.numpy_dtype is not None
        return self.numpy_dtype

    def __eq__(self, other: object) -> bool:
        """Equal to itself and to every spelling of the same type: numpy types and dtypes
        (``np.float32``, ``np.dtype("float32")``), names (``"f32"``, ``"float32"``)."""
        if isinstance(other, DType):
            return other is self
        try:
            return DType(other) is self
        except (TypeError, ValueError):
            return False

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        # Equal to numpy's dtype hash where there is one, so sets and dicts agree with ==.
        if self.numpy_dtype is not None and not self.is_quantized:
            return hash(self.numpy_dtype)
        return hash(self.name)

    @property
    def __ferrograph_dtype__(self) -> str:
        """The name the native module resolves (any object with it is taken as this dtype)."""
        return self.name

    def row_size(self, n: int) -> int:
        """Bytes taken by a row of ``n`` elements (ShapeError unless whole blocks)."""
        return _core.dtype_row_size(self.name, n)

    def __repr__(self) -> str:
        return f"fg.{self._long_name}"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[type[DType], tuple[str]]:
        return (DType, (self.name,))

    def __copy__(self) -> DType:
        return self

    def __deepcopy__(self, memo: object) -> DType:
        return self


def _create_singletons() -> None:
    for name in _core.dtype_names():
        DType._registry[name] = DType._make(name)


_create_singletons()

float32: Final = DType("f32")
float16: Final = DType("f16")
bfloat16: Final = DType("bf16")
int8: Final = DType("i8")
int16: Final = DType("i16")
int32: Final = DType("i32")
int64: Final = DType("i64")
q8_0: Final = DType("q8_0")
q4_0: Final = DType("q4_0")
q4_1: Final = DType("q4_1")
q5_0: Final = DType("q5_0")
q5_1: Final = DType("q5_1")
q8_1: Final = DType("q8_1")
q2_K: Final = DType("q2_K")  # noqa: N816 (ggml spells the K-quants with a capital K)
q3_K: Final = DType("q3_K")  # noqa: N816 (ggml spells the K-quants with a capital K)
q4_K: Final = DType("q4_K")  # noqa: N816 (ggml spells the K-quants with a capital K)
q5_K: Final = DType("q5_K")  # noqa: N816 (ggml spells the K-quants with a capital K)
q6_K: Final = DType("q6_K")  # noqa: N816 (ggml spells the K-quants with a capital K)
q8_K: Final = DType("q8_K")  # noqa: N816 (ggml spells the K-quants with a capital K)
iq4_nl: Final = DType("iq4_nl")
iq4_xs: Final = DType("iq4_xs")
float64: Final = DType("f64")
iq2_xxs: Final = DType("iq2_xxs")
iq2_xs: Final = DType("iq2_xs")
iq2_s: Final = DType("iq2_s")
iq3_xxs: Final = DType("iq3_xxs")
iq3_s: Final = DType("iq3_s")
iq1_s: Final = DType("iq1_s")
iq1_m: Final = DType("iq1_m")
tq1_0: Final = DType("tq1_0")
tq2_0: Final = DType("tq2_0")
mxfp4: Final = DType("mxfp4")
nvfp4: Final = DType("nvfp4")
q1_0: Final = DType("q1_0")
q2_0: Final = DType("q2_0")

# ggml-style aliases.
f32: Final = float32
f16: Final = float16
bf16: Final = bfloat16
i8: Final = int8
i16: Final = int16
i32: Final = int32
i64: Final = int64
f64: Final = float64
