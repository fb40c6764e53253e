"""The per-op profile: ``Scheduler.graph_compute(g, profile=True)``, ``fg.Profile``, the
sentence encoder's ``encode(..., profile=True)`` and ``python -m ferrograph embed --profile``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import ferrograph as fg
from ferrograph.__main__ import main
from ferrograph.models import SentenceEncoder
from ferrograph.plugins import NumpyRegistration
from test_sentence_encoder import SPECS, write_model


@pytest.fixture
def cpu() -> fg.Backend:
    return fg.init_backend("CPU", n_threads=2)


@pytest.fixture
def npb() -> Iterator[fg.Backend]:
    fg.register_backend(NumpyRegistration("NPPROFILE"))
    try:
        yield fg.init_backend("NPPROFILE")
    finally:
        fg.unregister_backend("NPPROFILE")


def _graph() -> tuple[fg.Graph, fg.Tensor, fg.Tensor, fg.Tensor]:
    """x (8, 16) -> mul_mat(w, x) -> relu -> scale -> add(., relu): known ops and names."""
    ctx = fg.Context()
    w = ctx.new_tensor(fg.float32, (12, 16), name="w")
    x = ctx.new_tensor(fg.float32, (8, 16), name="x")
    w.set_input()
    x.set_input()
    with ctx:
        p = fg.ops.mul_mat(w, x)
        p.name = "prod"
        r = fg.ops.relu(p)
        r.name = "act"
        s = fg.ops.scale(r, 0.5)
        s.name = "half"
        y = fg.ops.add(s, r)
        y.name = "out"
    y.set_output()
    return fg.Graph.build(y), w, x, y


def _run(sched: fg.Scheduler, rng: np.random.Generator) -> tuple[fg.Profile, float, np.ndarray]:
    g, w, x, y = _graph()
    sched.alloc_graph(g)
    wn = rng.standard_normal((12, 16)).astype(np.float32)
    xn = rng.standard_normal((8, 16)).astype(np.float32)
    w.set(wn)
    x.set(xn)
    start = time.perf_counter()
    profile = sched.graph_compute(g, profile=True)
    wall = time.perf_counter() - start
    assert profile is not None
    r = np.maximum(xn @ wn.T, 0)
    np.testing.assert_allclose(y.numpy(), r * 1.5, rtol=1e-5, atol=1e-5)
    return profile, wall, y.numpy()


def test_profile_names_ops_counts_and_times(cpu: fg.Backend, rng: np.random.Generator) -> None:
    profile, wall, _ = _run(fg.Scheduler([cpu]), rng)
    nodes = profile.nodes
    assert [(n["index"], n["name"], n["op"]) for n in nodes] == [
        (0, "prod", "MUL_MAT"),
        (1, "act", "RELU"),
        (2, "half", "SCALE"),
        (3, "out", "ADD"),
    ]
    assert all(n["shape"] == (8, 12) and n["backend"] == "CPU" for n in nodes)
    assert all(n["seconds"] >= 0 for n in nodes)
    assert profile.node_seconds == pytest.approx(sum(n["seconds"] for n in nodes))
    assert profile.node_seconds <= profile.total_seconds <= wall
    assert {op: t["count"] for op, t in profile.ops.items()} == {
        "MUL_MAT": 1,
        "RELU": 1,
        "SCALE": 1,
        "ADD": 1,
    }
    secs = [t["seconds"] for t in profile.ops.values()]
    assert secs == sorted(secs, reverse=True)
    top = profile.top(2)
    assert len(top) == 2 and top[0]["seconds"] >= top[1]["seconds"]
    assert top[0]["seconds"] == max(n["seconds"] for n in nodes)
    d = profile.to_dict()
    assert set(d) == {"total_seconds", "node_seconds", "ops", "nodes"}
    assert d["nodes"] == nodes and len(profile) == 4
    text = str(profile)
    for word in ("MUL_MAT", "RELU", "SCALE", "ADD", "prod", "act", "half", "out", "CPU"):
        assert word in text
    assert "4 nodes" in text and "4 nodes" in repr(profile)
    assert profile.table(top=1).count("\n") < text.count("\n")


def test_profile_off_gives_none_and_the_same_bits(
    cpu: fg.Backend, rng: np.random.Generator
) -> None:
    sched = fg.Scheduler([cpu])
    _, _, profiled = _run(sched, np.random.default_rng(7))
    g, w, x, y = _graph()
    sched.alloc_graph(g)
    again = np.random.default_rng(7)
    w.set(again.standard_normal((12, 16)).astype(np.float32))
    x.set(again.standard_normal((8, 16)).astype(np.float32))
    assert sched.graph_compute(g) is None
    np.testing.assert_array_equal(y.numpy(), profiled)
    assert sched.graph_compute(g, profile=False) is None


def test_profile_across_backends_and_sum(
    cpu: fg.Backend, npb: fg.Backend, rng: np.random.Generator
) -> None:
    g, w, x, _ = _graph()
    sched = fg.Scheduler([npb, cpu])
    half = g.get_tensor("half")
    assert half is not None
    sched.set_tensor_backend(half, npb)
    sched.alloc_graph(g)
    w.set(rng.standard_normal((12, 16)).astype(np.float32))
    x.set(rng.standard_normal((8, 16)).astype(np.float32))
    profile = sched.graph_compute(g, profile=True)
    assert profile is not None
    backends = {n["name"]: n["backend"] for n in profile.nodes}
    assert backends["half"] == "NPPROFILE"
    plan = sched.plan
    assert plan is not None
    assert backends == {n["name"]: n["backend"] for n in plan.nodes}  # the planned backends
    # the copies to and from the Python backend count in the total, in no node
    assert 0 <= profile.node_seconds <= profile.total_seconds
    assert len(profile.nodes) == 4 and sorted(n["index"] for n in profile.nodes) == [0, 1, 2, 3]
    both = profile + profile
    assert len(both) == 8
    assert both.ops["ADD"]["count"] == 2
    assert both.total_seconds == pytest.approx(2 * profile.total_seconds)
    assert len(sum([profile, profile, profile])) == 12
    with pytest.raises(TypeError):
        profile + 1  # type: ignore[operator]


def test_profile_keeps_the_eval_callback(cpu: fg.Backend, rng: np.random.Generator) -> None:
    g, w, x, _ = _graph()
    sched = fg.Scheduler([cpu])
    seen: list[str] = []

    def callback(t: fg.Tensor, ask: bool) -> bool:
        if not ask:
            seen.append(t.name)
        return True

    sched.set_eval_callback(callback)
    sched.alloc_graph(g)
    w.set(rng.standard_normal((12, 16)).astype(np.float32))
    x.set(rng.standard_normal((8, 16)).astype(np.float32))
    profile = sched.graph_compute(g, profile=True)
    assert profile is not None and len(profile) == 4
    assert seen == ["prod", "act", "half", "out"]
    sched.set_eval_callback(lambda t, ask: ask or t.name != "act")
    with pytest.raises(fg.AbortedError):
        sched.graph_compute(g, profile=True)


def test_encoder_profile_and_embed_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_name = "v6-relu-max-norm"
    path = write_model(tmp_path / "model", SPECS[spec_name])
    model = SentenceEncoder(path)
    sentences = ["a cat sits on the mat", "dogs run", "the sky is blue today"]
    plain = model.encode(sentences, batch_size=2)
    assert model.last_profile is None
    timed = model.encode(sentences, batch_size=2, profile=True)
    np.testing.assert_allclose(timed, plain, rtol=1e-5, atol=1e-6)
    profile = model.last_profile
    assert profile is not None
    counts = Counter(n["op"] for n in profile.nodes)
    # two batches of the same graph shape: every op count is even, products dominate (4 per
    # layer: the fused QKV projection, the output projection and the two feed-forward ones)
    assert all(c % 2 == 0 for c in counts.values()) and counts["MUL_MAT"] >= 2 * 3 * 4
    assert 0 <= profile.node_seconds <= profile.total_seconds
    assert main(["embed", "--model", str(path), "--profile", *sentences]) == 0
    out = capsys.readouterr().out
    assert "per-op profile" in out and "MUL_MAT" in out and "top 10 nodes" in out
    assert main(["embed", "--model", str(path), *sentences]) == 0
    assert "per-op profile" not in capsys.readouterr().out
