"""Draw docs/layout.png: hetps's folders (one box per role) and which import which, from the source.

    python docs/make_layout.py

Boxes are the sub-packages of ops_registry, transpiler and runtime (a module at a package's top level
counts as the package's "core"); inside a layer, an arrow A -> B means some module of A imports one of B
(lazy imports included). Layers run top to bottom, each importing only the ones below it:
runtime -> transpiler -> ops_registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pygraphviz

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("runtime", "transpiler", "ops_registry")
COLOURS = {"runtime": "#dbe9f6", "transpiler": "#e3f1dc", "ops_registry": "#f6e7d0"}


def folder(path: Path) -> str:
    """The box a module belongs to: 'runtime/ps', 'transpiler/core', 'ops_registry'."""
    parts = path.relative_to(ROOT).parts
    if parts[0] == "ops_registry":
        return "ops_registry"
    if len(parts) == 2:
        return f"{parts[0]}/core"
    return f"{parts[0]}/{parts[1]}"


def module_folder(name: str, folders: dict[str, str]) -> str | None:
    """The box of dotted module `name` (or of the longest module prefix of it that exists)."""
    while name:
        if name in folders:
            return folders[name]
        name = name.rpartition(".")[0]
    return None


def edges() -> tuple[set[str], set[tuple[str, str]]]:
    files = [p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")]
    folders = {}
    for p in files:
        parts = p.relative_to(ROOT).with_suffix("").parts
        folders[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = folder(p)
    out = set()
    for p in files:
        src = folder(p)
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            for n in names:
                dst = module_folder(n, folders)
                if dst and dst != src and dst.split("/")[0] == src.split("/")[0]:
                    out.add((src, dst))
    return set(folders.values()), out


def label(box: str) -> str:
    """A box's name; a layer's core lists its top-level modules (`runtime`'s is its public API)."""
    if not box.endswith("/core"):
        return box.split("/")[-1]
    layer = box.split("/")[0]
    names = sorted(p.stem for p in (ROOT / layer).glob("*.py") if p.stem != "__init__")
    return "\n".join(["public API (__init__)" if not names else "core", *names])


def main() -> None:
    boxes, links = edges()
    g = pygraphviz.AGraph(
        directed=True,
        rankdir="TB",
        compound=True,
        newrank=True,
        nodesep="0.25",
        ranksep="0.5",
        fontname="Helvetica",
    )
    g.node_attr.update(shape="box", style="filled,rounded", fontname="Helvetica", fontsize="11")
    g.edge_attr.update(color="#777777", arrowsize="0.6")
    for layer in LAYERS:
        sub = g.add_subgraph(
            name=f"cluster_{layer}",
            label=f"{layer}/",
            style="rounded",
            color="#999999",
            fontname="Helvetica-Bold",
            fontsize="13",
        )
        for box in sorted(b for b in boxes if b.split("/")[0] == layer):
            sub.add_node(box, label=label(box), fillcolor=COLOURS[layer])
    for a, b in sorted(links):
        g.add_edge(a, b)
    anchors = {layer: sorted(b for b in boxes if b.split("/")[0] == layer)[-1] for layer in LAYERS}
    for top, down in zip(LAYERS, LAYERS[1:], strict=False):
        g.add_edge(
            anchors[top],
            anchors[down],
            ltail=f"cluster_{top}",
            lhead=f"cluster_{down}",
            penwidth="2.5",
            color="#333333",
            label=f"  {top} imports {down}",
            fontname="Helvetica",
            fontsize="10",
            minlen="2",
        )
    g.draw(str(ROOT / "docs" / "layout.png"), prog="dot", args="-Gdpi=110")


if __name__ == "__main__":
    main()
