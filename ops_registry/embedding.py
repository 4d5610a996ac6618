"""Embedding lookup: the sparse-table access that CTR models are made of."""

from __future__ import annotations

import numpy as np

from ops_registry.base import OpDef, SparseRows, cupyx_of, register, scatter_add


def id_range_error(ids, height: int) -> str | None:
    """None when every id lies in [0, height), else what is wrong: the range and up to 5 ids outside
    it. `height` <= 0 is a table without a bound: every 64-bit id is one (an int64 id below 0 is
    the bit pattern of a uint64 id >= 2^63, e.g. a raw 64-bit hash). The one id-range rule of the
    kernels, the parameter server's tables and the in-memory oracle."""
    if height <= 0 or not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < height):
        return None
    bad = (ids < 0) | (ids >= height)
    return f"ids out of range [0, {height}): {ids[bad].reshape(-1)[:5].tolist()}"


def check_ids(xp, ids, height: int) -> None:
    """Raise IndexError when an id falls outside [0, height) (`id_range_error`)."""
    error = id_range_error(ids, height)
    if error:
        raise IndexError(error)


def _embedding(xp, ins, attrs):
    """Out[..., :] = W[Ids[...], :] — Out has shape Ids.shape + (dim,) (ONNX Gather, axis 0)."""
    w, ids = ins["W"], ins["Ids"]
    check_ids(xp, ids, w.shape[0])
    return {"Out": xp.take(w, ids, axis=0)}


def _embedding_vjp(xp, ins, outs, douts, attrs):
    """dW as row-sparse (rows = the looked-up ids) when is_sparse, else dense scatter-add."""
    w, ids, g = ins["W"], ins["Ids"], douts["Out"]
    grad = SparseRows(ids.reshape(-1), g.reshape(-1, w.shape[1]), w.shape[0])
    return {"W": grad if attrs["is_sparse"] else grad.to_dense(xp)}


register(
    OpDef(
        "embedding",
        "sparse",
        ("W", "Ids"),
        ("Out",),
        _embedding,
        _embedding_vjp,
        no_grad=("Ids",),
        infer_shape=lambda s, a: {"Out": tuple(s["Ids"]) + (s["W"][1],)},
        attrs={"is_sparse": True},
    )
)


def _bag_positions(xp, starts, ends):
    """(position in Ids, bag, bag sizes) of every element of the bags [starts[b], ends[b]), bag by
    bag; there are len(ends) bags (torch's export passes all offsets as starts, one more)."""
    starts = starts[: ends.size]
    lengths = xp.maximum(ends - starts, 0)
    bag = xp.repeat(xp.arange(lengths.size), lengths)
    first = xp.cumsum(lengths) - lengths  # where each bag's elements begin in the flat list
    pos = xp.arange(int(lengths.sum())) - xp.repeat(first, lengths) + xp.repeat(starts, lengths)
    return pos, bag, lengths


def _embedding_bag(xp, ins, attrs):
    """Out[b] = sum / mean / max over i in [Starts[b], Ends[b]), b < len(Ends), of W[Ids[i]] (times
    PerSampleWeights[i] for "sum"): torch's nn.EmbeddingBag, one row per bag. An empty bag gives 0
    (sum), NaN (mean) or -inf (max), as the ONNX Loop that torch exports it as computes."""
    w, ids = ins["W"], ins["Ids"]
    check_ids(xp, ids, w.shape[0])
    pos, bag, lengths = _bag_positions(xp, ins["Starts"], ins["Ends"])
    rows = xp.take(w, ids[pos], axis=0)
    if "PerSampleWeights" in ins:
        rows = rows * ins["PerSampleWeights"][pos][:, None]
    mode = attrs["mode"]
    out = xp.full((lengths.size, w.shape[1]), -xp.inf if mode == "max" else 0, dtype=w.dtype)
    if mode == "max":
        _scatter_max(xp, out, bag, rows)
    else:
        scatter_add(xp, out, bag, rows)
    if mode == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):  # an empty bag's mean is NaN
            out = (out / lengths[:, None]).astype(w.dtype, copy=False)
    return {"Out": out}


def _scatter_max(xp, target, index, values) -> None:
    """target[index] = max(target[index], values), repeated indices included."""
    if xp.__name__ == "numpy":
        xp.maximum.at(target, index, values)
    else:  # cupy
        cupyx_of(xp).scatter_max(target, index, values)


def _embedding_bag_vjp(xp, ins, outs, douts, attrs):
    """dW (row-sparse when is_sparse): each element's row gets its bag's output gradient (/ the bag
    size for mean; for max only the elements equal to the bag's max, ties sharing it);
    dPerSampleWeights[i] = <Out grad of i's bag, W[Ids[i]]>."""
    w, ids, g = ins["W"], ins["Ids"], douts["Out"]
    pos, bag, lengths = _bag_positions(xp, ins["Starts"], ins["Ends"])
    mode = attrs["mode"]
    gb = g[bag]
    if mode == "mean":
        gb = gb / lengths[bag][:, None]
    elif mode == "max":
        hit = xp.take(w, ids[pos], axis=0) == outs["Out"][bag]
        ties = xp.zeros(g.shape, dtype=g.dtype)
        scatter_add(xp, ties, bag, hit.astype(g.dtype))
        gb = gb * hit / xp.maximum(ties[bag], 1)
    grads = {}
    if "PerSampleWeights" in ins:
        psw = ins["PerSampleWeights"]
        dpsw = xp.zeros(psw.shape, dtype=g.dtype)
        dpsw[pos] = (gb * xp.take(w, ids[pos], axis=0)).sum(axis=1)
        grads["PerSampleWeights"] = dpsw
        gb = gb * psw[pos][:, None]
    sparse = SparseRows(ids[pos], gb.astype(w.dtype, copy=False), w.shape[0])
    grads["W"] = sparse if attrs["is_sparse"] else sparse.to_dense(xp)
    return grads


register(
    OpDef(
        "embedding_bag",
        "sparse",
        ("W", "Ids", "Starts", "Ends", "PerSampleWeights?"),
        ("Out",),
        _embedding_bag,
        _embedding_bag_vjp,
        no_grad=("Ids", "Starts", "Ends"),
        infer_shape=lambda s, a: {"Out": (s["Ends"][0], s["W"][1])},
        attrs={"mode": "sum", "is_sparse": True},
    )
)
