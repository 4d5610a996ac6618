"""A trainer leaves as soon as its last step is pushed. The run's end used to be noticed only after
an idle poll of the inbox timed out (1 s): the reader set its end step, or a non-reader got the
readers' `End`, after the loop had checked whether it was finished, and then slept out the poll —
every run took a second longer. Checked on the run's own timeline (the Chrome trace): a trainer's
last span is never a wait that came back empty."""

from __future__ import annotations

import json

import pytest

from runtime import train
from runtime.data import SyntheticCTR
from runtime.engines import LocalEngine
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep


def last_spans(trace_path) -> dict[str, dict]:
    """Each trainer's last span on its main lane (tid 0), from the Chrome trace."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    last: dict[str, dict] = {}
    for e in sorted(
        (e for e in events if e["ph"] == "X" and e["tid"] == 0), key=lambda e: e["ts"] + e["dur"]
    ):
        if names[e["pid"]].startswith("trainer "):
            last[names[e["pid"]]] = e
    return last


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_trainers_leave_without_sleeping_out_a_poll(tmp_path, mode):
    model = wide_deep(vocab=200, dim=4, hidden=(16,), optimizer=nn.SGD(lr=0.01))
    trace = tmp_path / "trace.json"
    hist = train(
        transpile(model.main),
        SyntheticCTR(vocab=200),
        steps=4,
        batch_size=64,
        engine=LocalEngine(),
        trainers={"cpu": 1, "gpu": 1},
        micro_batches=2,
        servers=1,
        mode=mode,
        allow_emulation=True,
        trace=str(trace),
        progress=False,
    )
    assert hist.steps == 4
    last = last_spans(trace)
    assert set(last) == {"trainer cpu:0", "trainer gpu:0"}
    for name, span in last.items():
        timed_out = span["name"] == "wait" and span["args"].get("timed_out", False)
        assert not timed_out, f"{name} ended on an idle poll of {span['dur'] / 1e3:.0f} ms"
