"""Shape and layout ops, data feeding and constants (reductions: reduce.py)."""

from __future__ import annotations

from ops_registry.base import OpDef, register, scatter_add, static_arg, unbroadcast
from ops_registry.shapes import same_as


def _concat(xp, ins, attrs):
    """concat_result = the inputs joined along `axis`."""
    return {"concat_result": xp.concatenate(ins["inputs"], axis=attrs["axis"])}


def _concat_vjp(xp, ins, outs, douts, attrs):
    xs, g = ins["inputs"], douts["concat_result"]
    axis = attrs["axis"] % g.ndim
    bounds, acc = [], 0
    for x in xs[:-1]:
        acc += x.shape[axis]
        bounds.append(acc)
    return {"inputs": xp.split(g, bounds, axis=axis)}


def _concat_shape(s, attrs):
    xs = s["inputs"]
    axis = attrs["axis"] % len(xs[0])
    for i, x in enumerate(xs[1:], 1):
        if len(x) != len(xs[0]) or any(
            a != b and -1 not in (a, b) for j, (a, b) in enumerate(zip(x, xs[0], strict=True)) if j != axis
        ):
            raise ValueError(f"input {i} has shape {list(x)}, expected {list(xs[0])} except on axis {axis}")
    sizes = [x[axis] for x in xs]
    total = -1 if -1 in sizes else sum(sizes)
    return {"concat_result": tuple(total if i == axis else d for i, d in enumerate(xs[0]))}


register(
    OpDef(
        "concat",
        "light",
        ("inputs*",),
        ("concat_result",),
        _concat,
        _concat_vjp,
        infer_shape=_concat_shape,
        onnx="Concat",
        attrs={"axis": 0},
    )
)


def _target_shape(in_shape, shape, allowzero=0):
    """ONNX Reshape's target: 0 copies the input dim (unless allowzero), -1 is inferred."""
    return tuple(in_shape[i] if (d == 0 and not allowzero) else d for i, d in enumerate(shape))


def _reshape(xp, ins, attrs):
    """reshaped = data with `shape` (ONNX Reshape: 0 copies a dim, -1 is inferred)."""
    x = ins["data"]
    shape = static_arg(ins, attrs, "shape")
    return {"reshaped": x.reshape(_target_shape(x.shape, shape, attrs["allowzero"]))}


def _reshape_shape(s, attrs):
    if attrs.get("shape") is None:  # a tensor computed at run time
        return {}
    t = _target_shape(s["data"], attrs["shape"], attrs.get("allowzero", 0))
    known = [d for d in s["data"]]
    if -1 in known or t.count(-1) != 1:
        return {"reshaped": t}
    total = 1
    for d in known:
        total *= d
    rest = 1
    for d in t:
        rest *= d if d != -1 else 1
    return {"reshaped": tuple(total // rest if d == -1 else d for d in t)}


register(
    OpDef(
        "reshape",
        "light",
        ("data", "shape?"),
        ("reshaped",),
        _reshape,
        lambda xp, i, o, d, a: {"data": d["reshaped"].reshape(i["data"].shape)},
        no_grad=("shape",),
        infer_shape=_reshape_shape,
        onnx="Reshape",
        attrs={"shape": None, "allowzero": 0},
    )
)


def _cast(xp, ins, attrs):
    """output = input converted to dtype `to`, a numpy dtype name such as "float32" (ONNX Cast;
    an importer maps ONNX's TensorProto enum to the name)."""
    return {"output": ins["input"].astype(attrs["to"], copy=False)}


register(
    OpDef(
        "cast",
        "light",
        ("input",),
        ("output",),
        _cast,
        lambda xp, i, o, d, a: {"input": d["output"].astype(i["input"].dtype, copy=False)},
        infer_shape=same_as("input", "output"),
        onnx="Cast",
        attrs={"to": "float32"},
    )
)


def _data(xp, ins, attrs):
    """Out = the fed value (the executor places feeds; this op marks where data enters)."""
    raise RuntimeError("data ops are executed by the executor's feed handling")


register(OpDef("data", "io", (), ("Out",), _data, infer_shape=lambda s, a: {"Out": tuple(a["shape"])}))


def _fill_constant(xp, ins, attrs):
    """Out = a tensor of `shape` filled with `value` (shape of input `Like` when given)."""
    import numpy as np

    shape = ins["Like"].shape if "Like" in ins else tuple(attrs["shape"])
    dtype = ins["Like"].dtype if "Like" in ins else np.dtype(attrs["dtype"])
    return {"Out": xp.full(shape, attrs["value"], dtype=dtype)}


register(
    OpDef(
        "fill_constant",
        "light",
        ("Like?",),
        ("Out",),
        _fill_constant,
        attrs={"value": 0.0, "shape": (), "dtype": "float32"},
    )
)


def _constant(xp, ins, attrs):
    """output = `value` (nested lists, as JSON holds them) as an array of `dtype`: a small constant
    that travels inside the program (an ONNX import's integer indices, scalar factors)."""
    import numpy as np

    return {"output": xp.asarray(np.array(attrs["value"], dtype=attrs["dtype"]))}


def _constant_shape(s, attrs):
    import numpy as np

    return {"output": np.shape(attrs["value"])}


register(
    OpDef(
        "constant",
        "light",
        (),
        ("output",),
        _constant,
        infer_shape=_constant_shape,
        attrs={"value": 0.0, "dtype": "float32"},
    )
)


def _init(xp, ins, attrs):
    """Out = a parameter initialised from `initializer` (deterministic per row; see initializers)."""
    from ops_registry.initializers import init_rows

    return {"Out": xp.asarray(init_rows(attrs["initializer"], attrs["shape"], attrs["dtype"]))}


register(OpDef("init", "init", (), ("Out",), _init, infer_shape=lambda s, a: {"Out": tuple(a["shape"])}))


def _layout(name, onnx, fwd, doc, slots, args=(), attrs=None, infer=None):
    """Register an op that only moves elements, `slots` = (input, output) as in ONNX's schema; the
    gradient reshapes the output gradient back (`fwd` must then be a reshape), unless an explicit
    vjp is registered instead. `args` are ONNX tensor inputs taken as static arguments."""
    x_, y_ = slots

    def kernel(xp, ins, a):
        return {y_: fwd(xp, ins[x_], {**a, **{k: static_arg(ins, a, k) for k in args}})}

    kernel.__doc__ = doc
    register(
        OpDef(
            name,
            "light",
            (x_, *(f"{k}?" for k in args)),
            (y_,),
            kernel,
            lambda xp, i, o, d, a: {x_: d[y_].reshape(i[x_].shape)},
            no_grad=args,
            infer_shape=infer,
            onnx=onnx,
            attrs={**{k: None for k in args}, **(attrs or {})},
        )
    )


def _norm_axes(axes, ndim: int) -> tuple[int, ...]:
    return tuple(sorted(a % ndim for a in axes))


def _flatten(xp, x, a):
    axis = a["axis"] + x.ndim if a["axis"] < 0 else a["axis"]  # in [-r, r]
    lead = 1
    for d in x.shape[:axis]:
        lead *= d
    return x.reshape(lead, -1) if x.size else x.reshape(lead, 0)


def _squeeze(xp, x, a):
    if a["axes"] is None:
        return x.reshape([d for d in x.shape if d != 1])
    return x.reshape([d for i, d in enumerate(x.shape) if i not in _norm_axes(a["axes"], x.ndim)])


def _unsqueeze(xp, x, a):
    axes = _norm_axes(a["axes"], x.ndim + len(a["axes"]))
    shape = list(x.shape)
    for ax in axes:
        shape.insert(ax, 1)
    return x.reshape(shape)


_layout(
    "identity",
    "Identity",
    lambda xp, x, a: x,
    "output = input.",
    ("input", "output"),
    infer=same_as("input", "output"),
)
_layout(
    "flatten",
    "Flatten",
    _flatten,
    "output = input as a matrix [prod(shape[:axis]), prod(shape[axis:])].",
    ("input", "output"),
    attrs={"axis": 1},
)
_layout(
    "squeeze",
    "Squeeze",
    _squeeze,
    "squeezed = data without the size-1 `axes` (all when absent).",
    ("data", "squeezed"),
    args=("axes",),
)
_layout(
    "unsqueeze",
    "Unsqueeze",
    _unsqueeze,
    "expanded = data with size-1 dims inserted at `axes` (positions in the output).",
    ("data", "expanded"),
    args=("axes",),
)


def _transpose(xp, ins, attrs):
    """transposed = data with its dims permuted by `perm` (reversed when absent)."""
    return {"transposed": xp.transpose(ins["data"], attrs["perm"])}


def _transpose_vjp(xp, ins, outs, douts, attrs):
    perm = attrs["perm"] or list(range(ins["data"].ndim))[::-1]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return {"data": xp.transpose(douts["transposed"], inverse)}


register(
    OpDef(
        "transpose",
        "light",
        ("data",),
        ("transposed",),
        _transpose,
        _transpose_vjp,
        onnx="Transpose",
        attrs={"perm": None},
        infer_shape=lambda s, a: {
            "transposed": tuple(s["data"][p] for p in a["perm"])
            if a.get("perm")
            else tuple(reversed(s["data"]))
        },
    )
)


def _shape(xp, ins, attrs):
    """shape = data's shape as int64, dims [start, end) (Python slice clamping, as ONNX Shape)."""
    import numpy as np

    return {"shape": xp.asarray(np.array(ins["data"].shape[attrs["start"] : attrs["end"]], dtype=np.int64))}


register(
    OpDef("shape", "light", ("data",), ("shape",), _shape, onnx="Shape", attrs={"start": 0, "end": None})
)


def _constant_of_shape(xp, ins, attrs):
    """output = a tensor of shape `input` filled with `value` of `dtype` (ONNX ConstantOfShape's
    one-element `value` tensor, held as a scalar and a dtype name)."""
    shape = [int(d) for d in static_arg(ins, attrs, "input")]
    return {"output": xp.full(shape, attrs["value"], dtype=attrs["dtype"])}


register(
    OpDef(
        "constant_of_shape",
        "light",
        ("input?",),
        ("output",),
        _constant_of_shape,
        onnx="ConstantOfShape",
        attrs={"input": None, "value": 0.0, "dtype": "float32"},
    )
)


def _slices(shape, attrs, ins) -> tuple[slice, ...]:
    """ONNX Slice's starts / ends / axes / steps as Python slices (negative indices counted from the
    end, then clamped the way ONNX clamps)."""
    starts, ends = static_arg(ins, attrs, "starts"), static_arg(ins, attrs, "ends")
    axes = static_arg(ins, attrs, "axes") or list(range(len(starts)))
    steps = static_arg(ins, attrs, "steps") or [1] * len(starts)
    out = [slice(None)] * len(shape)
    for st, en, ax, sp in zip(starts, ends, axes, steps, strict=True):
        d = shape[ax]
        st, en = st + d if st < 0 else st, en + d if en < 0 else en
        if sp > 0:
            st, en = min(max(st, 0), d), min(max(en, 0), d)
        else:
            st, en = min(max(st, 0), d - 1), min(max(en, -1), d - 1)
        out[ax] = slice(st, en if en >= 0 else None, sp)
    return tuple(out)


def _slice(xp, ins, attrs):
    """output = data[starts:ends:steps] on `axes` (ONNX Slice)."""
    return {"output": ins["data"][_slices(ins["data"].shape, attrs, ins)]}


def _slice_vjp(xp, ins, outs, douts, attrs):
    x = ins["data"]
    g = xp.zeros(x.shape, dtype=douts["output"].dtype)
    g[_slices(x.shape, attrs, ins)] = douts["output"]
    return {"data": g}


_SLICE_ARGS = ("starts", "ends", "axes", "steps")
register(
    OpDef(
        "slice",
        "light",
        ("data", *(f"{k}?" for k in _SLICE_ARGS)),
        ("output",),
        _slice,
        _slice_vjp,
        no_grad=_SLICE_ARGS,
        onnx="Slice",
        attrs={k: None for k in _SLICE_ARGS},
    )
)


def _expand(xp, ins, attrs):
    """output = input broadcast with `shape` (ONNX Expand: bidirectional, so dims may stay)."""
    import numpy as np

    x = ins["input"]
    shape = np.broadcast_shapes(x.shape, tuple(int(d) for d in static_arg(ins, attrs, "shape")))
    return {"output": xp.broadcast_to(x, shape).copy()}


register(
    OpDef(
        "expand",
        "light",
        ("input", "shape?"),
        ("output",),
        _expand,
        lambda xp, i, o, d, a: {"input": unbroadcast(xp, d["output"], i["input"].shape)},
        no_grad=("shape",),
        onnx="Expand",
        attrs={"shape": None},
    )
)


def _tile(xp, ins, attrs):
    """output = input repeated `repeats[i]` times along dim i."""
    return {"output": xp.tile(ins["input"], [int(r) for r in static_arg(ins, attrs, "repeats")])}


def _tile_vjp(xp, ins, outs, douts, attrs):
    x, g = ins["input"], douts["output"]
    reps = [int(r) for r in static_arg(ins, attrs, "repeats")]
    split = [n for r, d in zip(reps, x.shape, strict=True) for n in (r, d)]
    return {"input": g.reshape(split).sum(axis=tuple(range(0, 2 * x.ndim, 2)))}


register(
    OpDef(
        "tile",
        "light",
        ("input", "repeats?"),
        ("output",),
        _tile,
        _tile_vjp,
        no_grad=("repeats",),
        onnx="Tile",
        attrs={"repeats": None},
    )
)


def _split_bounds(n: int, attrs, ins) -> list[int]:
    """Where to cut a dim of size n: by the `split` sizes, else into `num_outputs` parts of
    ceil(n / num_outputs) (the last one smaller), as ONNX Split-18 does."""
    sizes = static_arg(ins, attrs, "split")
    if sizes is None:
        k = attrs["num_outputs"]
        chunk = -(-n // k)
        sizes = [min(chunk, max(n - chunk * i, 0)) for i in range(k)]
    if sum(sizes) != n:
        raise ValueError(f"split sizes {sizes} do not add up to the dim's size {n}")
    bounds, acc = [], 0
    for s in sizes[:-1]:
        acc += s
        bounds.append(acc)
    return bounds


def _split(xp, ins, attrs):
    """outputs = input cut along `axis` by `split` sizes, or into `num_outputs` near-equal parts."""
    x = ins["input"]
    axis = attrs["axis"] % x.ndim
    return {"outputs": xp.split(x, _split_bounds(x.shape[axis], attrs, ins), axis=axis)}


def _split_vjp(xp, ins, outs, douts, attrs):
    parts = [
        g if g is not None else xp.zeros_like(o)
        for g, o in zip(douts["outputs"], outs["outputs"], strict=True)
    ]
    return {"input": xp.concatenate(parts, axis=attrs["axis"])}


register(
    OpDef(
        "split",
        "light",
        ("input", "split?"),
        ("outputs*",),
        _split,
        _split_vjp,
        no_grad=("split",),
        onnx="Split",
        attrs={"axis": 0, "split": None, "num_outputs": None},
    )
)


def _gather(xp, ins, attrs):
    """output = data indexed by `indices` along `axis` (negative indices count from the end)."""
    return {"output": xp.take(ins["data"], ins["indices"], axis=attrs["axis"])}


def _gather_vjp(xp, ins, outs, douts, attrs):
    """Scatter-add the output gradient back into the gathered positions of data."""
    x, idx, g = ins["data"], ins["indices"], douts["output"]
    axis = attrs["axis"] % x.ndim
    idx = xp.where(idx < 0, idx + x.shape[axis], idx).reshape(-1)
    k = ins["indices"].ndim
    # g: data.shape[:axis] + indices.shape + data.shape[axis+1:] -> indices dims first, flattened
    g = xp.moveaxis(g, tuple(range(axis, axis + k)), tuple(range(k))).reshape(
        (-1, *x.shape[:axis], *x.shape[axis + 1 :])
    )
    out = xp.zeros(x.shape, dtype=g.dtype)
    scatter_add(xp, xp.moveaxis(out, axis, 0), idx, g)
    return {"data": out}


def _gather_shape(s, attrs):
    data, axis = s["data"], attrs["axis"] % len(s["data"])
    return {"output": data[:axis] + tuple(s["indices"]) + data[axis + 1 :]}


register(
    OpDef(
        "gather",
        "light",
        ("data", "indices"),
        ("output",),
        _gather,
        _gather_vjp,
        no_grad=("indices",),
        onnx="Gather",
        attrs={"axis": 0},
        infer_shape=_gather_shape,
    )
)


def element_index(xp, x, idx, axis):
    """Full index tuple for GatherElements' positions: idx on `axis`, the element's own position
    on every other axis."""
    idx = xp.where(idx < 0, idx + x.shape[axis], idx)
    grid = list(xp.indices(idx.shape, sparse=True))
    grid[axis] = idx
    return tuple(grid)


def _gather_elements(xp, ins, attrs):
    """output[i][j][k] = data[indices[i][j][k]][j][k] for axis 0 (and likewise per axis)."""
    x = ins["data"]
    return {"output": x[element_index(xp, x, ins["indices"], attrs["axis"] % x.ndim)]}


def _gather_elements_vjp(xp, ins, outs, douts, attrs):
    x = ins["data"]
    out = xp.zeros(x.shape, dtype=douts["output"].dtype)
    scatter_add(xp, out, element_index(xp, x, ins["indices"], attrs["axis"] % x.ndim), douts["output"])
    return {"data": out}


register(
    OpDef(
        "gather_elements",
        "light",
        ("data", "indices"),
        ("output",),
        _gather_elements,
        _gather_elements_vjp,
        no_grad=("indices",),
        onnx="GatherElements",
        attrs={"axis": 0},
        infer_shape=lambda s, a: {"output": s["indices"]},
    )
)
