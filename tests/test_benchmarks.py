"""The benchmark scripts still run.

Benchmarks are scripts, not timed tests (README: performance is measured, not asserted), so
nothing in the default suite ran them and a script could rot unnoticed: `tune.py --no-load`
crashed at its summary line and `tiered_table.py` hid its child's error. Here:

- in the default run, every `benchmarks/*.py` has a smoke entry in SMOKE (a new script without one
  fails, so none is forgotten);
- with `pytest -m slow tests/test_benchmarks.py` (a few minutes on 2 cores), each script runs on its
  smallest settings as a user would, from the repository root, and must exit 0 and print something.
  Figures are not checked: on a shared machine they mean nothing; that the script gets to its end does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

# script -> the smallest arguments that still run every stage of it
SMOKE: dict[str, list[str]] = {
    "channels_rtt.py": ["--trips", "5", "--sizes", "1024"],
    "chaos.py": ["--only", "disk,startup"],
    "ctr.py": ["--steps", "4", "--warmup", "1", "--modes", "sync", "--skip-paddle", "--stand-in"],
    "device_crossings.py": ["sync"],
    "engine_lookup.py": ["--rows", "20000", "--keys", "500", "--repeats", "2"],
    "evaluate_workers.py": ["--rows", "2000", "--repeats", "1", "--workers", "2", "--servers", "1"],
    "executor_overhead.py": ["--layers", "5", "--repeats", "5"],
    "gpu_host_work.py": ["--steps", "3"],
    "gpu_layout.py": ["--nproc", "16", "--left", "250"],
    "ingest.py": ["--lines", "2000", "--repeat", "1", "--steps", "2"],
    "online.py": ["--rows", "2000", "--vocab", "2000", "--repeats", "1"],
    "optim_rules.py": ["--rows", "1000", "--ids", "64", "--repeats", "1"],
    "ps_messages.py": ["--steps", "5", "--rounds", "1"],
    "ps_throughput.py": [
        *("--steps", "3", "--rounds", "1", "--rows", "10000", "--push-rows", "1000", "--skip-memory"),
    ],
    "tiered_table.py": ["--rows", "10000", "--steps", "2", "--warmup", "1"],
    "transpile_scale.py": ["--sizes", "100", "--repeat", "1"],
    "tune.py": [
        *("--steps", "4", "--warmup", "1", "--repeats", "1", "--trainers", "1"),
        *("--micro-batches", "1", "--servers", "1", "--modes", "sync", "--no-load"),
    ],
}


def test_every_benchmark_has_a_smoke_entry():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")}
    assert scripts - SMOKE.keys() == set(), "add the new benchmark's smallest arguments to SMOKE"
    assert SMOKE.keys() - scripts == set(), "SMOKE names a benchmark that is gone"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_on_small_settings(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *SMOKE[script]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"{script} {' '.join(SMOKE[script])} exited {proc.returncode}:\n{tail}"
    assert proc.stdout.strip(), f"{script} printed nothing:\n{tail}"
