"""Training metrics."""

from __future__ import annotations

import numpy as np


def auc(labels, preds) -> float:
    """Area under the ROC curve: the Mann-Whitney U statistic with tied scores given average ranks."""
    y = np.asarray(labels).reshape(-1) > 0.5
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(p, kind="mergesort")
    sp = p[order]
    ranks = np.empty(len(p))
    # average rank within runs of equal scores
    starts = np.r_[0, np.flatnonzero(np.diff(sp)) + 1]
    ends = np.r_[starts[1:], len(sp)]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
