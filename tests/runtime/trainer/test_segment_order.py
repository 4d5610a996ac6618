"""Sends first (runtime/segment_order.py): a trainer's segment is cut after what its sends need.

The dense trainer's backward segment of Wide&Deep sends the first layer's input gradient only after
every weight gradient today; cut, its sends need no weight-gradient product, and the weight
gradients and pushes run in a segment of their own after them. The split `gemm_grad` ops make the
same gradients as numpy by hand; a segment that cannot be reordered without changing a value stays
whole. (Whole runs with the cut segments equal single-process training:
tests/test_runtime_train.py, tests/test_trainer_sync_boundary.py.)"""

from __future__ import annotations

import numpy as np

from ops_registry import get_op
from runtime.trainer.segment_order import sends_first
from transpiler import builder as nn
from transpiler import transpile
from transpiler.ir import Op, Program
from transpiler.models import wide_deep
from transpiler.passes.schedule import segment_programs


def test_the_dense_trainers_sends_go_out_before_its_weight_gradients():
    plan = transpile(wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main)
    gpu = plan.programs["gpu"]
    before, after = segment_programs(gpu), sends_first(segment_programs(gpu))
    assert len(after) == len(before) + 1
    sends = next(i for i, s in enumerate(after) if any(op.type == "send" for op in s.ops))
    first, rest = after[sends], after[sends + 1]
    assert first.ops[-1].type == "send"  # nothing after the sends in their segment
    weight_grads = [op for op in first.ops if op.type == "gemm_grad" and op.outputs.get("B@GRAD")]
    assert not weight_grads  # no weight-gradient product before the sends
    assert {op.type for op in rest.ops} >= {"gemm_grad", "push_dense"}
    assert not any(op.type in ("send", "recv") for op in rest.ops)
    pushes = [op.attrs["table"] for s in before for op in s.ops if op.type == "push_dense"]
    assert sorted(op.attrs["table"] for op in rest.ops if op.type == "push_dense") == sorted(pushes)
    # every op of the program is still there once (gemm_grad: as its two halves)
    kept = [op.id for s in after for op in s.ops]
    halves = [op.id for s in after for op in s.ops if op.type == "gemm_grad"]
    assert sorted(set(kept)) == sorted(op.id for s in before for op in s.ops)
    assert all(halves.count(i) == 2 for i in halves)


def test_the_split_gemm_grad_makes_the_gradients_by_hand():
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(5, 3)), rng.normal(size=(3, 4)), rng.normal(size=4)
    g = rng.normal(size=(5, 4))
    kernel, attrs = get_op("gemm_grad").kernel, {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}
    ins = {"A": a, "B": b, "C": c, "Y@GRAD": g}
    assert set(kernel(np, ins, {**attrs, "grads": ["A"]})) == {"A@GRAD"}
    np.testing.assert_allclose(kernel(np, ins, {**attrs, "grads": ["A"]})["A@GRAD"], g @ b.T)
    got = kernel(np, ins, {**attrs, "grads": ["B", "C"]})
    assert set(got) == {"B@GRAD", "C@GRAD"}
    np.testing.assert_allclose(got["B@GRAD"], a.T @ g)
    np.testing.assert_allclose(got["C@GRAD"], g.sum(axis=0))


def test_a_segment_whose_order_matters_stays_whole():
    """An op the sends do not need reads `x` before an op they need overwrites it: moving the
    sends' ops first would change what it reads."""
    seg = Program()
    seg.global_block().set_ops(
        [
            Op("scale", {"X": ["x"]}, {"Out": ["y"]}, {"scale": 2.0}, 1),  # not needed by the send
            Op("scale", {"X": ["z"]}, {"Out": ["x"]}, {"scale": 3.0}, 2),  # overwrites x
            Op("send", {"X": ["x"]}, {}, {"tensor": "x", "dst": "cpu"}, 3),
        ]
    )
    assert sends_first([seg]) == [seg]
    ops = seg.ops
    seg.global_block().set_ops([ops[1], ops[2], ops[0]])  # y made after the send: it may wait
    assert [[op.id for op in s.ops] for s in sends_first([seg])] == [[2, 3], [1]]
