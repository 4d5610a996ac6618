"""A trainer's step book and mail are told what happens (`start`, `announce`, `item_done`,
`complete`, `grant`, `deliver`, ...) and refuse what cannot happen."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.trainer.mail import Item, Mail
from runtime.trainer.steps import StepBook, StepState


def test_a_reader_starts_finishes_and_pushes_its_steps_in_order():
    book = StepBook("cpu:0", True, 1)
    assert book.to_push() is None and not book.is_complete(0)
    st = book.start(0, 2)
    assert book.next_step == 1 and st.items == 2 and book.to_push() is None
    book.item_done(0, (4, 0.5, []))
    assert book.to_push() is None  # one of two items
    book.item_done(0)
    assert book.to_push() is st and st.reports == [(4, 0.5, [])]
    assert book.complete(0) is st
    assert book.flushed == 1 and 0 not in book.steps and book.to_push() is None
    book.end_at(1)
    assert book.finished()


def test_a_step_completed_twice_or_out_of_order_is_refused():
    book = StepBook("cpu:0", True, 1)
    book.start(0, 1)
    book.start(1, 1)
    book.item_done(1)
    with pytest.raises(RuntimeError, match="cpu:0: step 1 cannot be pushed before step 0"):
        book.complete(1)
    with pytest.raises(RuntimeError, match=r"step 0 cannot be pushed: 0 of its 1 items have run"):
        book.complete(0)
    book.item_done(0)
    book.complete(0)
    with pytest.raises(RuntimeError, match=r"step 0 was pushed already \(steps < 1 are\)"):
        book.complete(0)
    book.complete(1)
    with pytest.raises(RuntimeError, match="an item of step 1 finished after the step was pushed"):
        book.item_done(1)


def test_more_items_done_than_known_is_refused():
    book = StepBook("cpu:0", True, 1)
    book.start(0, 1)
    book.item_done(0)
    with pytest.raises(RuntimeError, match="step 0: an item finished beyond the 1 items known of it"):
        book.item_done(0)
    with pytest.raises(RuntimeError, match="beyond the 0 items"):
        StepState().item_done(3)


def test_a_reader_starts_and_ends_only_at_its_next_step():
    book = StepBook("cpu:0", True, 1, start=5)
    with pytest.raises(RuntimeError, match="cannot start step 6: the next step is 5"):
        book.start(6, 1)
    book.start(5, 1)
    with pytest.raises(RuntimeError, match="cannot end the run at step 5: the next step is 6"):
        book.end_at(5)
    book.end_at(6)
    with pytest.raises(RuntimeError, match="the next step is 6 and the run ends at step 6"):
        book.start(6, 1)
    with pytest.raises(RuntimeError, match="already ends at step 6"):
        book.end_at(6)


def test_a_non_reader_completes_a_step_once_every_reader_announced_it():
    book = StepBook("gpu:0", False, 2)
    book.announce(0, 1, 1)
    book.item_done(0)
    assert book.to_push() is None  # reader 0 has not announced step 0
    with pytest.raises(RuntimeError, match=r"announced by readers \[1\] of 2"):
        book.complete(0)
    book.announce(0, 0, 0)  # reader 0 has no item of step 0 here
    assert book.to_push() is not None
    book.complete(0)
    with pytest.raises(RuntimeError, match="gpu:0: reader 1 announced step 3 twice"):
        book.announce(3, 1, 1)
        book.announce(3, 1, 1)


def test_a_non_reader_finishes_once_the_readers_agree_on_the_end():
    book = StepBook("gpu:0", False, 2)
    book.reader_ended(0, 0)
    assert not book.finished()
    book.reader_ended(0, 0)  # (the same end again: nothing new)
    with pytest.raises(RuntimeError, match="reader 0 ended the run at step 2, before at 0"):
        book.reader_ended(0, 2)
    book.reader_ended(1, 0)
    assert book.finished()
    other = StepBook("gpu:0", False, 2)
    other.reader_ended(0, 1)
    other.reader_ended(1, 2)
    with pytest.raises(RuntimeError, match="reader trainers disagree on the last step"):
        other.finished()


def test_leases_are_released_once():
    book, released = StepBook("gpu:0", False, 1), []
    book.lease(0, lambda: released.append("a"))
    book.lease(0, lambda: released.append("b"))
    st = book.step(0)
    st.release_leases()
    st.release_leases()
    assert released == ["a", "b"]


def test_grants_only_go_forward():
    book = StepBook("cpu:0", True, 1, grant=3)
    assert book.granted(2) and not book.granted(3)
    book.grant(3, False)  # (the same grant again)
    book.grant(5, False)
    assert book.granted(4) and not book.granted(5)
    with pytest.raises(
        RuntimeError, match=r"grant of steps < 4 \(final: False\) after the grant of steps < 5"
    ):
        book.grant(4, False)
    book.grant(None, False)  # no limit from now on
    assert book.granted(10**9) and not book.ends_before(10**9)
    with pytest.raises(RuntimeError, match="grants only go forward"):
        book.grant(7, False)


def test_a_final_grant_ends_the_run_and_nothing_comes_after_it():
    book = StepBook("cpu:0", True, 1, grant=3, last=10)
    book.grant(4, True)
    assert book.granted(4) and book.ends_before(4) and not book.ends_before(3)
    with pytest.raises(RuntimeError, match=r"after the grant of steps < 4 \(final: True\)"):
        book.grant(6, False)
    limited = StepBook("cpu:0", True, 1, last=2)
    assert limited.granted(5) and limited.ends_before(2) and not limited.ends_before(1)


def _item(step=0, origin=0, mb=0):
    return Item(step, origin, mb, 1, 1)


def test_mail_delivers_per_item_and_refuses_a_tensor_twice_before_its_recv():
    mail, it = Mail(np), _item()
    mail.deliver(it.key, {"a": np.ones(2)})
    mail.deliver(it.key, {"b": np.zeros(1)})
    assert mail.missing(it, ["a", "b", "c"]) == ["c"]
    np.testing.assert_array_equal(mail.recv(it, "a"), np.ones(2))
    mail.deliver(it.key, {"a": np.full(2, 3.0)})  # after its recv ran: the next one
    with pytest.raises(RuntimeError, match=r"tensor 'b' of item \(0, 0, 0\) arrived twice before its recv"):
        mail.deliver(it.key, {"b": np.zeros(1)})
    mail.forget(it.key)
    mail.forget(it.key)
    assert mail.missing(it, ["a"]) == ["a"]


def test_mail_hands_what_a_segment_sends_once():
    mail, it = Mail(np), _item()
    mail.send(it, "gpu", "x", 1)
    mail.send(it, "gpu", "y", 2)
    assert mail.take_outgoing() == [("gpu", "x", 1), ("gpu", "y", 2)]
    assert mail.take_outgoing() == [] and not mail.outgoing
