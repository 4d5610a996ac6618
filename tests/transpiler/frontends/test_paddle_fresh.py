"""tests/paddle_fresh.py: a reference is what two fresh processes agree on, never one run's."""

from __future__ import annotations

import os

import numpy as np
import pytest
from paddle_fresh import TRIES, agreed


def _steady(n: int) -> tuple[str, list[np.ndarray]]:
    return f"pid {os.getpid()}", [np.arange(n, dtype=np.float32) / 3]


def _moving() -> list[float]:
    return [float(os.getpid())]


def test_two_agreeing_fresh_processes_make_the_reference():
    pid, ref = agreed(_steady, 4, compare=lambda got: got[1])
    np.testing.assert_array_equal(ref[0], np.arange(4, dtype=np.float32) / 3)
    assert pid != f"pid {os.getpid()}"  # computed in another process


def test_no_two_agreeing_processes_is_an_error():
    with pytest.raises(AssertionError, match=f"different result in each of {TRIES} fresh processes"):
        agreed(_moving)
