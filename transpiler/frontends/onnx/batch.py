"""A fixed leading batch dimension in an ONNX graph, made dynamic when the graph allows it.

Exporters that trace a model (torch's TorchScript exporter without `dynamic_axes`) write the batch
they traced with into every input's shape: `a` int64 [4, 26]. Such a graph can only be fed batches
of exactly that size, while training wants whatever batch the user picks. `free_batch` replaces the
fixed leading dimension of the graph inputs (and of the outputs that share it) by a symbolic one
when nothing in the graph depends on it, and says why not otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import numpy_helper, shape_inference

# Inputs (by position) that ONNX ops read as a shape, sizes or indices: a batch size written into
# one of them (Reshape to [4, 208]) ties the graph to that batch.
SHAPE_INPUTS = {
    "Reshape": (1,),
    "Expand": (1,),
    "ConstantOfShape": (0,),
    "Tile": (1,),
    "Slice": (1, 2),
    "Range": (0, 1, 2),
    "Resize": (3,),
    "Split": (1,),
    "Pad": (1,),
    "Upsample": (1,),
}
BATCH_DIM = "batch"


@dataclass(frozen=True)
class BatchDim:
    """What import did with the graph's leading input dimension.

    `fixed`: the batch size written in the graph (None when the inputs' leading dimension is
    already dynamic or the inputs do not share one); `freed`: it was made dynamic; `why_not`: why it
    was kept (empty when freed or when there was nothing to free)."""

    fixed: int | None = None
    freed: bool = False
    why_not: str = ""

    def message(self) -> str:
        if self.fixed is None:
            return ""
        if self.freed:
            return (
                f"the graph's inputs have a fixed batch dimension of {self.fixed}; it was made dynamic "
                "(any batch size trains). Keep it fixed with dynamic_batch=False (CLI: --fixed-batch)"
            )
        return (
            f"the graph's inputs have a fixed batch dimension of {self.fixed}, kept ({self.why_not}): "
            f"every micro-batch must have exactly {self.fixed} examples"
        )


def leading_batch(model: onnx.ModelProto) -> int | None:
    """The fixed leading dimension that all graph inputs (initializers aside) share, else None."""
    inits = {t.name for t in model.graph.initializer}
    dims = set()
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = vi.type.tensor_type.shape if vi.type.HasField("tensor_type") else None
        if shape is None or not shape.dim or not shape.dim[0].HasField("dim_value"):
            return None
        dims.add(shape.dim[0].dim_value)
    return dims.pop() if len(dims) == 1 else None


def _batch_in_shape_constant(model: onnx.ModelProto, batch: int) -> str:
    """The first node reading a constant shape / size that contains `batch`, described; else ''."""
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    for i, node in enumerate(model.graph.node):
        for k in SHAPE_INPUTS.get(node.op_type, ()):
            if k < len(node.input) and node.input[k] in consts:
                value = consts[node.input[k]]
                if value.dtype.kind in "iu" and batch in value.reshape(-1).tolist():
                    return (
                        f"{node.op_type} node {node.name or f'#{i}'} reads the constant "
                        f"{value.reshape(-1).tolist()}, which may be the batch size"
                    )
    return ""


def free_batch(model: onnx.ModelProto) -> tuple[onnx.ModelProto, BatchDim]:
    """(model with a dynamic leading input dimension, what was done); the model is not modified.

    The fixed dimension is freed only when every graph input shares it, no shape-like constant
    (Reshape's shape, Expand's shape, Tile's repeats, ...) contains it, and ONNX's strict shape
    inference accepts the freed graph."""
    batch = leading_batch(model)
    if batch is None:
        return model, BatchDim()
    if batch == 1:
        return model, BatchDim(batch, False, "a leading 1 may not be a batch dimension")
    why = _batch_in_shape_constant(model, batch)
    if why:
        return model, BatchDim(batch, False, why)
    freed = onnx.ModelProto()
    freed.CopyFrom(model)
    del freed.graph.value_info[:]  # inferred again from the freed inputs
    for vi in [*freed.graph.input, *freed.graph.output]:
        if not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value") and dims[0].dim_value == batch:
            dims[0].dim_param = BATCH_DIM  # clears dim_value (a oneof)
    try:
        shape_inference.infer_shapes(freed, strict_mode=True)
    except Exception as e:  # inference errors come as several exception types
        return model, BatchDim(batch, False, f"ONNX shape inference rejects a dynamic batch: {e}")
    return freed, BatchDim(batch, True)
