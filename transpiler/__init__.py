"""hetps transpiler: the IR, frontends (builder, ONNX, Paddle), passes, and the Plan."""

from .backward import append_backward
from .config import TranspileConfig
from .errors import DeadlockError, PlanError
from .inference import inference_program
from .ir import Block, LintError, Op, Program, Var, grad_name
from .onnx_export import to_onnx
from .onnx_import import OnnxImportError, OnnxShapeWarning, UnsupportedOnnxOpsError, from_onnx
from .paddle_import import PaddleImportError, from_paddle
from .plan import Plan, transpile
from .tables import TableSpec

__all__ = ["Block", "DeadlockError", "LintError", "Op", "OnnxImportError", "OnnxShapeWarning",
           "PaddleImportError", "Plan", "PlanError", "Program", "TableSpec",
           "TranspileConfig", "UnsupportedOnnxOpsError",
           "Var", "append_backward", "from_onnx", "from_paddle", "grad_name", "inference_program", "to_onnx",
           "transpile"]
