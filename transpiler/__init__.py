"""hetps transpiler: the IR, frontends (builder, ONNX, Paddle), passes, and the Plan."""

from .backward import append_backward
from .inference import inference_program
from .ir import Block, Op, Program, Var, grad_name
from .paddle_import import PaddleImportError, from_paddle

__all__ = ["Block", "Op", "PaddleImportError", "Program", "Var", "append_backward", "from_paddle",
           "grad_name", "inference_program"]
