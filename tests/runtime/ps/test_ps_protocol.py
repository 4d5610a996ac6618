"""The parameter server's typed requests (runtime/ps/protocol.py): every request type survives its
wire form, and every malformed field is refused with a message naming it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from runtime.ps import protocol as p
from runtime.ps.handlers import HANDLERS
from runtime.ps.types import PSError
from runtime.transport.wire import decode, encode

IDS = np.array([3, 1, 7], np.int64)
ROWS = np.arange(6, dtype=np.float32).reshape(3, 2)

SAMPLES = [
    p.Hello(),
    p.Pull("w"),
    p.Pull("emb", IDS, step=4, peek=True),
    p.Push("w", ROWS),
    p.Push("emb", ROWS, IDS, step=2, pusher="r1"),
    p.Push("emb", ROWS, IDS, step=2, pusher="r1", show_click=ROWS[:, :2] + 1),
    p.PushPull([("emb", [IDS, ROWS]), ("w", [ROWS])], [("emb", [IDS]), ("b", [])], 5, 6, "r2", False),
    p.PushPull([("emb", [IDS, ROWS, ROWS[:, :2]]), ("w", [ROWS])], [("emb", [IDS])], 5, 6, "r2", False),
    p.Norm(3),
    p.Apply(3, 0.5),
    p.Hold("w"),
    p.WriteBack("w", ["Param", "Moment"], [ROWS, ROWS + 1], steps=7, final=True),
    p.Assign("w", ROWS),
    p.Assign("emb", ROWS, IDS),
    p.Save("/ckpt/a"),
    p.Load("/ckpt/a", step=9),
    p.Load("/ckpt/a"),
    p.Shrink(),
    p.Stats(),
    p.Trace(),
    p.Shutdown(),
]


def _same(a, b) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("req", SAMPLES, ids=lambda r: f"{r.OP}-{id(r) % 1000}")
def test_each_request_round_trips_through_its_wire_form(req):
    h, arrays = decode(encode(req.header(), req.arrays()))  # through the real encoder
    back = p.parse(h, list(arrays))
    assert type(back) is type(req)
    for f in dataclasses.fields(req):
        if f.name != "holder":  # (the server's: the client id from the transport)
            _same(getattr(back, f.name), getattr(req, f.name))


def test_the_holder_of_a_hold_is_the_requests_client_id():
    assert p.parse({"op": "hold", "table": "w", "cid": "c7"}, []).holder == "c7"
    assert "holder" not in p.Hold("w", "c7").header()


def test_every_op_has_one_record_and_every_record_but_shutdown_a_handler():
    assert set(p.REQUESTS) == set(p.OPS) and len(p.OPS) == 15
    assert set(HANDLERS) == set(p.REQUESTS.values()) - {p.Shutdown}
    assert p.ADMIN_OPS <= set(p.OPS)
    assert {type(r) for r in SAMPLES} == set(p.REQUESTS.values())


MALFORMED = [
    ({"op": "frobnicate"}, [], "unknown request op 'frobnicate'"),
    ({}, [], "unknown request op None"),
    ({"op": "pull"}, [], "request 'pull' needs field 'table' of type str"),
    ({"op": "pull", "table": 3}, [], "needs field 'table' of type str, got 3"),
    ({"op": "pull", "table": "w", "step": "1"}, [], "needs field 'step' of type int"),
    ({"op": "pull", "table": "w", "step": True}, [], "needs field 'step' of type int"),
    ({"op": "pull", "table": "w"}, [IDS, IDS], "pull takes at most one array (ids), got 2"),
    ({"op": "push", "table": "w"}, [], "push takes [grad], [ids, grad] or [ids, grad, show_click], got 0"),
    ({"op": "push", "table": None}, [ROWS], "needs field 'table' of type str"),
    ({"op": "push", "table": "w", "step": 1.5}, [ROWS], "needs field 'step' of type int"),
    ({"op": "push_pull", "push": "w"}, [], "push_pull field 'push' must be a list of [table, number"),
    (
        {"op": "push_pull", "pull": [["w", 7]]},
        [],
        "field 'pull' must be a list of [table, number of arrays in (0, 1)]",
    ),
    ({"op": "push_pull", "push": [["w", True]]}, [ROWS], "field 'push' must be a list"),
    ({"op": "push_pull", "pull": [["w", 0], ["w", 0]]}, [], "pulls a dense table more than once"),
    ({"op": "push_pull", "push": [["w", 1]]}, [], "push_pull describes 1 arrays, the request carries 0"),
    ({"op": "push_pull", "pull_step": "x"}, [], "needs field 'pull_step' of type int"),
    ({"op": "norm"}, [], "request 'norm' needs field 'step' of type int"),
    ({"op": "apply", "scale": 0.5}, [], "request 'apply' needs field 'step' of type int"),
    ({"op": "apply", "step": 0, "scale": 2.0}, [], "apply: scale 2.0 is not a number in [0, 1]"),
    ({"op": "apply", "step": 0}, [], "apply: scale None is not a number"),
    ({"op": "hold"}, [], "request 'hold' needs field 'table'"),
    (
        {"op": "write_back", "table": "w", "keys": ["Param"], "steps": 1},
        [],
        "needs field 'keys', one name per",
    ),
    ({"op": "write_back", "table": "w", "keys": [1], "steps": 1}, [ROWS], "needs field 'keys'"),
    ({"op": "write_back", "table": "w", "keys": ["Param"]}, [ROWS], "needs field 'steps' of type int"),
    ({"op": "assign", "table": "w"}, [], "assign takes [values] or [ids, values], got 0 arrays"),
    ({"op": "assign"}, [ROWS], "request 'assign' needs field 'table'"),
    ({"op": "save"}, [], "request 'save' needs field 'dir' of type str"),
    ({"op": "load", "dir": "/x", "step": "3"}, [], "request 'load' needs field 'step' of type int"),
]


@pytest.mark.parametrize("header, arrays, message", MALFORMED, ids=lambda x: repr(x)[:40])
def test_a_malformed_field_is_refused_naming_it(header, arrays, message):
    with pytest.raises(PSError) as got:
        p.parse(header, arrays)
    assert message in str(got.value)


def test_a_huge_bad_value_is_cut_short_in_the_message():
    with pytest.raises(PSError) as got:
        p.parse({"op": "pull", "table": ["x" * 10_000]}, [])
    assert len(str(got.value)) < 400
