"""`Plan.draw`: the op graph of a plan as a PNG (networkx layout, matplotlib without pyplot).

Nodes are the compute ops of every sub-program, coloured by trainer type, in layers by topological
generation; edges follow tensors; a tensor that crosses trainer types is a red dashed edge from its
producer to its readers on the far side, labelled with its bytes per example. Comm and PS ops are
left out: the red edges are the sends/recvs, and pulls/pushes only feed parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan


def draw_plan(plan: Plan, path: Path) -> Path:
    import networkx as nx
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    g = nx.DiGraph()
    writers: dict[str, dict[str, int]] = {}
    readers: dict[str, dict[str, list[int]]] = {}
    for dev, prog in plan.programs.items():
        w, r = writers.setdefault(dev, {}), readers.setdefault(dev, {})
        for op in prog.ops:
            if op.role == "comm":
                continue
            if op.role == "ps":  # unique ids / pulled rows stand for the ids they came from
                src = next((w[n] for n in op.input_names() if n in w), None)
                w.update({n: src for n in op.output_names() if src is not None})
                continue
            g.add_node(op.id, dev=dev, label=op.type)
            for n in op.input_names():
                r.setdefault(n, []).append(op.id)
                if n in w:
                    g.add_edge(w[n], op.id, cross=False)
            for n in op.output_names():
                w[n] = op.id
    labels = {}
    for c in plan.channels:
        src = writers[c["src"]].get(c["tensor"])
        for dst in readers.get(c["dst"], {}).get(c["tensor"], []) if src is not None else []:
            g.add_edge(src, dst, cross=True)
            labels.setdefault((src, dst), f"{c['bytes_per_example']} B")
    for layer, nodes in enumerate(nx.topological_generations(g)):
        for n in nodes:
            g.nodes[n]["layer"] = layer
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal", scale=-1)
    layers = 1 + max((d["layer"] for _, d in g.nodes(data=True)), default=0)
    width = max((sum(1 for _, d in g.nodes(data=True) if d["layer"] == k) for k in range(layers)), default=1)
    fig = Figure(figsize=(min(4 + 1.2 * width, 60), min(3 + 0.6 * layers, 120)))
    ax = fig.add_subplot()
    palette = ["#4c72b0", "#55a868", "#dd8452", "#8172b3", "#937860", "#64b5cd"]
    colour = {dev: palette[i % len(palette)] for i, dev in enumerate(plan.programs)}
    inner = [e for e in g.edges if not g.edges[e]["cross"]]
    cross = [e for e in g.edges if g.edges[e]["cross"]]
    nx.draw_networkx_nodes(g, pos, ax=ax, node_size=500,
                           node_color=[colour[g.nodes[n]["dev"]] for n in g.nodes])
    nx.draw_networkx_labels(g, pos, ax=ax, labels={n: g.nodes[n]["label"] for n in g.nodes}, font_size=6)
    nx.draw_networkx_edges(g, pos, ax=ax, edgelist=inner, edge_color="#999999", arrows=True, node_size=500)
    nx.draw_networkx_edges(g, pos, ax=ax, edgelist=cross, edge_color="red", style="dashed", width=1.5,
                           arrows=True, node_size=500)
    nx.draw_networkx_edge_labels(g, pos, ax=ax, edge_labels=labels, font_size=6, font_color="red")
    ax.legend(handles=[Patch(color=c, label=f"trainer {d}") for d, c in colour.items()]
              + [Patch(color="red", label="crosses (bytes/example)")], loc="upper right", fontsize=8)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
