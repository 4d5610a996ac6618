"""Metrics of binary predictions (CTR): AUC, log loss, calibration, group AUC, per-slice figures.
Each takes plain arrays (labels, predictions, and group or slice keys), one value per example."""

from __future__ import annotations

import numpy as np


def auc(labels, preds) -> float:
    """Area under the ROC curve: the Mann-Whitney U statistic with tied scores given average ranks."""
    y = np.asarray(labels).reshape(-1) > 0.5
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    n_pos = int(np.count_nonzero(y))
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    sp = p[order]
    # average rank within runs of equal scores (the driver computes this every step: no np.r_)
    first = np.empty(sp.size, bool)
    first[0] = True
    np.not_equal(sp[1:], sp[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    counts = np.diff(starts, append=sp.size)
    ranks = np.empty(sp.size)
    ranks[order] = np.repeat(starts + (counts + 1) / 2.0, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def task_aucs(labels: np.ndarray, preds: np.ndarray, tasks: list[str]) -> dict[str, float]:
    """Per task of a multi-task model: the AUC of column k of `preds` against column k of
    `labels` ([examples, tasks] each, in `tasks` order); NaN for a task without binary labels."""
    y, p = np.asarray(labels), np.asarray(preds)
    if y.shape != p.shape or y.ndim != 2 or y.shape[1] != len(tasks):
        raise ValueError(
            f"task_aucs needs [examples, {len(tasks)}] labels and preds, got {y.shape} and {p.shape}"
        )
    return {
        t: auc(y[:, k], p[:, k]) if bool(np.isin(y[:, k], (0, 1)).all()) else float("nan")
        for k, t in enumerate(tasks)
    }


def logloss(labels, preds, eps: float = 1e-15) -> float:
    """Mean binary log loss of probabilities `preds` (clipped to [eps, 1 - eps]) against 0/1 labels."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(preds, dtype=np.float64).reshape(-1), eps, 1 - eps)
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def calibration(labels, preds) -> float:
    """Predicted CTR / observed CTR: mean(preds) / mean(labels) (1 = calibrated; NaN: no positive)."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    return float(p.mean() / y.mean()) if y.size and y.sum() > 0 else float("nan")


def gauc(labels, preds, groups) -> float:
    """Group AUC: the AUC within each group (e.g. per user), averaged weighted by the group's
    impressions; groups whose labels are all one class have no AUC and are left out (NaN if none
    is left)."""
    y = np.asarray(labels).reshape(-1)
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    g = np.asarray(groups).reshape(-1)
    order = np.argsort(g, kind="stable")
    starts = np.flatnonzero(np.r_[True, g[order][1:] != g[order][:-1]])
    total = weight = 0.0
    for rows in np.split(order, starts[1:]):
        a = auc(y[rows], p[rows])
        if a == a:  # not NaN
            total += a * rows.size
            weight += rows.size
    return total / weight if weight else float("nan")


def sliced(labels, preds, keys, names: dict | None = None) -> dict[str, dict[str, float]]:
    """Per value of `keys` (one per example; `names` maps a key to its display name): the examples,
    AUC, log loss and calibration of that slice's predictions."""
    y = np.asarray(labels).reshape(-1)
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    k = np.asarray(keys).reshape(-1)
    out = {}
    for key in np.unique(k):
        m = k == key
        name = str((names or {}).get(key.item() if hasattr(key, "item") else key, key))
        out[name] = {
            "examples": int(m.sum()),
            "auc": auc(y[m], p[m]),
            "logloss": logloss(y[m], p[m]),
            "calibration": calibration(y[m], p[m]),
        }
    return out
