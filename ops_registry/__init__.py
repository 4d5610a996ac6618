"""hetps ops registry: one OpDef per op type (type info, shape rule, numpy kernel, gradient rule).

Importing the package registers every op family.
"""

from . import comm, embedding, indexing, loss, math, math_exported, nn, optimizer, reduce, rnn, tensor  # noqa: F401
from .base import (
    CATEGORIES,
    OpDef,
    SparseRows,
    UnknownOpError,
    by_onnx,
    get_op,
    has_op,
    list_ops,
    register,
    scatter_add,
    unbroadcast,
)
from .initializers import init_rows

__all__ = [
    "CATEGORIES", "OpDef", "SparseRows", "UnknownOpError", "by_onnx", "get_op", "has_op",
    "init_rows", "list_ops", "register", "scatter_add", "unbroadcast",
]
