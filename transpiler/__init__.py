"""hetps transpiler: the IR, frontends (builder, ONNX, Paddle), passes, and the Plan."""

from .backward import append_backward
from .ir import Block, Op, Program, Var, grad_name

__all__ = ["Block", "Op", "Program", "Var", "append_backward", "grad_name"]
