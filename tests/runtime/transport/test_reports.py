"""A trainer's step reports to the driver go together (runtime/transport/reports.py): what is kept, when it
goes, in what order, and what the driver refuses to unpack."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.driver.history import History
from runtime.driver.listener import Listener
from runtime.transport.messages import TO_DRIVER, Done, ProtocolError, Reports, StepReport, header, parse
from runtime.transport.reports import ReportQueue, unpack


class _Out:
    """An Outbox that keeps what it is given."""

    def __init__(self):
        self.sent = []

    def send(self, endpoint, h, arrays=()):
        self.sent.append((endpoint, h, list(arrays)))


def _messages(sent):
    """What the driver gets: (message, arrays), Reports unpacked."""
    out = []
    for _, h, arrays in sent:
        msg = parse(h, TO_DRIVER)
        out += [m[:2] for m in unpack(msg, arrays)] if isinstance(msg, Reports) else [(msg, arrays)]
    return out


def test_step_reports_are_kept_until_due_then_go_as_one_message_in_order():
    out = _Out()
    q = ReportQueue(out, "drv", "cpu:0", every_s=60.0)
    scores = [np.array([0.25, 0.75], np.float32), np.array([0.0, 1.0], np.float32)]
    q.step(StepReport("cpu:0", 0, 1, 2, 2))
    q.losses(0, [(2, 0.5, scores)])
    q.step(StepReport("cpu:0", 1, 1, 2, 2))
    assert out.sent == [] and 0 < q.due_in() <= 60
    q.now(Done("cpu:0", {"items": 2.0}))  # another report: the kept ones go first, together
    assert len(out.sent) == 2 and q.due_in() is None
    got = _messages(out.sent)
    assert [type(m).__name__ for m, _ in got] == ["StepReport", "Losses", "StepReport", "Done"]
    assert [m.step for m, _ in got[:3]] == [0, 0, 1]
    assert got[1][0].items == [[2, 0.5]]
    np.testing.assert_array_equal(got[1][1][0], scores[0])
    np.testing.assert_array_equal(got[1][1][1], scores[1])
    assert got[0][1] == [] and got[2][1] == []


def test_a_queue_goes_once_its_oldest_report_is_due_and_at_once_without_a_delay():
    out = _Out()
    q = ReportQueue(out, "drv", "gpu:0", every_s=0.05)
    q.losses(0, [(4, 1.0, [])])
    assert out.sent == []
    time.sleep(0.06)
    assert q.due_in() == 0.0
    q.losses(1, [(4, 2.0, [])])  # queued after the oldest is due: both go
    assert len(out.sent) == 1 and [m.step for m, _ in _messages(out.sent)] == [0, 1]
    now = ReportQueue(_Out(), "drv", "gpu:0", every_s=0.0)
    now.losses(0, [(4, 1.0, [])])
    assert len(now.out.sent) == 1 and now.out.sent[0][1]["k"] == "losses"  # at once: no wrapper


def test_each_report_carries_its_age_and_the_driver_dates_the_step_by_it():
    out = _Out()
    q = ReportQueue(out, "drv", "cpu:0", every_s=60.0)
    q.step(StepReport("cpu:0", 0, 1, 4, 4))
    time.sleep(0.2)
    q.losses(0, [(4, 0.5, [])])
    made = time.perf_counter()  # step 0 is done; its reports wait 0.3 s more in the queue
    time.sleep(0.3)
    q.flush()
    ages = [age for _, _, age in unpack(parse(out.sent[0][1], TO_DRIVER), [])]
    assert 0.5 <= ages[0] < 0.5 + 0.1 and 0.3 <= ages[1] < 0.3 + 0.1
    # the driver dates step 0 when its last report was made, not when the reports arrived
    settings = SimpleNamespace(reader="cpu", loss_reduction="mean", until_loss=None, held={})
    pauses = SimpleNamespace(start=0, next_pause=lambda step: None, due=lambda step: False)
    hist = History()
    drv = Listener(settings, None, None, _Out(), {"cpu:0": "a"}, hist, None, None, pauses, t0=0.0)
    drv.t_start = made - 10.0
    drv._handle(out.sent[0][1], [])
    assert hist.steps == 1 and hist.loss == [0.5] and hist.examples == [4]
    assert abs(hist.time[0] - 10.0) < 0.02, hist.time  # not 10.3 s: when it arrived


def test_the_driver_refuses_a_malformed_reports_message():
    step = header(StepReport("cpu:0", 0, 1, 2, 2))
    bad = [
        ([[header(Done("cpu:0", {})), 0, 0.0]], [], "unexpected message kind"),  # only step reports
        ([[step, 1, 0.0]], [], "claims 1"),
        ([[step, -1, 0.0]], [], "claims -1"),
        ([[step, 0, 0.0]], [np.zeros(2)], "carries 1 arrays"),
        ([[step, 0, -1.0]], [], "age -1.0"),
        ([[step, 0, "old"]], [], "age 'old'"),
        ([[step, 0]], [], "not \\[header"),
        ({"x": 1}, [], "needs a list"),
        ([[{"k": "step", "who": "cpu:0"}, 0, 0.0]], [], "lacks its field"),
    ]
    for msgs, arrays, why in bad:
        with pytest.raises(ProtocolError, match=why):
            list(unpack(Reports("cpu:0", msgs), arrays))
