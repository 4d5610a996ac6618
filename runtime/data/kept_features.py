"""Where a model's feature pipeline is kept (`features.json` beside its plan or checkpoints): found
without reading it, so that a model without one is evaluated and served without pyarrow
(runtime/data/files/features.py reads and writes it)."""

from __future__ import annotations

from pathlib import Path

FEATURES = "features.json"


def features_file(*places: str | Path | None) -> Path | None:
    """`features.json` in the first of `places` (plan directories, checkpoint directories, or one
    checkpoint: then its directory) that has one; None if none has."""
    for place in places:
        if place is None:
            continue
        p = Path(place)
        one_checkpoint = (p / "manifest.json").is_file()  # a step-N checkpoint: its directory's
        for d in (p, p.parent) if one_checkpoint else (p,):
            if (d / FEATURES).is_file():
                return d / FEATURES
    return None
