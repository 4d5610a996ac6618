"""Training metrics."""

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
