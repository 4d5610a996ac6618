"""hetps transpiler: the IR, frontends (builder, ONNX, Paddle), passes, and the Plan."""

import importlib

from ops_registry.errors import HetpsError
from transpiler.config import TranspileConfig
from transpiler.errors import DeadlockError, ModelImportError, PlanError
from transpiler.frontends import builder
from transpiler.ir import Block, LintError, Op, Program, Var, grad_name
from transpiler.passes.backward import append_backward
from transpiler.plan import Plan, transpile
from transpiler.settings import ScaleConfig
from transpiler.tables import TableSpec

__all__ = [
    "Block",
    "builder",
    "DeadlockError",
    "HetpsError",
    "ModelImportError",
    "LintError",
    "Op",
    "OnnxImportError",
    "OnnxShapeWarning",
    "PaddleImportError",
    "Plan",
    "PlanError",
    "Program",
    "ScaleConfig",
    "TableSpec",
    "TranspileConfig",
    "UnsupportedOnnxOpsError",
    "Var",
    "append_backward",
    "from_onnx",
    "from_paddle",
    "from_torch",
    "grad_name",
    "inference_program",
    "to_onnx",
    "transpile",
]

# Imported on first use (PEP 562): the ONNX, Paddle and torch frontends and the exporters pull in
# onnx (seconds of import time) that a trainer or shard process never needs.
_LAZY = {
    "inference_program": "transpiler.exporters.forward",
    "to_onnx": "transpiler.exporters.onnx",
    "OnnxImportError": "transpiler.frontends.onnx.importer",
    "OnnxShapeWarning": "transpiler.frontends.onnx.importer",
    "UnsupportedOnnxOpsError": "transpiler.frontends.onnx.importer",
    "from_onnx": "transpiler.frontends.onnx.importer",
    "PaddleImportError": "transpiler.frontends.paddle.importer",
    "from_paddle": "transpiler.frontends.paddle.importer",
    "from_torch": "transpiler.frontends.torch",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'transpiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
