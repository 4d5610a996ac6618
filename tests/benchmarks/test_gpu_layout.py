"""benchmarks/gpu_layout.py: stage 5 of benchmarks/gpu_check.sh, its processes from the core count
and its batch matrix within the time left, as the shell script reads them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_layout  # noqa: E402


@pytest.mark.parametrize(
    "nproc, want",
    [(16, (12, 2, 1)), (2, (1, 1, 1)), (8, (5, 1, 1)), (32, (26, 4, 1))],
)
def test_processes_from_the_core_count(nproc, want):
    lay = gpu_layout.layout(nproc)
    assert (lay.cpu, lay.shards, lay.gpu) == want
    if nproc >= 8:  # one core each, one left for the driver
        assert lay.cpu + lay.shards + lay.gpu == nproc - 1


def test_the_batch_matrix_fits_the_time_left():
    full, dropped = gpu_layout.runs(300, steps=100)
    assert [(r.batch, r.steps, r.warmup, r.limit_s) for r in full] == [
        (512, 100, 20, 120),
        (4096, 20, 5, 60),
        (16384, 8, 3, 60),
    ]
    assert dropped == []
    half, dropped = gpu_layout.runs(120)  # scaled to half: 60 / 30 / 30 s, 120 s in all
    assert [r.limit_s for r in half] == [60, 30, 30] and sum(r.limit_s for r in half) <= 120
    short, dropped = gpu_layout.runs(100)  # 50 / 25 / 25: the two under 30 s are dropped
    assert [r.batch for r in short] == [512] and dropped == [4096, 16384]
    assert gpu_layout.runs(-5) == ([], [512, 4096, 16384])


def test_bad_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="nproc must be a positive core count, got 0"):
        gpu_layout.layout(0)
    with pytest.raises(ValueError, match="gpus must be a positive"):
        gpu_layout.layout(16, gpus=0)


def test_gpu_check_sh_reads_the_settings_for_a_16_core_machine():
    """The assignments as gpu_check.sh's stage 5 evaluates them (`eval "$(... gpu_layout.py ...)"`),
    and the script passes them to ctr.py."""
    cmd = (
        f'eval "$({sys.executable} benchmarks/gpu_layout.py --nproc 16 --left 200 --steps 50)"; '
        'echo "$CPU_TRAINERS|$SHARDS|$GPU_TRAINERS|$RUNS|$DROPPED"'
    )
    out = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "12|2|1|512:50:20:100 4096:20:5:50 16384:8:3:50|"
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    assert 'benchmarks/gpu_layout.py --nproc "$(nproc)"' in script
    assert '--trainers "cpu=$CPU_TRAINERS,gpu=$GPU_TRAINERS" --servers "$SHARDS"' in script
