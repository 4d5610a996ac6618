"""One error family: every error class hetps defines derives from `HetpsError` (so a user can catch
all of hetps's errors) and keeps its builtin base (so older `except ValueError:` code still works);
real failures raised by the code are caught as `HetpsError`."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import runtime
import transpiler
from ops_registry.errors import HetpsError
from runtime.ps import PSError, SparseTable
from transpiler import TableSpec, builder

# Exceptions used as control-flow signals inside one module, never raised to a user.
SIGNALS = {
    "transpiler.frontends.onnx.control_flow._Refused",
    "runtime.ps.handlers.ParkPulls",
    "runtime.ps.types.NotReady",
    "runtime.cli.app.Terminated",  # a KeyboardInterrupt: SIGTERM ends the CLI like Ctrl-C
}


def _exception_classes() -> dict[str, type]:
    found = {}
    for pkg in ("ops_registry", "transpiler", "runtime"):
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
            if info.name.endswith("__main__"):
                continue
            mod = importlib.import_module(info.name)
            for name, c in vars(mod).items():
                if inspect.isclass(c) and issubclass(c, Exception) and c.__module__ == mod.__name__:
                    if not issubclass(c, Warning):
                        found[f"{mod.__name__}.{name}"] = c
    return found


def test_every_hetps_error_has_the_one_root():
    classes = _exception_classes()
    assert len(classes) > 20  # the walk saw the packages
    outside = sorted(n for n, c in classes.items() if not issubclass(c, HetpsError) and n not in SIGNALS)
    assert not outside, f"error classes outside the HetpsError family: {outside}"
    assert runtime.HetpsError is transpiler.HetpsError is HetpsError


def test_builtin_bases_are_kept():
    assert issubclass(PSError, ValueError) and issubclass(transpiler.LintError, ValueError)
    assert issubclass(runtime.TrainingError, RuntimeError) and issubclass(runtime.MissingFeedError, KeyError)
    assert issubclass(transpiler.OnnxImportError, transpiler.ModelImportError)
    assert issubclass(transpiler.PaddleImportError, transpiler.ModelImportError)


def test_real_failures_are_caught_as_hetps_errors():
    spec = TableSpec(
        name="emb", kind="sparse", shape=[10, 2], dtype="float32", optimizer={"type": "sgd", "lr": 0.1}
    )
    table = SparseTable(spec)
    with pytest.raises(HetpsError, match="out of range"):
        table.pull(np.array([12]))
    prog = builder.Program()
    with builder.program_guard(prog):
        x = builder.data("x", [-1, 3])
        builder.fc(x, 2)
    with pytest.raises(HetpsError, match="loss"):
        transpiler.append_backward(prog, "x")  # a feed: no op produces it
    with pytest.raises(HetpsError, match="RunConfig.steps"):
        runtime.RunConfig(steps=0)
