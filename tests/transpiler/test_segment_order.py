"""Sends first (transpiler/passes/segment_order.py): a trainer's segment is cut after what its sends need.

The dense trainer's backward segment of Wide&Deep sends the first layer's input gradient only after
every weight gradient when cut at recv ops alone; cut, its sends need no weight-gradient product, and
the weight gradients and pushes run in a segment of their own after them. The pass stores the run
segments in the sub-program (`Program.segments`), the plan saves them, `verify` checks them and the
trainers and `simulate` run them. The split `gemm_grad` ops make the same gradients as numpy by hand;
a segment that cannot be reordered without changing a value stays whole. (Whole runs with the cut
segments equal single-process training: tests/runtime/driver/test_runtime_train.py,
tests/runtime/trainer/test_trainer_sync_boundary.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ops_registry import get_op
from transpiler import PlanError, transpile
from transpiler import builder as nn
from transpiler.ir import Op, Program
from transpiler.models import wide_deep
from transpiler.passes.schedule import segment_programs, segments
from transpiler.passes.segment_order import order_segments, recv_cuts
from transpiler.passes.verify import verify
from transpiler.plan import Plan


def test_the_dense_trainers_sends_go_out_before_its_weight_gradients():
    plan = transpile(wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main)
    gpu = plan.programs["gpu"]
    before, after = recv_cuts(gpu.ops), segments(gpu)  # what the trainer runs: the stored segments
    assert len(after) == len(before) + 1
    sends = next(i for i, s in enumerate(after) if any(op.type == "send" for op in s))
    first, rest = after[sends], after[sends + 1]
    assert first[-1].type == "send"  # nothing after the sends in their segment
    weight_grads = [op for op in first if op.type == "gemm_grad" and op.outputs.get("B@GRAD")]
    assert not weight_grads  # no weight-gradient product before the sends
    assert {op.type for op in rest} >= {"gemm_grad", "push_dense"}
    assert not any(op.type in ("send", "recv") for op in rest)
    pushes = [op.attrs["table"] for s in before for op in s if op.type == "push_dense"]
    assert sorted(op.attrs["table"] for op in rest if op.type == "push_dense") == sorted(pushes)
    # every op of the program is still there once (gemm_grad: as its two halves)
    kept = [op.id for s in after for op in s]
    halves = [op.id for s in after for op in s if op.type == "gemm_grad"]
    assert sorted(set(kept)) == sorted(op.id for s in before for op in s)
    assert all(halves.count(i) == 2 for i in halves)
    assert [list(p.ops) for p in segment_programs(gpu)] == [list(s) for s in after]


def test_the_run_segments_are_saved_loaded_and_verified(tmp_path):
    plan = transpile(wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main)
    stored = {t: p.segments for t, p in plan.programs.items()}
    assert all(stored.values())
    loaded = Plan.load(plan.save(tmp_path / "plan"))
    assert {t: p.segments for t, p in loaded.programs.items()} == stored
    assert {t: Program.from_json(p.to_json()).segments for t, p in plan.programs.items()} == stored

    f = tmp_path / "plan" / "programs" / "gpu.json"
    d = json.loads(f.read_text())
    d["segments"][-1] = d["segments"][-1][1:]  # an op left out of the run segments
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"trainer gpu: in its run segments .* is in no segment"):
        Plan.load(tmp_path / "plan")
    d["segments"] = d["segments"][::-1]  # every op once, but run before their inputs exist
    d["segments"][0] = stored["gpu"][-1]
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"trainer gpu: in its run segments .* reads .* before anything"):
        Plan.load(tmp_path / "plan")


def test_a_program_without_stored_segments_runs_cut_at_its_recvs():
    """A plan saved before the segment-order pass existed: its trainers run recv-cut segments."""
    gpu = transpile(wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main).programs["gpu"]
    gpu.segments = None
    assert [[op.id for op in s] for s in segments(gpu)] == [[op.id for op in s] for s in recv_cuts(gpu.ops)]
    assert "segments" not in gpu.to_dict()


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
    assert order_segments({"gpu": seg}).segments == {"gpu": [[1, 2, 3]]}
    ops = seg.ops
    seg.global_block().set_ops([ops[1], ops[2], ops[0]])  # y made after the send: it may wait
    assert order_segments({"gpu": seg}).segments == {"gpu": [[2, 3], [1]]}
    assert seg.segments == [[2, 3], [1]]


def test_verify_refuses_run_segments_that_read_another_write():
    """Run segments that define every input before it is read, but let an op read the value a
    later op of the program overwrote: refused, naming the op, the var and the writes."""
    p = Program()
    for n in ("z", "x", "y"):
        p.global_block().create_var(n, shape=(-1, 2))
    p.append_op("data", {}, {"Out": "z"}, {"shape": [-1, 2], "dtype": "float32"})  # id 0
    p.append_op("scale", {"X": "z"}, {"Out": "x"}, {"scale": 2.0})  # id 1
    p.append_op("scale", {"X": "x"}, {"Out": "y"}, {"scale": 3.0})  # id 2: reads op 1's x
    p.append_op("scale", {"X": "z"}, {"Out": "x"}, {"scale": 4.0})  # id 3: overwrites x
    p.segments = [[0, 1, 2, 3]]
    verify({"cpu": p}, [])
    p.segments = [[0, 1, 3], [2]]
    with pytest.raises(PlanError, match=r"'scale' \(id 2\) reads 'x' as op ids \[3\] write it, in program"):
        verify({"cpu": p}, [])


def test_a_change_to_the_ops_drops_the_run_segments():
    """The segments describe the ops as the pass saw them: an op list edited afterwards runs cut at
    its recvs until the pass runs again (a stale order never runs)."""
    gpu = transpile(wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main).programs["gpu"]
    assert gpu.segments is not None and gpu.clone().segments == gpu.segments
    gpu.global_block().set_ops(list(gpu.ops))
    assert gpu.segments is None and "segments" not in gpu.to_dict()
    order_segments({"gpu": gpu})
    assert Program.from_json(gpu.to_json()).segments == gpu.segments is not None
