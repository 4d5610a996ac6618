"""Shape rules shared by many ops. Shapes are tuples; -1 is an unknown (batch) dimension."""

from __future__ import annotations


def broadcast(a: tuple, b: tuple) -> tuple:
    """Numpy/ONNX multidirectional broadcast of two shapes; ValueError when they disagree."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=False):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif x == -1 or y == -1:
            out.append(max(x, y))
        else:
            raise ValueError(f"shapes {a} and {b} do not broadcast")
    return tuple(out)


def same_as(slot: str, out: str):
    """A rule: output `out` has the shape of input `slot`."""
    return lambda s, attrs: {out: s[slot]}


def binary(out: str):
    return lambda s, attrs: {out: broadcast(s["A"], s["B"])}


def reduce(shape: tuple, axes, keepdims: bool) -> tuple:
    axes = range(len(shape)) if axes is None else [a % len(shape) for a in axes]
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)
