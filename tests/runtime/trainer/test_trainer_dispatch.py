"""A trainer hands each message to the handler of its class; a message class it has no handler for
is a protocol error naming what it handles, never taken for another kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from runtime.telemetry.outputs import Recorder
from runtime.trainer import process
from runtime.trainer.mail import Item, Mail
from runtime.trainer.process import Trainer
from runtime.trainer.steps import StepBook
from runtime.transport.channels import pack_tensors
from runtime.transport.messages import TO_TRAINER, Grant, ProtocolError, Ready, Tensors, header


@dataclass(slots=True)
class _Nudge:
    """A message kind the trainers do not know."""

    KIND: ClassVar[str] = "nudge"
    KEYS: ClassVar[tuple[tuple[str, str], ...]] = (("step", "s"),)
    step: int


def _bare_trainer(is_reader: bool = True) -> Trainer:
    """A Trainer with only what message handling reads (no program, no sockets)."""
    t = Trainer.__new__(Trainer)
    t.name, t.rec, t.mail = "cpu:0", Recorder(on=False), Mail(np)
    t.book = StepBook("cpu:0", is_reader, 1, grant=2)
    return t


def test_every_message_to_a_trainer_has_exactly_one_handler():
    assert set(TO_TRAINER.values()) == {Tensors, *Trainer._CONTROL}
    assert Tensors not in Trainer._CONTROL


def test_a_message_class_without_a_handler_raises(monkeypatch):
    monkeypatch.setitem(process.TO_TRAINER, _Nudge.KIND, _Nudge)  # (parsed, but no handler)
    trainer = _bare_trainer()
    with pytest.raises(
        ProtocolError, match=r"cpu:0: no handler for _Nudge; it handles \['Announce', 'DeviceOf', 'End',"
    ):
        trainer._handle(header(_Nudge(3)), [])


def test_a_message_kind_unknown_to_trainers_is_refused():
    with pytest.raises(RuntimeError, match="cpu:0: unexpected message kind 'ready'"):
        _bare_trainer()._handle(header(Ready("driver")), [])


def test_a_grant_goes_to_the_step_book_and_its_message_is_released():
    trainer, released = _bare_trainer(), []
    trainer._handle(header(Grant(5, False)), [], lambda: released.append("grant"))
    assert (trainer.book.upto, trainer.book.final, released) == (5, False, ["grant"])
    trainer._handle(header(Grant(None, False)), [])
    assert trainer.book.upto is None and trainer.book.granted(10**6)
    with pytest.raises(RuntimeError, match="grants only go forward"):
        trainer._handle(header(Grant(6, False)), [])


def test_tensors_go_to_the_mail_and_stay_leased_until_their_step_is_pushed():
    trainer, released = _bare_trainer(is_reader=False), []
    descs, arrays = pack_tensors([("x", np.arange(3.0))])
    trainer._handle(header(Tensors(0, 0, 1, descs)), arrays, lambda: released.append("t"))
    assert released == [] and trainer.mail.missing(Item(0, 0, 1, 1, 1), ["x"]) == []
    trainer.book.step(0).release_leases()
    assert released == ["t"]
