"""tutorials/01_wide_deep.py, run as the README runs it (small settings), learns: AUC >= 0.70."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tutorial_reaches_auc_070_on_held_out_data():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tutorials" / "01_wide_deep.py"),
            "--steps",
            "150",
            "--batch",
            "128",
            "--eval-every",
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
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"step +(\d+) +loss ([\d.]+) +held-out AUC ([\d.]+)", proc.stdout)
    assert [int(r[0]) for r in rows] == [50, 100, 150], proc.stdout
    losses, aucs = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
    assert losses[-1] < losses[0], proc.stdout
    final = float(re.search(r"final held-out AUC ([\d.]+)", proc.stdout).group(1))
    assert final == aucs[-1] >= 0.70, proc.stdout
