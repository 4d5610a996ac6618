"""verify() rejects broken plans with messages that name the op and the tensor; schedule() finds
deadlocks."""

from __future__ import annotations

import pytest

from transpiler import builder as nn
from transpiler import models, transpile
from transpiler.errors import DeadlockError, PlanError
from transpiler.passes.schedule import schedule
from transpiler.tables import TableSpec


@pytest.fixture()
def plan():
    m = models.wide_deep(num_slots=3, vocab=20, dim=2, num_dense=2, hidden=(4,), optimizer=nn.Adam(0.01))
    return transpile(m.main)


def first(prog, op_type, tensor=None):
    return next(
        op for op in prog.ops if op.type == op_type and (tensor is None or op.attrs.get("tensor") == tensor)
    )


def test_sound_plan_verifies(plan):
    plan.verify()
    order = schedule(plan.programs)
    assert sorted(order) == sorted({(t, k) for t, k in order})  # every segment once


def test_removed_recv(plan):
    gpu = plan.programs["gpu"]
    recv = first(gpu, "recv", "label")
    gpu.global_block().set_ops(op for op in gpu.ops if op is not recv)
    with pytest.raises(PlanError) as e:
        plan.verify()
    msg = str(e.value)
    reader = next(op for op in gpu.ops if "label" in op.input_names())
    assert f"trainer gpu: op #{gpu.ops.index(reader)} {reader.type!r} (id {reader.id}) reads 'label'" in msg
    send = first(plan.programs["cpu"], "send", "label")
    assert f"trainer cpu: send op id {send.id} of 'label' to gpu has no matching recv on gpu" in msg


def test_renamed_send(plan):
    send = first(plan.programs["cpu"], "send", "dense")
    send.attrs["tensor"] = "dense_x"
    with pytest.raises(PlanError) as e:
        plan.verify()
    msg = str(e.value)
    assert f"send op id {send.id} sends var ['dense'] under the key 'dense_x'" in msg
    assert f"send op id {send.id} of 'dense_x' to gpu has no matching recv" in msg
    recv = first(plan.programs["gpu"], "recv", "dense")
    assert f"recv op id {recv.id} of 'dense' from cpu has no matching send on cpu" in msg


def test_dtype_change(plan):
    plan.programs["gpu"].vars["dense"].dtype = "float64"
    with pytest.raises(PlanError) as e:
        plan.verify()
    send, recv = first(plan.programs["cpu"], "send", "dense"), first(plan.programs["gpu"], "recv", "dense")
    assert (
        f"'dense' cpu->gpu: send op id {send.id} has float32[-1, 2] but recv op id {recv.id} declares "
        "float32[-1, 2] into a var of float64[-1, 2]"
    ) in str(e.value)


def test_missing_push_and_unknown_table(plan):
    gpu = plan.programs["gpu"]
    push = first(gpu, "push_dense")
    gpu.global_block().set_ops(op for op in gpu.ops if op is not push)
    pull = first(gpu, "pull_dense")
    pull.attrs["table"] = "nope"
    with pytest.raises(PlanError) as e:
        plan.verify()
    table = push.attrs["table"]
    assert f"table {table!r} has an optimizer but no trainer pushes its gradient" in str(e.value)
    assert f"trainer gpu: pull_dense op id {pull.id} names table 'nope'" in str(e.value)


def test_deadlock_is_found_and_named(plan):
    """Move gpu's first recv after its first send: gpu waits for a message cpu only sends after
    receiving what gpu has not sent yet."""
    cpu, gpu = plan.programs["cpu"], plan.programs["gpu"]
    grad_recv = first(cpu, "recv")
    cpu.global_block().set_ops([grad_recv] + [op for op in cpu.ops if op is not grad_recv])
    # cpu now waits for a gradient before sending any activation
    with pytest.raises(DeadlockError) as e:
        schedule(plan.programs)
    g = first(gpu, "recv")
    tensor = grad_recv.attrs["tensor"]
    assert f"cpu waits at recv op id {grad_recv.id} for {tensor!r} from gpu" in str(e.value)
    assert f"gpu waits at recv op id {g.id} for {g.attrs['tensor']!r} from cpu" in str(e.value)
    with pytest.raises(PlanError, match="deadlock"):
        plan.verify()


def test_an_optimizer_the_servers_do_not_know_is_refused(plan):
    # Before the fix the plan verified, and its shard died at start-up ("no reply to 'hello'" 60 s later).
    name = plan.tables[0].name
    d = plan.tables[0].to_dict()
    d["optimizer"]["type"] = "lamb"
    plan.tables[0] = TableSpec.from_dict(d)
    with pytest.raises(PlanError) as e:
        plan.verify()
    assert f"table {name!r} has optimizer 'lamb', which the parameter servers do not know" in str(e.value)
    assert "adam, adamw, sgd" in str(e.value)
