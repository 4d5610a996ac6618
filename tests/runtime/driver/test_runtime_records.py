"""The typed records at the runtime's process boundaries: messages, the trainer spec, run settings.

The wire headers are checked against the format the runtime has always sent (written out by hand
below, as channels.py documents it), so a record cannot silently change what peers of another
version read; each record also goes through the real frame codec (`runtime.transport.wire`) and back."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from runtime.driver.settings import ResolvedRun, RunConfig, ScaleConfig, Settings, TrainerSpec
from runtime.transport import messages as m
from runtime.transport.channels import pack_tensors, unpack_tensors
from runtime.transport.wire import decode, encode
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep
from transpiler.tables import TableSpec

KEY = b"k" * 32


def through_wire(msg, arrays=()):
    return decode(encode(m.header(msg), list(arrays), KEY), KEY)


@pytest.mark.parametrize(
    "msg, want, kinds",
    [
        (
            m.Tensors(3, 1, 2, [["x", None]]),
            {"k": "t", "s": 3, "o": 1, "m": 2, "v": [["x", None]]},
            m.TO_TRAINER,
        ),
        (
            m.Announce(4, 0, 64, [[0, 16], [2, 16]]),
            {"k": "step", "s": 4, "o": 0, "g": 64, "items": [[0, 16], [2, 16]]},
            m.TO_TRAINER,
        ),
        (m.Grant(7, True), {"k": "grant", "upto": 7, "final": True}, m.TO_TRAINER),
        (
            m.StepReport("cpu:1", 4, 2, 32, 64),
            {"k": "step", "who": "cpu:1", "s": 4, "items": 2, "n": 32, "g": 64},
            m.TO_DRIVER,
        ),
        (
            m.Losses("gpu:0", 4, [[16, 0.5]]),
            {"k": "losses", "who": "gpu:0", "s": 4, "items": [[16, 0.5]]},
            m.TO_DRIVER,
        ),
        (m.Done("cpu:0", {"items": 3}), {"k": "done", "who": "cpu:0", "stats": {"items": 3}}, m.TO_DRIVER),
        (
            m.Failed("ps:0", "Traceback ..."),
            {"k": "error", "who": "ps:0", "tb": "Traceback ..."},
            m.TO_DRIVER,
        ),
        (m.Ready("cpu:0"), {"k": "ready", "who": "cpu:0"}, m.TO_DRIVER),
    ],
)
def test_messages_keep_the_compact_wire_format_and_come_back_equal(msg, want, kinds):
    assert m.header(msg) == want
    h, _ = through_wire(msg)
    assert m.parse(h, kinds) == msg


def test_a_tensor_message_carries_dense_and_row_sparse_values_through_the_codec():
    from ops_registry import SparseRows

    dense = np.arange(6, dtype=np.float32).reshape(2, 3)
    sparse = SparseRows(np.array([4, 1]), np.ones((2, 3), np.float32), 10)
    descs, arrays = pack_tensors([("a", dense), ("b@GRAD", sparse)])
    h, got = through_wire(m.Tensors(0, 1, 3, descs), arrays)
    msg = m.parse(h, m.TO_TRAINER)
    assert (msg.step, msg.origin, msg.mb) == (0, 1, 3)
    values = unpack_tensors(msg.descs, got)
    np.testing.assert_array_equal(values["a"], dense)
    assert values["b@GRAD"].height == 10
    np.testing.assert_array_equal(values["b@GRAD"].rows, [4, 1])


def test_unknown_kinds_and_missing_fields_are_named():
    with pytest.raises(m.ProtocolError, match=r"unexpected message kind 'ready'"):
        m.parse({"k": "ready", "who": "x"}, m.TO_TRAINER)  # a driver report sent to a trainer
    with pytest.raises(m.ProtocolError, match=r"Tensors message lacks its field 'v'"):
        m.parse({"k": "t", "s": 1, "o": 0, "m": 0}, m.TO_TRAINER)


def spec_dict() -> dict:
    plan = transpile(wide_deep(vocab=50, dim=4, optimizer=nn.SGD(lr=0.1)).main)
    return dict(
        name="cpu:1",
        type="cpu",
        index=1,
        scale=ScaleConfig({"cpu": 2, "gpu": 1}, 4, 1, "sync", kernel_threads={"cpu": 2}).to_dict(),
        run=dict(RunConfig(steps=10, batch_size=64).__dict__),
        program=plan.programs["cpu"].to_json(),
        reader="cpu",
        tables=[t.to_dict() for t in plan.tables],  # as JSON holds them
        loss=plan.loss_name,
        loss_reduction="mean",
        held=["fc_0.w_0"],
        endpoints={"cpu:0": "ipc://a", "cpu:1": "ipc://b"},
        driver="ipc://d",
        ps=["ipc://p"],
        links={"name": "cpu:1", "send": {"ipc://a": b"k" * 32}, "recv": {"driver": b"d" * 32}},
        data=None,
        trace=False,
        start=0,
        grant=None,
        report_s=0.1,
        ps_key=None,
    )


def test_trainer_spec_crosses_a_process_boundary_as_plain_data():
    spec = TrainerSpec.from_dict(spec_dict())
    d = spec.to_dict()
    assert d == spec_dict() and type(d) is dict
    assert all(type(t) is TableSpec for t in spec.tables) and all(type(t) is dict for t in d["tables"])
    assert TrainerSpec.from_dict(pickle.loads(pickle.dumps(d))) == spec
    assert spec.is_reader
    # what the trainer reads of the records: its type's kernel threads, the run's counts and length
    assert (spec.kernel_threads, spec.counts, spec.micro_batches, spec.mode) == (
        2,
        {"cpu": 2, "gpu": 1},
        4,
        "sync",
    )
    assert (spec.steps, spec.epochs, spec.batch_size, spec.stall_timeout) == (10, None, 64, 60.0)
    with pytest.raises(AttributeError):  # frozen: nothing patches a spec after the driver made it
        spec.grant = 3


def test_a_trainer_spec_with_wrong_keys_is_refused_with_the_keys_named():
    with pytest.raises(TypeError, match=r"unknown keys \['gpus'\]"):
        TrainerSpec.from_dict({**spec_dict(), "gpus": 1})
    d = spec_dict()
    del d["ps"]
    with pytest.raises(TypeError, match=r"incomplete trainer spec.*'ps'"):
        TrainerSpec.from_dict(d)


def test_run_settings_are_derived_from_the_plan_and_checked_once():
    plan = transpile(wide_deep(vocab=50, dim=4, optimizer=nn.SGD(lr=0.1)).main)
    data = [{"x": np.zeros(1)}]

    def make(**flat):
        return ResolvedRun.make(plan, data, Settings.of(flat))

    s = make(steps=5, allow_emulation=True)
    # wide_deep: a mean loss, data ops and embeddings on cpu (2 trainers by default), the MLP on gpu (1)
    want = {"deep_emb.w_0": 2, "wide_emb.w_0": 2, **{f"fc_{i}.{p}_0": 1 for i in range(3) for p in "wb"}}
    assert (s.reader, s.loss_reduction, s.counts, s.pushes) == ("cpu", "mean", {"cpu": 2, "gpu": 1}, want)
    assert s.trainer_names() == ["cpu:0", "cpu:1", "gpu:0"]
    # the one gpu trainer holds the MLP's tables (transpiler/passes/held.py); the embeddings are shared
    assert s.held == {f"fc_{i}.{p}_0": "gpu" for i in range(3) for p in "wb"}
    assert make(steps=5, allow_emulation=True, dense_on_trainer=False).held == {}
    # micro-batches by default: the fewest that give every trainer an item each step (items go round
    # robin, reader i's micro-batch k to trainer (i * micro_batches + k) % count)
    assert s.scale.micro_batches == 1
    for counts, want in (({"cpu": 1, "gpu": 2}, 2), ({"cpu": 2, "gpu": 3}, 2), ({"cpu": 3, "gpu": 3}, 1)):
        got = make(steps=5, trainers=counts, allow_emulation=True).scale.micro_batches
        assert got == want, (counts, got)
    assert make(steps=5, micro_batches=4, allow_emulation=True).scale.micro_batches == 4
    with pytest.raises(ValueError, match="end condition"):
        make(allow_emulation=True)
    with pytest.raises(ValueError, match=r"micro_batches must be a positive int, got 0"):
        make(steps=1, micro_batches=0, allow_emulation=True)
