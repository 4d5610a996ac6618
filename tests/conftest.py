"""Shared test fixtures.

BLAS is pinned to one thread for the whole session: on this 2-core machine, shared by several
test runs, two OpenBLAS threads per process made a 256x221 @ 221x64 GEMM 30x slower (7.7 ms vs
0.24 ms) from contention.
"""

from __future__ import annotations

from pathlib import Path

import numpy  # noqa: F401  (loads OpenBLAS: threadpoolctl limits only libraries already loaded)
import pytest
from threadpoolctl import threadpool_limits

threadpool_limits(1)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the repo (data shared by the team); skips the test when it is missing."""
    path = Path(__file__).resolve().parents[2] / "shared"
    if not path.is_dir():
        pytest.skip(f"shared data directory {path} is missing")
    return path
