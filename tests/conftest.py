"""Shared test fixtures.

BLAS is pinned to one thread for the whole session: on this 2-core machine, shared by several
test runs, two OpenBLAS threads per process made a 256x221 @ 221x64 GEMM 30x slower (7.7 ms vs
0.24 ms) from contention.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy  # noqa: F401  (loads OpenBLAS: threadpoolctl limits only libraries already loaded)
import pytest
from threadpoolctl import threadpool_limits

threadpool_limits(1)
# Tests mirror the packages (tests/runtime/ps/... for runtime/ps/...); some share helpers across folders
# (`from test_runtime_train import single_process`), so every test folder is importable whatever the
# collection order.
sys.path[1:1] = sorted(
    str(d) for d in Path(__file__).resolve().parent.rglob("*") if d.is_dir() and any(d.glob("test_*.py"))
)
# Ray is imported by tests and tutorials: keep every local Ray on loopback (see runtime/engines/ray.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session (starting it costs 10-30 s and ~800 MB here), pinned
    down as docs/design.md's "Ray" notes say: own temp dir, small object store, no dashboard, no
    usage stats, 4 logical CPUs and one `gpu_trainer` custom resource so that an
    emulated gpu trainer is placed like a real one. Skips when Ray is not installed."""
    import shutil
    import tempfile

    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tmp = tempfile.mkdtemp(prefix="hetps-ray-test-")
    ray.init(
        num_cpus=4,
        resources={"gpu_trainer": 1},
        object_store_memory=100 << 20,
        _temp_dir=tmp,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def run_dir():
    """A local run directory and its private /dev/shm twin, as LocalEngine makes them."""
    import shutil
    import tempfile

    from runtime.transport import shm
    from runtime.transport.shm import shm_dir_for

    if not os.path.isdir(shm.SHM_ROOT):
        pytest.skip("no /dev/shm on this system: tensors always go as ZeroMQ frames")
    path = tempfile.mkdtemp(prefix="hetps-run-")
    os.mkdir(shm_dir_for(path), 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(shm_dir_for(path), ignore_errors=True)
