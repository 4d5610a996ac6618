"""The package's shape, checked by parsing its source with `ast`:

- imports only point down: runtime -> transpiler -> ops_registry (ops_registry imports neither
  transpiler nor runtime; transpiler never imports runtime), lazy imports inside functions included;
- no import circle among hetps's modules, lazy imports inside functions included (a module that needs
  a name from another that needs it back is one unit cut in the wrong place);
- no function over MAX_FUNCTION_LINES lines (a guideline that keeps functions readable), but for the
  ones in ALLOWED; an entry that is no longer needed fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ops_registry", "transpiler", "runtime")
MAX_FUNCTION_LINES = 60
# What each layer must not import (runtime -> transpiler -> ops_registry).
FORBIDDEN = {"ops_registry": ("transpiler", "runtime"), "transpiler": ("runtime",), "runtime": ()}
# Argument-parser builders are long lists of add_argument calls: exempt by name.
PARSER_BUILDERS = {("runtime/cli/app.py", "build_parser")}
# Functions still over the length guideline.
ALLOWED: dict[str, set[str]] = {
    "runtime/data/models.py": {"build_model"},
    # process start-ups (sockets, signals, children, readiness), one sequence each, read best in one place
    "runtime/ps/server.py": {"serve"},
    "runtime/ps/local.py": {"__init__"},
}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module `tree` imports, anywhere in it (function-level imports too), relative imports
    resolved against `module` (a dotted name; `is_package` for an __init__.py)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                target = ".".join(parent + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{a.name}" for a in node.names)  # `from . import runtime`
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return names


def layer_violations(path: str, source: str) -> list[str]:
    """'path imports X' for each import of `source` (the file at `path`, relative to the root) that
    points up a layer."""
    parts = path.removesuffix(".py").split("/")
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    forbidden = FORBIDDEN.get(parts[0], ())
    bad = {
        name
        for name in imported_modules(ast.parse(source), module, is_package)
        if name.split(".")[0] in forbidden
    }
    return [f"{path} imports {name}" for name in sorted(bad)]


def module_name(path: str) -> tuple[str, bool]:
    """The dotted module name of the file at `path` (relative to the root), and whether it is a package."""
    parts = path.removesuffix(".py").split("/")
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def import_graph(sources: dict[str, str]) -> nx.DiGraph:
    """module -> each module it imports, among the modules of `sources` ({path: source}), lazy imports
    included, type-checking-only ones not. `from pkg import name` imports the module `pkg.name` when
    there is one, else `pkg`; a module's parent packages, which Python imports first, are not edges of
    the module's own."""
    modules = {module_name(path)[0] for path in sources}
    graph = nx.DiGraph()
    for path, source in sources.items():
        module, is_package = module_name(path)
        base = module.split(".") if is_package else module.split(".")[:-1]
        graph.add_node(module)
        tree = ast.parse(source)
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                parent = base[: len(base) - (node.level - 1)] if node.level else []
                pkg = ".".join(parent + ([node.module] if node.module else []))
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in modules else pkg for a in node.names]
            else:
                continue
            graph.add_edges_from((module, t) for t in targets if t in modules and t != module)
    return graph


def circles(graph: nx.DiGraph) -> list[str]:
    """Every import circle of `graph` as "a -> b -> a", each starting at its smallest name, sorted."""
    out = []
    for cycle in nx.simple_cycles(graph):
        i = cycle.index(min(cycle))
        cycle = cycle[i:] + cycle[:i]
        out.append(" -> ".join(cycle + cycle[:1]))
    return sorted(out)


def oversized(path: str, source: str) -> dict[str, str]:
    """{function name: what is over the limit} for the file at `path`."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (path, node.name) not in PARSER_BUILDERS
        ):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out[node.name] = f"{path}:{node.lineno} {node.name}: {n} lines (limit {MAX_FUNCTION_LINES})"
    return out


def test_the_checks_see_what_they_look_for():
    """The checkers on made-up sources: a lazy import up a layer, relative imports, and sizes."""
    lazy_up = "def f():\n    from runtime.driver.train import train\n    return train\n"
    assert layer_violations("transpiler/passes/x.py", lazy_up) == [
        "transpiler/passes/x.py imports runtime.driver.train",
        "transpiler/passes/x.py imports runtime.driver.train.train",
    ]
    assert layer_violations("transpiler/passes/x.py", "from ..ir import Program\n") == []
    assert imported_modules(ast.parse("from ..ir import Program\n"), "transpiler.passes.x", False) == {
        "transpiler.ir",
        "transpiler.ir.Program",
    }
    loader = "import importlib\nm = importlib.import_module('runtime.cli.app')\n"
    assert layer_violations("ops_registry/x.py", loader) == ["ops_registry/x.py imports runtime.cli.app"]
    assert layer_violations("ops_registry/x.py", "import transpiler.ir\n") == [
        "ops_registry/x.py imports transpiler.ir"
    ]
    assert layer_violations("ops_registry/__init__.py", "from . import base\n") == []
    assert layer_violations("runtime/x.py", "from transpiler import ir\nimport ops_registry\n") == []
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert set(oversized("a.py", long_function)) == {"f"}
    assert oversized("a.py", "def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)) == {}


def test_the_cycle_check_sees_lazy_imports():
    sources = {
        "runtime/a.py": "from runtime.b import f\n",
        "runtime/b.py": "def f():\n    from runtime import a\n",
        "runtime/__init__.py": "from runtime.a import f\n",
        "runtime/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.a import f\n",
    }
    sources["runtime/a.py"] += "import runtime.c\n"
    assert circles(import_graph(sources)) == ["runtime.a -> runtime.b -> runtime.a"]
    sources["runtime/b.py"] = "def f():\n    return 1\n"
    assert circles(import_graph(sources)) == []


def test_no_import_circle():
    sources = {_rel(p): p.read_text() for p in _sources()}
    cycles = circles(import_graph(sources))
    assert not cycles, "import circles (cut the unit where it belongs, or move the shared fact down):\n" + (
        "\n".join(cycles)
    )


def test_imports_point_down_only():
    bad = [v for p in _sources() for v in layer_violations(_rel(p), p.read_text())]
    assert not bad, "imports pointing up a layer (runtime -> transpiler -> ops_registry):\n" + "\n".join(bad)


def test_no_function_over_the_length_guideline():
    over = []
    for p in _sources():
        allowed = ALLOWED.get(_rel(p), set())
        over += [what for name, what in oversized(_rel(p), p.read_text()).items() if name not in allowed]
    assert not over, "split these by responsibility (well-named helpers, not crammed lines):\n" + "\n".join(
        over
    )


@pytest.mark.parametrize("path", sorted(ALLOWED))
def test_the_allow_list_only_shrinks(path):
    """An ALLOWED entry that is no longer over its limit must be removed from the list."""
    file = ROOT / path
    found = set(oversized(path, file.read_text())) if file.is_file() else set()
    stale = ALLOWED[path] - found
    assert not stale, f"{path}: {sorted(stale)} no longer over the limit; remove from ALLOWED in {__file__}"
