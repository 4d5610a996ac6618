"""An async reader looks up step t+1 while the other trainer types compute step t (two steps' items
in flight, `transpiler.config.items_in_flight`); a sync reader never starts a step before the
previous one is pushed. Checked on the run's own timeline (the Chrome trace), not on timings."""

from __future__ import annotations

import json

import pytest

from runtime import train
from runtime.data import SyntheticCTR
from runtime.engines import LocalEngine
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep


def reader_segments(trace_path) -> dict[tuple[int, int], float]:
    """(step, segment) -> start (µs) of the cpu:0 reader's segment runs, from the Chrome trace."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    pid = next(
        e["pid"] for e in events if e["name"] == "process_name" and e["args"]["name"] == "trainer cpu:0"
    )
    return {
        (e["args"]["step"], int(e["name"].split()[1])): e["ts"]
        for e in events
        if e["pid"] == pid and e["ph"] == "X" and e["name"].startswith("segment ")
    }


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_async_reader_starts_the_next_step_while_the_gpu_computes(tmp_path, mode):
    # one micro-batch per step and a gpu side (MLP 256-256) much heavier than the lookups, so while
    # the gpu trainer computes step t the reader has nothing of step t to do
    model = wide_deep(vocab=500, dim=8, hidden=(256, 256), optimizer=nn.SGD(lr=0.01))
    trace = tmp_path / "trace.json"
    hist = train(
        transpile(model.main),
        SyntheticCTR(vocab=500),
        steps=12,
        batch_size=256,
        engine=LocalEngine(),
        trainers={"cpu": 1, "gpu": 1},
        micro_batches=1,
        servers=1,
        mode=mode,
        allow_emulation=True,
        trace=str(trace),
        progress=False,
    )
    assert hist.steps == 12
    seg = reader_segments(trace)
    last = max(k for _, k in seg)  # segment 0: the lookups and the send; the last: the backward
    assert {s for s, _ in seg} == set(range(12)) and last >= 1
    ahead = [t for t in range(11) if seg[(t + 1, 0)] < seg[(t, last)]]
    if mode == "sync":
        assert ahead == []  # step t+1's rows need step t applied
    else:
        assert len(ahead) >= 6, f"the reader overlapped only steps {ahead} of 11"
