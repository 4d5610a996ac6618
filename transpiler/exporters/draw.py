"""`Plan.draw`: the op graph of a plan as a picture, laid out by Graphviz `dot` (through pygraphviz,
whose wheels carry Graphviz itself: nothing to install beside pip).

What a reader sees:
- one box per trainer type (a Graphviz cluster) holding its compute ops, each labelled with its op
  type and the tensor it writes; forward ops in the trainer type's colour, backward ops lighter;
- the data feeds as cylinders labelled with the feed's name and dtype[shape] (`?` = the batch);
- every boundary tensor (one that crosses trainer types) as a red dashed box between the trainer
  boxes, labelled with its name, dtype[shape], bytes per example and direction; red dashed edges run
  from its producer to it and from it to its readers on the far side;
- a legend (the graph's title) with the colours, the shapes and the totals.

Comm and PS ops are left out: the boundary boxes are the sends/recvs, and pulls/pushes only feed
parameters (an id tensor passed through `unique_ids` / `pull_sparse` keeps its producer's edge).
Edges never run through a node box: `edges_through_nodes` checks the layout's coordinates, and when
Graphviz's global ranking (which reads best: time flows down across the trainer boxes) routes an
edge through a box, the graph is laid out again with per-box ranking (tests/test_transpile_draw.py).
Write `.svg` for big graphs (text stays sharp and searchable), `.png` or `.pdf`.
"""

from __future__ import annotations

import html
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pygraphviz

    from transpiler.ir import Op, Program

FORMATS = ("png", "svg", "pdf")
PALETTE = ["#4c72b0", "#55a868", "#dd8452", "#8172b3", "#937860", "#64b5cd"]
CROSS = "#ff0000"  # boundary tensors and their edges
INNER = "#8c8c8c"  # tensors within one trainer type
DARK = "#1a1a1a"  # text on white or light fills
FONT = "DejaVu Sans,Helvetica,Arial,sans-serif"


class PlanView(Protocol):
    """What a drawing reads of a plan (a `transpiler.plan.Plan` is one): its sub-programs by
    trainer type and its channels (boundary tensors)."""

    programs: dict[str, Program]
    channels: list[dict[str, Any]]


def trainer_colours(plan: PlanView) -> dict[str, str]:
    """The fill colour of each trainer type, in the plan's order."""
    return {dev: PALETTE[i % len(PALETTE)] for i, dev in enumerate(plan.programs)}


def _lighter(colour: str, amount: float = 0.55) -> str:
    rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _shape_text(dtype: str, shape: Any) -> str:
    if shape is None:
        return f"{dtype}[?]"
    return f"{dtype}[{', '.join('?' if d == -1 else str(d) for d in shape)}]"


def _var_text(prog: Program, name: str) -> str:
    v = prog.vars.get(name)
    return _shape_text(v.dtype, v.shape) if v is not None else "?"


def _label(*lines: tuple[str, int, str]) -> str:
    """An HTML-like label: one (text, point size, colour) per line, text escaped."""
    body = '<BR ALIGN="CENTER"/>'.join(
        f'<FONT POINT-SIZE="{size}" COLOR="{colour}">{html.escape(text)}</FONT>'
        for text, size, colour in lines
    )
    return f"<{body}>"


def _op_attrs(op: Op, prog: Program, colour: str) -> dict[str, str]:
    """Node attributes: a data feed is a cylinder with its name and dtype[shape]; a compute op a
    rounded box with its type and the tensor it writes, lighter when it is a backward op."""
    if op.type == "data":
        name = op.output_names()[0]
        label = _label((name, 11, DARK), (_var_text(prog, name), 9, DARK))
        return dict(
            label=label, shape="cylinder", style="filled", fillcolor="white", color=colour, penwidth="2"
        )
    backward = op.role == "backward"
    text = DARK if backward else "white"
    outs = op.output_names()
    label = _label((op.type, 11, text), (outs[0] if outs else "", 8, text))
    fill = _lighter(colour) if backward else colour
    return dict(
        label=label, shape="box", style="rounded,filled", fillcolor=fill, color=colour, fontcolor=text
    )


@dataclass
class _Wiring:
    """Per trainer type: the node writing each tensor and the nodes reading it; the backward nodes."""

    writers: dict[str, dict[str, str]] = field(default_factory=dict)
    readers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    backward: set[str] = field(default_factory=set)
    ops: dict[str, int] = field(default_factory=dict)


def _add_trainer(g: pygraphviz.AGraph, dev: str, prog: Program, colour: str, wiring: _Wiring) -> None:
    """The compute ops of one trainer type in its box, with edges for the tensors between them."""
    box = g.add_subgraph(
        name=f"cluster_{dev}",
        label=f"trainer {dev}",
        color=colour,
        penwidth="2",
        style="rounded",
        fontcolor=colour,
        fontsize="16",
    )
    w, r = wiring.writers.setdefault(dev, {}), wiring.readers.setdefault(dev, {})
    for op in prog.ops:
        if op.role == "comm":
            continue
        if op.role == "ps":  # unique ids / pulled rows stand for the ids they came from
            src = next((w[n] for n in op.input_names() if n in w), None)
            w.update({n: src for n in op.output_names() if src is not None})
            continue
        node = f"{dev}:{op.id}"
        box.add_node(node, **_op_attrs(op, prog, colour))
        wiring.ops[dev] = wiring.ops.get(dev, 0) + 1
        if op.role == "backward":
            wiring.backward.add(node)
        for n in op.input_names():
            r.setdefault(n, []).append(node)
            if n in w:
                _add_edge(g, w[n], node, INNER, wiring)
        for n in op.output_names():
            w[n] = node


def _add_edge(g: pygraphviz.AGraph, tail: str, head: str, colour: str, wiring: _Wiring, **style: str) -> None:
    """A forward tensor read again by a backward op only ranks the layout (an invisible edge): those
    edges would cover the picture and tell little."""
    if head in wiring.backward and tail not in wiring.backward:
        g.add_edge(tail, head, style="invis")
    else:
        g.add_edge(tail, head, color=colour, **style)


def _add_boundaries(g: pygraphviz.AGraph, plan: PlanView, wiring: _Wiring) -> None:
    """One red dashed box per boundary tensor, between its producer and its readers on the far side."""
    for c in plan.channels:
        src = wiring.writers[c["src"]].get(c["tensor"])
        dsts = wiring.readers.get(c["dst"], {}).get(c["tensor"], [])
        if src is None or not dsts:
            continue
        node = f"boundary:{c['src']}:{c['tensor']}"
        if not g.has_node(node):
            label = _label(
                (c["tensor"], 10, DARK),
                (_shape_text(c["dtype"], c["shape"]), 9, DARK),
                (f"{c['bytes_per_example']:,} B/example, {c['src']} → {c['dst']}", 9, CROSS),
            )
            g.add_node(node, label=label, shape="box", style="dashed,rounded", color=CROSS, penwidth="1.5")
            g.add_edge(src, node, color=CROSS, style="dashed", penwidth="1.5")
            if src in wiring.backward:
                wiring.backward.add(node)
        for dst in dict.fromkeys(dsts):
            _add_edge(g, node, dst, CROSS, wiring, style="dashed", penwidth="1.5")


def _legend(plan: PlanView, colours: dict[str, str], counts: dict[str, int]) -> str:
    crossing = sum(c["bytes_per_example"] for c in plan.channels)
    rows = [
        f'<TR><TD COLSPAN="3" ALIGN="LEFT"><B>{len(plan.programs)} trainer types, '
        f"{len(plan.channels)} boundary tensors, {crossing:,} B per example cross</B></TD></TR>"
    ]
    for dev, colour in colours.items():
        rows.append(
            f'<TR><TD BGCOLOR="{colour}" WIDTH="28"> </TD><TD BGCOLOR="{_lighter(colour)}" WIDTH="28"> '
            f'</TD><TD ALIGN="LEFT">trainer {html.escape(dev)}: {counts.get(dev, 0)} ops '
            "(forward | backward lighter); op type, then the tensor it writes</TD></TR>"
        )
    rows.append(
        '<TR><TD COLSPAN="2">cylinder</TD><TD ALIGN="LEFT">a data feed: name, dtype[shape] '
        "(? = the batch)</TD></TR>"
    )
    rows.append(
        f'<TR><TD COLSPAN="2"><FONT COLOR="{CROSS}">red dashed</FONT></TD><TD ALIGN="LEFT">'
        "boundary tensor sent between trainer types: name, dtype[shape], bytes per example</TD></TR>"
    )
    rows.append(
        f'<TR><TD COLSPAN="2"><FONT COLOR="{INNER}">grey edge</FONT></TD><TD ALIGN="LEFT">'
        "a tensor within one trainer type (parameter pulls and pushes are not drawn)</TD></TR>"
    )
    rows.append(
        '<TR><TD COLSPAN="2"></TD><TD ALIGN="LEFT">(backward ops also read forward tensors and ids: '
        "those edges are left out)</TD></TR>"
    )
    return '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2">' + "".join(rows) + "</TABLE>>"


def plan_graph(plan: PlanView) -> pygraphviz.AGraph:
    """The plan as a Graphviz graph, laid out by `dot` (node `pos`/`width`/`height` and edge `pos`
    attributes hold the coordinates, in points and inches as Graphviz writes them)."""
    try:
        import pygraphviz
    except ImportError:
        raise ImportError(
            "Plan.draw needs pygraphviz (a dependency of hetps): pip install 'pygraphviz>=2'"
        ) from None

    colours = trainer_colours(plan)
    g = pygraphviz.AGraph(
        directed=True,
        strict=False,
        rankdir="TB",
        nodesep="0.3",
        ranksep="0.45",
        fontname=FONT,
        newrank="true",
    )
    g.node_attr.update(fontname=FONT, margin="0.12,0.04")
    g.edge_attr.update(arrowsize="0.7")
    wiring = _Wiring()
    for dev, prog in plan.programs.items():
        _add_trainer(g, dev, prog, colours[dev], wiring)
    _add_boundaries(g, plan, wiring)
    g.graph_attr.update(label=_legend(plan, colours, wiring.ops), labelloc="t", labeljust="l")
    # Global ranks (newrank) read best: time flows down across the trainer boxes, backward below
    # forward. Graphviz may then route an edge through a box; the cluster-local ranking does not.
    with _quiet_fontconfig():
        g.layout(prog="dot")
        if edges_through_nodes(g):
            g.graph_attr["newrank"] = "false"
            g.layout(prog="dot")
    return g


def edges_through_nodes(g: pygraphviz.AGraph, tol: float = 2.0) -> list[tuple[str, str, str]]:
    """(tail, head, node) for every drawn edge of a laid-out graph whose curve enters the box of a
    node other than its ends by more than `tol` points (edges sampled along their Bezier pieces)."""

    boxes = {}
    for n in g.nodes():
        x, y = map(float, n.attr["pos"].split(","))
        w, h = float(n.attr["width"]) * 36, float(n.attr["height"]) * 36  # inches -> half size, points
        boxes[str(n)] = (x - w + tol, y - h + tol, x + w - tol, y + h - tol)
    out = []
    for e in g.edges():
        if e.attr["style"] == "invis":
            continue
        pts = _edge_points(e.attr["pos"])
        for n, (x0, y0, x1, y1) in boxes.items():
            if (
                n not in (str(e[0]), str(e[1]))
                and ((pts[:, 0] > x0) & (pts[:, 0] < x1) & (pts[:, 1] > y0) & (pts[:, 1] < y1)).any()
            ):
                out.append((str(e[0]), str(e[1]), n))
    return out


def _edge_points(pos: str, step: float = 1.0) -> Any:
    """Points at most about `step` points apart along an edge, from its Graphviz `pos`
    ("[s,x,y] [e,x,y] p0 p1 p2 p3 ..."): cubic Bezier pieces p0..p3, p3..p6, ..., then the straight
    arrow to the end point."""
    import numpy as np

    ctrl, end = [], None
    for tok in pos.split():
        if tok.startswith("e,"):
            end = tuple(map(float, tok[2:].split(",")))
        elif not tok.startswith("s,"):
            ctrl.append(tuple(map(float, tok.split(","))))
    p = np.array(ctrl)
    parts = []
    for i in range(0, len(p) - 3, 3):
        a, b, c, d = p[i : i + 4]
        hull = np.linalg.norm(np.diff(p[i : i + 4], axis=0), axis=1).sum()  # bounds the piece's length
        t = np.linspace(0.0, 1.0, int(hull / step) + 2)[:, None]
        parts.append((1 - t) ** 3 * a + 3 * (1 - t) ** 2 * t * b + 3 * (1 - t) * t**2 * c + t**3 * d)
    if end is not None:
        parts.append(np.linspace(p[-1], end, int(np.linalg.norm(np.subtract(end, p[-1])) / step) + 2))
    return np.concatenate(parts)


def draw_plan(plan: PlanView, path: Path) -> Path:
    """Draw `plan` to `path`; the format follows the suffix: .png, .svg (big graphs) or .pdf."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"cannot draw to {path}: name a .png, .svg or .pdf file (.svg suits big graphs)")
    g = plan_graph(plan)
    if fmt == "png":
        g.graph_attr["dpi"] = "96"
    with _quiet_fontconfig():
        g.draw(str(path), format=fmt)
    return path


@contextmanager
def _quiet_fontconfig() -> Iterator[None]:
    """Graphviz's bundled fontconfig may warn about newer system config files it cannot parse
    ("Fontconfig warning: ... unknown element"); those lines are dropped, any other stderr output
    of Graphviz is passed on."""
    try:
        fd = os.dup(2)
    except OSError:  # no stderr to guard
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(fd, 2)
            os.close(fd)
            tmp.seek(0)
            kept = [
                ln
                for ln in tmp.read().decode(errors="replace").splitlines()
                if ln.strip() and not ln.startswith("Fontconfig warning")
            ]
            if kept:
                os.write(2, ("\n".join(kept) + "\n").encode())
