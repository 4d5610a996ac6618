"""tutorials/02_heter_training.py, run as the README runs it (small settings): it prints the plan,
progress and a final held-out AUC, and learns (AUC >= 0.70) on real trainer and server processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tutorial_02_trains_heterogeneously_and_learns():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tutorials" / "02_heter_training.py"),
            "--steps",
            "150",
            "--log-every",
            "50",
            "--eval-size",
            "4096",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "trainer cpu:" in out and "trainer gpu:" in out and "boundary tensors" in out  # the plan
    assert "EMULATING the GPU trainer" in proc.stderr  # no CUDA here: said out loud
    rows = re.findall(r"step +(\d+) +loss ([\d.]+) +batch AUC ([\d.]+)", out)
    assert [int(r[0]) for r in rows] == [50, 100, 150], out
    assert {"cpu:0", "cpu:1", "gpu:0"} <= set(re.findall(r"(\w+:\d): busy", out)), out
    final = float(re.search(r"final held-out AUC ([\d.]+)", out).group(1))
    assert final >= 0.70, out
