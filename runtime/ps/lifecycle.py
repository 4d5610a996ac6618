"""Feature lifecycle of a sparse table by passes and by show/click (a sparse `TableSpec`'s
`lifecycle`), with the formulas of Paddle's `CtrCommonAccessor` (paddle/fluid/distributed/ps/table/
ctr_accessor.cc):

    lifecycle: {"ttl_passes": N, "decay": 0.98, "nonclk_coeff": 0.1, "click_coeff": 1.0,
                "delete_threshold": 0.8}

Each row carries `Show`, `Click` and `Unseen` (float32, beside its optimizer state; a tiered
table keeps them in its disk records too):

- `show_click(ids, labels)` (a batch's ids and each one's label, 1 = click): per id, show += its
  occurrences, click += the sum of its labels (Paddle's `Update`: show += push_show, click +=
  push_click); a push (an optimizer step on the row) sets Unseen = 0.
- `shrink()` at a pass end (Paddle's `Shrink`, then `UpdateStatAfterSave` of a day's save): for every
  row, show *= decay and click *= decay; score = (show - click) * nonclk_coeff + click * click_coeff;
  the row is removed when score < delete_threshold (only when one is given) or Unseen >= ttl_passes
  (only when given); every row left gets Unseen += 1. So `ttl_passes: N` removes a row at the end of
  the N-th pass in a row without a push of it (Paddle's `delete_after_unseen_days` = N - 1, whose
  test is unseen > days), and a row pushed in the pass just ended always stays.

Defaults: decay 0.98, nonclk_coeff 0.1, click_coeff 1.0 (Paddle's), no delete_threshold and no
ttl_passes (nothing is removed by score or age unless asked).
"""

from __future__ import annotations

from typing import Any

import numpy as np

LIFE = ("Show", "Click", "Unseen")  # the per-row fields
DEFAULTS = {
    "ttl_passes": None,
    "decay": 0.98,
    "nonclk_coeff": 0.1,
    "click_coeff": 1.0,
    "delete_threshold": None,
}


def check_lifecycle(name: str, rule: Any) -> dict:
    """The rule with its defaults filled in; ValueError naming the table and key when malformed."""
    if not isinstance(rule, dict) or set(rule) - set(DEFAULTS):
        raise ValueError(
            f"table {name!r}: lifecycle {rule!r} must be a mapping with keys among {sorted(DEFAULTS)}"
        )
    out = {**DEFAULTS, **rule}
    ttl = out["ttl_passes"]
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise ValueError(f"table {name!r}: lifecycle ttl_passes must be a positive int, got {ttl!r}")
    for key in ("decay", "nonclk_coeff", "click_coeff", "delete_threshold"):
        v = out[key]
        if (v is not None or key != "delete_threshold") and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v)
        ):
            raise ValueError(f"table {name!r}: lifecycle {key} must be a finite number, got {v!r}")
    if not 0 < out["decay"] <= 1:
        raise ValueError(f"table {name!r}: lifecycle decay must lie in (0, 1], got {out['decay']!r}")
    return out


def score(rule: dict, show: np.ndarray, click: np.ndarray) -> np.ndarray:
    """Paddle's ShowClickScore: (show - click) * nonclk_coeff + click * click_coeff."""
    return (show - click) * np.float32(rule["nonclk_coeff"]) + click * np.float32(rule["click_coeff"])


def shrink(rule: dict, show: np.ndarray, click: np.ndarray, unseen: np.ndarray) -> np.ndarray:
    """One pass end over rows' fields (updated in place, see the module docstring): the keep mask."""
    show *= np.float32(rule["decay"])
    click *= np.float32(rule["decay"])
    keep = np.ones(show.shape, bool)
    if rule["delete_threshold"] is not None:
        keep &= score(rule, show, click) >= np.float32(rule["delete_threshold"])
    if rule["ttl_passes"] is not None:
        keep &= unseen < rule["ttl_passes"]
    unseen += np.float32(1)
    return keep


def counts(ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct ids, shows: occurrences, clicks: label sums) of a batch's ids and labels."""
    uniq, inv = np.unique(ids, return_inverse=True)
    inv = inv.reshape(-1)
    shows = np.bincount(inv, minlength=uniq.size).astype(np.float32)
    clicks = np.bincount(inv, weights=labels.astype(np.float64), minlength=uniq.size).astype(np.float32)
    return uniq, shows, clicks
