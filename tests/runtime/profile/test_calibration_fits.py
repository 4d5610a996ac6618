"""How the profile turns repeated measurements into costs, by hand: a kernel's typical call (the
median at each size, `runtime.profile.measure._fit`), the runtime overhead's line under the
calibration runs (`runtime.profile.machine.lower_line`), and the machine's busy CPU time
(`runtime.profile.load.machine_busy_s`) against this process's own."""

from __future__ import annotations

import os
import time

import pytest

from runtime.profile.load import machine_busy_s
from runtime.profile.machine import lower_line
from runtime.profile.measure import _fit


def test_kernel_cost_goes_through_the_median_call_at_each_size():
    # medians 1.2 ms at 32 examples and 2.2 ms at 256 (the 5 ms / 9 ms calls that caught a hiccup,
    # and the fastest, do not set the line): 1 ms per 224 examples, the rest fixed
    got = _fit({32: [1.0e-3, 5.0e-3, 1.2e-3], 256: [2.0e-3, 9.0e-3, 2.2e-3]}, (32, 256))
    assert got.per_example_s == pytest.approx(1e-3 / 224)
    assert got.fixed_s == pytest.approx(1.2e-3 - 32 * 1e-3 / 224)
    assert got.at(512) == pytest.approx(1.2e-3 + (512 - 32) * 1e-3 / 224)


def test_overhead_line_lies_under_the_runs():
    # on a line: 0.4 ms per item, 0.6 ms per step
    per_item, per_step = lower_line({1: 1.0e-3, 4: 2.2e-3, 8: 3.8e-3})
    assert (per_item, per_step) == (pytest.approx(4e-4), pytest.approx(6e-4))
    # the 1-item run caught a 4 ms hiccup: the line through the other two, which it lies above
    # (a line through 1 and 8 items would put the 4-item run below it; through 1 and 4, a larger
    # total excess: 4.0 ms against 5.3 ms)
    per_item, per_step = lower_line({1: 5.0e-3, 4: 2.2e-3, 8: 3.8e-3})
    assert (per_item, per_step) == (pytest.approx(4e-4), pytest.approx(6e-4))
    # the 4-item run caught one: the line through 1 and 8 items
    per_item, per_step = lower_line({1: 1.0e-3, 4: 9.0e-3, 8: 3.8e-3})
    assert (per_item, per_step) == (pytest.approx(4e-4), pytest.approx(6e-4))
    # falling: no per-item cost, the lowest run per step; below zero: none
    assert lower_line({1: 3e-3, 8: 1e-3}) == (0.0, pytest.approx(1e-3))
    assert lower_line({1: -1e-3, 8: -2e-3}) == (0.0, 0.0)
    assert lower_line({1: 2e-3}) == (0.0, 2e-3)


def test_machine_busy_time_counts_this_process():
    t0, c0, m0 = time.perf_counter(), time.process_time(), machine_busy_s()
    while time.process_time() - c0 < 0.3:  # 0.3 s of this process's CPU
        pass
    used, wall, busy = time.process_time() - c0, time.perf_counter() - t0, machine_busy_s() - m0
    # the machine's busy time holds this process's (less a clock tick each side) and no more than
    # every core busy for the wall time
    assert used - 0.03 <= busy <= wall * os.cpu_count() + 0.03
