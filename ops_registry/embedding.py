"""Embedding lookup: the sparse-table access that CTR models are made of."""

from __future__ import annotations

from .base import OpDef, SparseRows, register


def check_ids(xp, ids, height: int) -> None:
    """Raise IndexError when an id falls outside [0, height)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= height):
        bad = ids[(ids < 0) | (ids >= height)].reshape(-1)[:5]
        raise IndexError(f"ids out of range [0, {height}): {bad.tolist()}")


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


register(OpDef("embedding", "sparse", ("W", "Ids"), ("Out",), _embedding, _embedding_vjp,
               no_grad=("Ids",), infer_shape=lambda s, a: {"Out": tuple(s["Ids"]) + (s["W"][1],)},
               attrs={"is_sparse": True}))
