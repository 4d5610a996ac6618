"""Engine children reuse freed memory: a step's large temporaries do not page-fault afresh.

Reference: the same loop in a plain Python process (glibc's defaults), measured in the same test by
the kernel's minor page-fault count (`getrusage`), not by time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LOOP = """
import json, resource, sys
import numpy as np
from runtime.engines.base import child_main

def loop():
    x = np.ones((512, 4096), np.float32)  # 8 MiB: over glibc's default mmap threshold
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        y = x * 2.0
        z = y + x
        del y, z
    print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0))

if sys.argv[1] == "child":  # as an engine runs an entry point
    sys.exit(child_main("t", loop, {}, report="ipc:///nonexistent"))
loop()
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", LOOP, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_children_reuse_freed_memory_instead_of_faulting_it_in_again():
    default, reused = _faults("plain"), _faults("child")
    # 200 temporaries x 2048 pages each by default; in an engine's child only the first ones fault
    assert default > 50_000
    assert reused < default / 20, (default, reused)
