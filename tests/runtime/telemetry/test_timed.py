"""`runtime.telemetry.outputs.timed`: the one way the runtime times a block (statistics and trace spans)."""

from __future__ import annotations

import time

import pytest

from runtime.telemetry.outputs import Recorder, timed


def test_a_block_adds_its_seconds_and_records_one_span_with_late_arguments():
    stats, rec = {"ps_s": 1.0}, Recorder()
    before = time.perf_counter()
    with timed("pull", "ps", rec=rec, stats=stats, key="ps_s", step=3) as t:
        time.sleep(0.05)
        t.args["rows"] = 7
    outside = time.perf_counter() - before
    assert 0.05 <= t.seconds <= outside
    assert stats["ps_s"] == pytest.approx(1.0 + t.seconds)
    ((name, cat, _, dur_us, args, lane),) = rec.take()
    assert (name, cat, args, lane) == ("pull", "ps", {"step": 3, "rows": 7}, 0)
    assert dur_us == pytest.approx(t.seconds * 1e6, abs=0.2)


def test_a_failed_or_skipped_block_is_neither_summed_nor_recorded():
    stats, rec = {"s": 0.0}, Recorder()
    with pytest.raises(KeyError):
        with timed("a", "x", rec=rec, stats=stats, key="s"):
            raise KeyError("boom")
    with timed("b", "x", rec=rec, stats=stats, key="s") as t:
        t.skip()
    assert stats == {"s": 0.0} and rec.take() == []


def test_without_a_recorder_or_with_a_disabled_one_only_the_statistic_moves():
    stats, off = {"s": 0.0}, Recorder(False)
    with timed("a", "x", rec=off, stats=stats, key="s") as t:
        assert not t.recording
    with timed(stats=stats, key="s"):
        time.sleep(0.01)
    assert stats["s"] >= 0.01 and off.take() == []
