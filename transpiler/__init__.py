"""hetps transpiler: the IR, frontends (builder, ONNX, Paddle), passes, and the Plan."""

from ops_registry.errors import HetpsError
from transpiler.config import TranspileConfig
from transpiler.errors import DeadlockError, ModelImportError, PlanError
from transpiler.exporters.forward import inference_program
from transpiler.exporters.onnx import to_onnx
from transpiler.frontends import builder
from transpiler.frontends.onnx.importer import (
    OnnxImportError,
    OnnxShapeWarning,
    UnsupportedOnnxOpsError,
    from_onnx,
)
from transpiler.frontends.paddle.importer import PaddleImportError, from_paddle
from transpiler.frontends.torch import from_torch
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
