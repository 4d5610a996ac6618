"""`Plan.draw` / `hetps draw`: what the picture says and how it is laid out.

- The SVG holds, as text, every data feed and every boundary tensor with its dtype[shape] and its
  bytes per example; the bytes are recomputed here from the shape (numpy's item size), not read
  from the plan.
- No drawn edge passes through a node box: checked on the coordinates of the layout that is drawn
  (Graphviz's node boxes and edge Bezier curves), for tutorial 02's plan and for DLRM with and
  without backward ops (without, Graphviz's global ranking routes 20 edges through boxes, and
  `plan_graph` must fall back to a layout without). The check itself is first shown to find an edge
  drawn straight through a box, on a hand-placed graph.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from transpiler import builder as nn
from transpiler import transpile
from transpiler.exporters.draw import edges_through_nodes, plan_graph
from transpiler.models import dlrm, wide_deep

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def tutorial_02():
    """The plan of tutorials/02_heter_training.py (its default settings)."""
    return transpile(wide_deep(vocab=1000, optimizer=nn.Adam(lr=0.003)).main)


def svg_texts(path) -> list[str]:
    root = ET.parse(path).getroot()
    return ["".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")]


def shape_text(dtype: str, shape) -> str:
    return f"{dtype}[{', '.join('?' if d == -1 else str(d) for d in shape)}]"


def test_svg_names_every_feed_and_boundary_tensor_with_shape_and_bytes(tutorial_02, tmp_path):
    plan = tutorial_02
    out = plan.draw(tmp_path / "plan.svg")
    texts = svg_texts(out)
    joined = "\n".join(texts)
    feeds = [op.output_names()[0] for p in plan.programs.values() for op in p.ops if op.type == "data"]
    assert sorted(feeds) == ["dense", "label", "sparse"]
    for name in feeds:
        assert name in texts, name
    assert "int64[?, 26]" in texts and "float32[?, 13]" in texts  # sparse, dense
    assert len(plan.channels) == 6
    for c in plan.channels:
        assert c["tensor"] in texts, c["tensor"]
        assert shape_text(c["dtype"], c["shape"]) in texts
        per_example = int(np.prod([d for d in c["shape"] if d != -1])) * np.dtype(c["dtype"]).itemsize
        assert f"{per_example:,} B/example, {c['src']} → {c['dst']}" in texts, c
    # the legend: colours per trainer type, the shapes, the totals
    assert re.search(r"2 trainer types, 6 boundary tensors, 1,728 B per example cross", joined)
    assert "trainer cpu" in joined and "trainer gpu" in joined and "data feed" in joined
    # one node per compute op and per boundary tensor (comm and ps ops are left out)
    root = ET.parse(out).getroot()
    nodes = [g for g in root.iter(f"{SVG}g") if g.get("class") == "node"]
    compute = sum(1 for p in plan.programs.values() for op in p.ops if op.role not in ("comm", "ps"))
    assert len(nodes) == compute + len({(c["src"], c["tensor"]) for c in plan.channels})


def test_the_check_finds_an_edge_drawn_through_a_box():
    import pygraphviz

    g = pygraphviz.AGraph(directed=True, splines="line")
    for name, pos in (("a", "0,0"), ("c", "0,2"), ("b", "0,4"), ("d", "3,2")):  # inches
        g.add_node(name, pos=pos, pin="true", shape="box")
    g.add_edge("a", "b")
    g.add_edge("a", "d")
    g.layout(prog="neato", args="-n2")  # keep the pinned positions; edges as straight lines
    assert edges_through_nodes(g) == [("a", "b", "c")]


@pytest.mark.parametrize("name", ["tutorial_02", "dlrm_training", "dlrm_forward_only"])
def test_no_drawn_edge_passes_through_a_node_box(name, tutorial_02, tmp_path):
    plan = {
        "tutorial_02": lambda: tutorial_02,
        "dlrm_training": lambda: transpile(dlrm(optimizer=nn.SGD(lr=0.1)).main),
        "dlrm_forward_only": lambda: transpile(dlrm().main),
    }[name]()
    g = plan_graph(plan)
    drawn = [e for e in g.edges() if e.attr["style"] != "invis"]
    assert len(drawn) > 10
    assert edges_through_nodes(g) == []


def test_draw_refuses_a_format_it_does_not_write(tutorial_02, tmp_path):
    with pytest.raises(ValueError, match=r"name a \.png, \.svg or \.pdf file"):
        tutorial_02.draw(tmp_path / "plan.jpg")
    assert not (tmp_path / "plan.jpg").exists()


def test_hetps_draw_writes_svg_and_refuses_other_formats_as_usage_errors(tutorial_02, tmp_path, capsys):
    from runtime.cli.app import main

    tutorial_02.save(tmp_path / "plan")
    assert main(["draw", str(tmp_path / "plan"), "-o", str(tmp_path / "plan.svg")]) == 0
    assert "reshape_0.tmp@GRAD" in svg_texts(tmp_path / "plan.svg")
    assert main(["draw", str(tmp_path / "plan"), "-o", str(tmp_path / "plan.jpg")]) == 2
    err = capsys.readouterr().err
    assert "usage: hetps draw" in err and "name a .png, .svg or .pdf file" in err
