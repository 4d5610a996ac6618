"""The driver's grants to the readers (`Listener.grant_at`): never past the next pause, LOOKAHEAD
steps ahead for until_loss, None (no limit) once nothing limits the readers; they only go forward,
which the readers' step books check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from runtime.driver.history import History
from runtime.driver.listener import LOOKAHEAD, LOSS_WINDOW, Listener
from runtime.trainer.steps import StepBook
from runtime.transport.messages import TO_TRAINER, Grant, parse


class _Out:
    def __init__(self):
        self.sent = []

    def send(self, endpoint, h, arrays=()):
        self.sent.append((endpoint, parse(h, TO_TRAINER)))


def _pauses(every, end, start=0):
    def next_pause(step):
        b = (step // every + 1) * every if every else None
        return None if b is None or (end is not None and b >= end) else b

    return SimpleNamespace(start=start, next_pause=next_pause, due=lambda step: False)


def _listener(until_loss=None, every=None, end=None, start=0):
    settings = SimpleNamespace(reader="cpu", loss_reduction="mean", until_loss=until_loss, held={})
    eps = {"cpu:0": "c0", "cpu:1": "c1", "gpu:0": "g0"}
    return Listener(settings, None, None, _Out(), eps, History(), None, None, _pauses(every, end, start), 0.0)


def _grants_through(drv, steps, loss=1.0):
    """Record steps start .. steps - 1 (each with `loss`) as the driver does; the grants sent to cpu:0."""
    for t in range(drv.pauses.start, steps):
        drv.history.loss.append(loss)
        drv.next = t + 1
        drv._grant()
    return [msg for ep, msg in drv.out.sent if ep == "c0"]


def test_no_pause_and_no_until_loss_grants_nothing():
    drv = _listener()
    assert drv.first_grant() is None and drv.grant is None
    assert _grants_through(drv, 20) == []


def test_grants_stop_at_each_pause_then_lift_with_none_after_the_last():
    drv = _listener(every=4, end=10)
    assert drv.first_grant() == 4
    got = _grants_through(drv, 12)
    assert [g.upto for g in got[:8]] == [4, 4, 4, 8, 8, 8, 8, None]
    assert len(got) == 8 and not any(g.final for g in got)  # (None: no limit, nothing more to send)
    assert {ep for ep, _ in drv.out.sent} == {"c0", "c1"}  # the readers only


def test_until_loss_grants_lookahead_steps_capped_by_pauses_then_a_final_grant():
    drv = _listener(until_loss=0.5, every=5, start=1)
    assert drv.first_grant() == 1 + LOOKAHEAD
    got = _grants_through(drv, 8)
    assert [g.upto for g in got] == [min(t + 1 + LOOKAHEAD, (t + 1) // 5 * 5 + 5) for t in range(1, 8)]
    drv.history.loss[:] = [0.1] * LOSS_WINDOW
    drv.next += 1
    drv._grant()
    last = drv.out.sent[-1][1]
    assert last == Grant(got[-1].upto, True)
    n = len(drv.out.sent)
    drv._grant()
    assert len(drv.out.sent) == n  # after the final grant: nothing


@pytest.mark.parametrize(("until_loss", "every", "end"), [(None, 3, 20), (None, 4, None), (0.5, 2, 30)])
def test_a_readers_book_takes_every_grant_the_driver_sends(until_loss, every, end):
    drv = _listener(until_loss=until_loss, every=every, end=end)
    book = StepBook("cpu:0", True, 1, grant=drv.first_grant())
    for g in _grants_through(drv, 25):
        book.grant(g.upto, g.final)  # (refuses a grant that goes backwards)
    assert book.upto == drv.grant
