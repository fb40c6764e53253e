from __future__ import annotations

import pytest

import ferrograph as fg


@pytest.fixture
def graph(ctx: fg.Context) -> tuple[fg.Graph, list[fg.Tensor]]:
    a = ctx.new_tensor(fg.float32, (3, 4), name="a").set_input()
    b = ctx.new_tensor(fg.float32, (3, 4), name="b")
    s = fg.ops.add(a, b)
    s.name = "s"
    m = fg.ops.mul(s, a)
    out = fg.ops.add(m, s).set_output()
    out.name = "out"
    return fg.Graph.build(out), [a, b, s, m, out]


def test_build_order_and_counts(graph: tuple[fg.Graph, list[fg.Tensor]]) -> None:
    g, (a, b, s, m, out) = graph
    assert g.n_nodes == len(g) == 3 and g.n_leafs == 2
    assert g.nodes == [s, m, out] and g.leafs == [a, b]
    assert list(g) == g.nodes
    position = {t: i for i, t in enumerate(g.nodes)}
    for node in g.nodes:
        for src in node.srcs:
            if src in position:
                assert position[src] < position[node]


def test_indexing_and_lookup(graph: tuple[fg.Graph, list[fg.Tensor]]) -> None:
    g, (a, _b, s, _m, out) = graph
    assert g[0] == s and g[-1] == out and g[-3] == s
    with pytest.raises(fg.OutOfBoundsError):
        g[3]
    with pytest.raises(IndexError):
        g[-4]
    assert out in g and a in g and "out" not in g
    assert g.get_tensor("a") == a and g.get_tensor("nope") is None
    v = g.view(1, 3)
    assert v.n_nodes == 2 and v.n_leafs == 0
    with pytest.raises(fg.OutOfBoundsError):
        g.view(2, 5)


def test_text_dot_and_html(graph: tuple[fg.Graph, list[fg.Tensor]]) -> None:
    g, _ = graph
    text = str(g)
    assert text.startswith("Graph: 3 nodes, 2 leafs") and "MUL" in text and "(output)" in text
    dot = g.to_dot()
    assert dot.startswith("digraph") and dot.count("->") == 6
    assert "<table>" in g._repr_html_()
    assert repr(g) == "Graph(nodes=3, leafs=2)"


def test_build_from_a_list(ctx: fg.Context) -> None:
    a = ctx.new_tensor(fg.float32, 4)
    y1, y2 = fg.ops.relu(a), fg.ops.neg(a)
    g = fg.Graph.build([y1, y2])
    assert g.nodes == [y1, y2] and g.leafs == [a]
    with pytest.raises(TypeError):
        fg.Graph.build([a, 3])  # type: ignore[list-item]
