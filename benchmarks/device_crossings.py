"""The gpu trainer's host <-> device crossings per step, counted by the cupy stand-in
(tests/fake_cupy.py) in the trainer's process: a small Wide&Deep (4 slots, MLP 16-8, batch 64, 2
micro-batches, one cpu and one gpu trainer), runs of 3 and 5 steps, whose difference / 2 is the
per-step figure (the held tables' hold and last write-back are once per run).

    python benchmarks/device_crossings.py [sync|async]

To measure another tree (e.g. before a change) with this stand-in, put a copy of this repository's
tests/fake_cupy.py first on PYTHONPATH and that tree after it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def per_step(mode: str) -> dict[str, float]:
    os.environ["HETPS_FAKE_CUPY"] = "fake_cupy"
    import fake_cupy

    from runtime import train
    from runtime.data import SyntheticCTR
    from transpiler import builder as nn
    from transpiler.models import wide_deep

    got = {}
    for steps in (3, 5):
        os.environ["HETPS_FAKE_CUPY_COUNTS"] = folder = tempfile.mkdtemp(prefix="hetps-fake-cupy-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        m = wide_deep(num_slots=4, vocab=300, dim=4, hidden=(16, 8), optimizer=nn.SGD(lr=0.2))
        data = SyntheticCTR(vocab=300, num_slots=4, seed=5)
        run = dict(batch_size=64, trainers={"cpu": 1, "gpu": 1}, servers=1, progress=False)
        train(m.main, data, steps=steps, mode=mode, micro_batches=2, **run)
        (counts,) = fake_cupy.read_counts(folder).values()
        got[steps] = counts.__dict__
    return {k: (got[5][k] - got[3][k]) / 2 for k in got[5]}


def main() -> None:
    sys.path[len(sys.path) :] = [str(REPO / "tests"), str(REPO)]  # (after a tree given on PYTHONPATH)
    mode = sys.argv[1] if len(sys.argv) > 1 else "sync"
    got = per_step(mode)
    print(
        f"{mode}: per step host->device {got['h2d']:.0f} copies {got['h2d_bytes']:.0f} B "
        f"({got['h2d_pinned']:.0f} through pinned buffers on a copy stream); device->host {got['d2h']:.0f} "
        f"copies {got['d2h_bytes']:.0f} B ({got['d2h_pinned']:.0f} pinned)"
    )


if __name__ == "__main__":
    main()
