"""Convolutions and padding with ONNX semantics (Conv, Pad).

Conv is computed as matrix products: a kernel-1 convolution (every kernel dim 1, strides 1, no
padding, one group: xDeepFM's CIN as a Conv1d / 1x1 Conv2d) is one batched matmul of W [M, C] with
X [N, C, P]; any other convolution gathers, for each kernel offset, the strided slice of the padded
input it multiplies (an explicit im2col made of slices, so numpy and cupy run the same code) and
does one batched matmul per group. The gradients are the adjoints of those two steps: matmuls, then
a strided add of each offset's columns back into the padded input.
"""

from __future__ import annotations

import itertools

import numpy as np

from ops_registry.base import OpDef, register, scatter_add, static_arg

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


# -- Conv ----------------------------------------------------------------------------------------
def conv_geometry(
    spatial: tuple[int, ...], kernel: tuple[int, ...], attrs: dict
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """(pads at the start, pads at the end, strides, dilations, output sizes) of each spatial dim,
    from ONNX Conv's `pads` / `strides` / `dilations` / `auto_pad`; a -1 (unknown) input size gives
    a -1 output size. SAME_UPPER puts the odd padding element at the end, SAME_LOWER at the start."""
    k = len(kernel)
    strides = list(attrs.get("strides") or [1] * k)
    dils = list(attrs.get("dilations") or [1] * k)
    pads = list(attrs.get("pads") or [0] * (2 * k))
    auto = attrs.get("auto_pad") or "NOTSET"
    if auto not in AUTO_PADS:
        raise ValueError(f"Conv: auto_pad {auto!r} is not one of {AUTO_PADS}")
    if len(strides) != k or len(dils) != k or len(pads) != 2 * k:
        raise ValueError(
            f"Conv: a {k}-d kernel needs {k} strides, {k} dilations and {2 * k} pads; got strides "
            f"{strides}, dilations {dils}, pads {pads}"
        )
    begins, ends, outs = pads[:k], pads[k:], []
    for i, (n, kk, s, d) in enumerate(zip(spatial, kernel, strides, dils, strict=True)):
        span = (kk - 1) * d + 1  # the dilated kernel's extent
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out = -1 if n < 0 else -(-n // s)
            total = 0 if n < 0 else max(0, (out - 1) * s + span - n)
            small, large = total // 2, total - total // 2
            begins[i], ends[i] = (small, large) if auto == "SAME_UPPER" else (large, small)
        else:
            if auto == "VALID":
                begins[i] = ends[i] = 0
            out = -1 if n < 0 else (n + begins[i] + ends[i] - span) // s + 1
        outs.append(out)
    return begins, ends, strides, dils, outs


def _kernel_of(attrs: dict, w_shape: tuple[int, ...]) -> tuple[int, ...]:
    kernel = tuple(w_shape[2:])
    given = attrs.get("kernel_shape")
    if given and tuple(given) != kernel:
        raise ValueError(f"Conv: kernel_shape {list(given)} differs from W's spatial dims {list(kernel)}")
    return kernel


def _setup(x, w, attrs):
    """The geometry and group sizes of one convolution, checked against the operands' shapes."""
    kernel = _kernel_of(attrs, w.shape)
    if x.ndim != w.ndim or x.ndim < 3:
        raise ValueError(f"Conv: X {list(x.shape)} and W {list(w.shape)} need the same rank (3 or more)")
    groups = int(attrs.get("group") or 1)
    n, c = x.shape[:2]
    m = w.shape[0]
    if c % groups or m % groups or w.shape[1] * groups != c:
        raise ValueError(
            f"Conv: {c} input channels, {m} output channels and W {list(w.shape)} do not fit group {groups}"
        )
    geo = conv_geometry(tuple(x.shape[2:]), kernel, attrs)
    if any(o <= 0 for o in geo[4]):
        raise ValueError(
            f"Conv: input {list(x.shape)} with kernel {list(kernel)} gives output sizes {geo[4]}: under 1"
        )
    return kernel, groups, geo


def _pointwise(kernel, groups, geo) -> bool:
    """A kernel-1 convolution without padding, stride or groups: one matmul."""
    begins, ends, strides, _, _ = geo
    unit = all(k == 1 for k in kernel) and all(s == 1 for s in strides)
    return unit and groups == 1 and not any(begins + ends)


def _offsets(kernel, geo):
    """For each kernel offset (row-major, as W stores them), the slices of the padded input it reads."""
    _, _, strides, dils, outs = geo
    for off in itertools.product(*(range(k) for k in kernel)):
        yield tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, s, n in zip(off, dils, strides, outs, strict=True)
        )


def _padded(xp, x, geo):
    begins, ends = geo[0], geo[1]
    if not any(begins + ends):
        return x
    return xp.pad(x, [(0, 0), (0, 0), *zip(begins, ends, strict=True)])


def _columns(xp, x, kernel, groups, geo):
    """[N, G, C/G * K, P]: each offset's slice of the padded input, channels then offsets (W's layout)."""
    n, c = x.shape[:2]
    xpad = _padded(xp, x, geo)
    cols = xp.stack(
        [xpad[(slice(None), slice(None), *sl)].reshape(n, c, -1) for sl in _offsets(kernel, geo)], axis=2
    )
    return cols.reshape(n, groups, -1, cols.shape[-1])


def _conv(xp, ins, attrs):
    """Y = the ONNX convolution of X [N, C, D1, ...] with W [M, C/group, k1, ...] (cross-correlation,
    as ONNX defines it), with `pads` (start values then end values per spatial dim), `strides`,
    `dilations`, `group` and `auto_pad`, plus B [M] per output channel when given."""
    x, w = ins["X"], ins["W"]
    kernel, groups, geo = _setup(x, w, attrs)
    n, m, outs = x.shape[0], w.shape[0], geo[4]
    if _pointwise(kernel, groups, geo):
        y = xp.matmul(w.reshape(m, -1), x.reshape(n, x.shape[1], -1))
    else:
        cols = _columns(xp, x, kernel, groups, geo)
        y = xp.matmul(w.reshape(groups, m // groups, -1), cols)
    y = y.reshape(n, m, *outs)
    if "B" in ins:
        y = y + ins["B"].reshape(1, m, *([1] * len(outs)))
    return {"Y": y.astype(x.dtype, copy=False)}


def _conv_vjp(xp, ins, outs_, douts, attrs):
    x, w, g = ins["X"], ins["W"], douts["Y"]
    kernel, groups, geo = _setup(x, w, attrs)
    n, c, m = x.shape[0], x.shape[1], w.shape[0]
    grads = {}
    if "B" in ins:
        grads["B"] = g.sum(axis=(0, *range(2, g.ndim))).reshape(ins["B"].shape)
    if _pointwise(kernel, groups, geo):
        x2, g2, w2 = x.reshape(n, c, -1), g.reshape(n, m, -1), w.reshape(m, c)
        grads["W"] = xp.tensordot(g2, x2, axes=([0, 2], [0, 2])).reshape(w.shape)
        grads["X"] = xp.matmul(w2.T, g2).reshape(x.shape)
        return grads
    gr = g.reshape(n, groups, m // groups, -1)
    wr = w.reshape(groups, m // groups, -1)
    cols = _columns(xp, x, kernel, groups, geo)
    grads["W"] = xp.matmul(gr, xp.swapaxes(cols, -1, -2)).sum(axis=0).reshape(w.shape)
    dcols = xp.matmul(xp.swapaxes(wr, -1, -2), gr).reshape(n, c, -1, *geo[4])
    begins = geo[0]
    dpad = xp.zeros(
        (n, c, *(d + b + e for d, b, e in zip(x.shape[2:], begins, geo[1], strict=True))), dtype=g.dtype
    )
    for k, sl in enumerate(_offsets(kernel, geo)):
        dpad[(slice(None), slice(None), *sl)] += dcols[:, :, k]
    crop = tuple(slice(b, b + d) for b, d in zip(begins, x.shape[2:], strict=True))
    grads["X"] = dpad[(slice(None), slice(None), *crop)]
    return grads


def _conv_shape(s, attrs):
    x, w = tuple(s["X"]), tuple(s["W"])
    if len(x) < 3 or len(w) != len(x) or any(d < 0 for d in w):
        return {}
    outs = conv_geometry(x[2:], _kernel_of(attrs, w), attrs)[4]
    return {"Y": (x[0], w[0], *outs)}


register(
    OpDef(
        "conv",
        "dense",
        ("X", "W", "B?"),
        ("Y",),
        _conv,
        _conv_vjp,
        infer_shape=_conv_shape,
        onnx="Conv",
        attrs={
            "auto_pad": "NOTSET",
            "group": 1,
            "kernel_shape": None,
            "pads": None,
            "strides": None,
            "dilations": None,
        },
    )
)


# -- Pad -----------------------------------------------------------------------------------------
PAD_MODES = ("constant", "reflect", "edge", "wrap")


def pad_widths(ndim: int, ins: dict, attrs: dict) -> list[tuple[int, int]]:
    """(start, end) padding of every axis from ONNX Pad's `pads` (all starts, then all ends, over
    `axes` when given, else over every axis); negative values remove elements."""
    pads = static_arg(ins, attrs, "pads")
    if pads is None:
        raise ValueError("Pad: no pads (neither an input nor an attribute)")
    axes = static_arg(ins, attrs, "axes")
    axes = list(range(ndim)) if axes is None else [int(a) % ndim for a in axes]
    if len(pads) != 2 * len(axes):
        raise ValueError(f"Pad: {len(pads)} pads for {len(axes)} axes (it needs two per axis)")
    widths = [(0, 0)] * ndim
    for i, a in enumerate(axes):
        widths[a] = (int(pads[i]), int(pads[len(axes) + i]))
    return widths


def _pad_value(ins: dict, attrs: dict) -> float:
    v = static_arg(ins, attrs, "constant_value")
    if v is None:
        v = attrs.get("value")  # Pad before opset 11: an attribute
    return 0 if v is None else np.asarray(v).reshape(-1)[0].item()


def _mode(attrs: dict) -> str:
    mode = attrs.get("mode") or "constant"
    if mode not in PAD_MODES:
        raise ValueError(f"Pad: mode {mode!r} is not one of {PAD_MODES}")
    return mode


def _crop(shape, widths) -> tuple[slice, ...]:
    return tuple(slice(max(-b, 0), d - max(-e, 0)) for (b, e), d in zip(widths, shape, strict=True))


def _pad(xp, ins, attrs):
    """output = data padded by `pads` on `axes` (ONNX Pad): `constant` fills with constant_value
    (0 when absent), `reflect` mirrors without repeating the edge, `edge` repeats the edge, `wrap`
    continues from the other side; negative pads remove elements from that side."""
    x = ins["data"]
    widths = pad_widths(x.ndim, ins, attrs)
    mode = _mode(attrs)
    x = x[_crop(x.shape, widths)]
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    if not any(b or e for b, e in grow):
        return {"output": x}
    if mode == "constant":
        y = xp.pad(x, grow, mode="constant", constant_values=_pad_value(ins, attrs))
    else:
        y = xp.pad(x, grow, mode=mode)
    return {"output": y.astype(x.dtype, copy=False)}


def pad_index(size: int, start: int, end: int, mode: str) -> np.ndarray:
    """For one axis of `size` padded by (start, end): the input position each output position
    copies, -1 where a constant fills it (the same rule as the kernel: np.pad of the positions)."""
    pos = np.arange(size)[max(-start, 0) : size - max(-end, 0)]
    grow = (max(start, 0), max(end, 0))
    if mode == "constant":
        return np.pad(pos, grow, mode="constant", constant_values=-1)
    return np.pad(pos, grow, mode=mode)


def _pad_vjp(xp, ins, outs, douts, attrs):
    """Each input element's gradient: the sum over the output positions that copy it (axis by axis)."""
    x, g = ins["data"], douts["output"]
    widths, mode = pad_widths(x.ndim, ins, attrs), _mode(attrs)
    for axis, (b, e) in enumerate(widths):
        if not (b or e):
            continue
        idx = pad_index(x.shape[axis], b, e, mode)
        keep = np.flatnonzero(idx >= 0)
        part = xp.moveaxis(xp.take(g, xp.asarray(keep), axis=axis), axis, 0)
        acc = xp.zeros((x.shape[axis], *part.shape[1:]), dtype=g.dtype)
        scatter_add(xp, acc, xp.asarray(idx[keep]), part)
        g = xp.moveaxis(acc, 0, axis)
    return {"data": xp.ascontiguousarray(g)}


def _pad_shape(s, attrs):
    if attrs.get("pads") is None or (attrs.get("axes") is None and len(attrs["pads"]) != 2 * len(s["data"])):
        return {}
    widths = pad_widths(len(s["data"]), {}, attrs)
    return {"output": tuple(-1 if d < 0 else d + b + e for d, (b, e) in zip(s["data"], widths, strict=True))}


register(
    OpDef(
        "pad",
        "light",
        ("data", "pads?", "constant_value?", "axes?"),
        ("output",),
        _pad,
        _pad_vjp,
        no_grad=("pads", "constant_value", "axes"),
        infer_shape=_pad_shape,
        onnx="Pad",
        attrs={"mode": "constant", "pads": None, "constant_value": None, "axes": None, "value": None},
    )
)
