"""What the GPU machine's check imports: `benchmarks/gpu_check.sh` carries only the wheels that
`import runtime, transpiler`, `transpile` and a training run need (benchmarks/make_gpu_wheels.sh);
numba, llvmlite, pyarrow, tqdm, matplotlib, tensorboardX, pygraphviz, PyYAML and ray stay behind.
Here every process of a short run and of its evaluation from a checkpoint (the driver, trainers
and shards: a `sitecustomize` on their PYTHONPATH) finds them absent, as on that machine, so a
module-level import of one of them on that path fails this test rather than the GPU check (the dry
run found `import runtime` and `evaluate` importing pyarrow through the feature pipeline)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LEFT_BEHIND = (
    "numba",
    "llvmlite",
    "pyarrow",
    "tqdm",
    "matplotlib",
    "tensorboardX",
    "pygraphviz",
    "yaml",
    "ray",
)

BLOCKER = f"""
from importlib.machinery import PathFinder

_find = PathFinder.find_spec.__func__


def _absent(cls, name, path=None, target=None):  # these packages are not installed, as there
    return None if name.split(".")[0] in {LEFT_BEHIND!r} else _find(cls, name, path, target)


PathFinder.find_spec = classmethod(_absent)
"""

RUN = """
import sys
import numpy as np
import runtime, transpiler
from runtime import evaluate, train
from runtime.driver.checkpoints import latest
from transpiler import transpile
from benchmarks import ctr

plan = transpile(ctr.build().main)
hist = train(plan, ctr.batches(), steps=3, trainers={"cpu": 1, "gpu": 1}, servers=1, mode="sync",
             allow_emulation=True, progress=False, checkpoint=sys.argv[1])
assert len(hist.loss) == 3 and np.isfinite(hist.loss).all(), hist.loss
scores = evaluate(plan, ctr.batches()[:2], checkpoint=str(latest(sys.argv[1])))
assert scores["examples"] == 2 * ctr.BATCH and np.isfinite(scores["loss"]), scores
print("ok", [round(float(x), 4) for x in hist.loss])
"""


def test_the_gpu_checks_path_imports_nothing_left_out_of_the_wheels(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    paths = [str(tmp_path), str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    probe = subprocess.run(
        [sys.executable, "-c", "import pyarrow"], env=env, capture_output=True, text=True, timeout=60
    )
    assert probe.returncode != 0 and "No module named 'pyarrow'" in probe.stderr  # (as if not installed)
    got = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / "ckpt")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.startswith("ok")
