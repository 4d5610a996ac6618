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
