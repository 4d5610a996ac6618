"""hetps ops registry: one OpDef per op type (type info, shape rule, numpy kernel, gradient rule).

Importing the package registers every op family.
"""

# Each op family registers its ops when imported.
from ops_registry import (  # noqa: F401
    comm,
    conv,
    embedding,
    indexing,
    logic,
    loss,
    math,
    nn,
    optimizer,
    reduce,
    rnn,
    tensor,
)
from ops_registry.base import (
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
from ops_registry.initializers import init_rows

__all__ = [
    "CATEGORIES",
    "OpDef",
    "SparseRows",
    "UnknownOpError",
    "by_onnx",
    "get_op",
    "has_op",
    "init_rows",
    "list_ops",
    "register",
    "scatter_add",
    "unbroadcast",
]
