"""The IR: exact JSON round trip of builder programs, .npz parameters, str(), inference pruning."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime import Executor
from runtime.data import SyntheticCTR
from transpiler import Program, inference_program
from transpiler import builder as nn
from transpiler.models import wide_deep


def every_layer_program(optimizer: nn.Optimizer) -> tuple[Program, Program, nn.Var]:
    """A program that uses every builder layer (and so every attr kind: ints, floats, lists, None)."""
    main, startup = Program(), Program()
    main.attrs["random_seed"] = 5
    with nn.program_guard(main, startup):
        ids = nn.data("ids", [-1, 3], "int64")
        x = nn.data("x", [-1, 4])
        cls = nn.data("cls", [-1, 1], "int64")
        emb = nn.reshape(nn.embedding(ids, 50, 4, sparse=False), [-1, 12])
        h = nn.layer_norm(nn.concat([emb, x], axis=1))
        h = nn.dropout(nn.fc(h, 8, act="tanh"), ratio=0.25, seed=3)
        h = nn.div(
            nn.sub(nn.mul(nn.sigmoid(h), h), nn.reduce_mean(h, axes=[1], keepdims=True)),
            nn.add(nn.relu(h), nn.reduce_sum(x, axes=[1], keepdims=True)),
        )
        logits = nn.linear(h, 3)
        loss = nn.add(
            nn.reduce_mean(nn.softmax_cross_entropy(logits, cls)),
            nn.reduce_mean(nn.square_error(logits, nn.reduce_mean(x, axes=[1], keepdims=True))),
        )
        optimizer.minimize(loss)
    return main, startup, loss


PROGRAMS = {
    "wide_deep-adam": lambda: wide_deep(optimizer=nn.Adam(0.01)),
    "wide_deep-forward": lambda: wide_deep(),
    "every_layer-adagrad": lambda: every_layer_program(nn.Adagrad(0.1)),
    "every_layer-sgd": lambda: every_layer_program(nn.SGD(0.1)),
}


def _programs(name: str) -> tuple[Program, Program]:
    built = PROGRAMS[name]()
    return (built.main, built.startup) if hasattr(built, "main") else built[:2]


def _same(a: Program, b: Program) -> None:
    """Field-by-field equality with Python types (1 vs 1.0 vs True differ), order included."""

    def typed(x):
        return json.loads(json.dumps(x), parse_int=lambda s: ("int", s), parse_float=lambda s: ("float", s))

    assert typed(a.attrs) == typed(b.attrs)
    assert a._next_id == b._next_id
    for ba, bb in zip(a.blocks, b.blocks, strict=True):
        assert list(ba.vars) == list(bb.vars)
        for name in ba.vars:
            assert ba.vars[name] == bb.vars[name], name
        assert len(ba.ops) == len(bb.ops)
        for oa, ob in zip(ba.ops, bb.ops, strict=True):
            assert (oa.id, oa.type, oa.inputs, oa.outputs) == (ob.id, ob.type, ob.inputs, ob.outputs)
            assert typed(oa.attrs) == typed(ob.attrs), oa.type


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_json_round_trip_is_exact(name):
    for program in _programs(name):
        text = program.to_json()
        back = Program.from_json(text)
        _same(program, back)
        assert back.to_json() == text
        assert str(back) == str(program)


def test_round_tripped_program_trains_identically(tmp_path):
    """Saved and loaded programs (main + startup) give bit-identical losses and parameters."""
    model = wide_deep(vocab=200, hidden=(16,), optimizer=nn.Adam(0.01))
    model.main.save(tmp_path / "main")
    model.startup.save(tmp_path / "startup")
    loaded = Program.load(tmp_path / "main"), Program.load(tmp_path / "startup")
    data = SyntheticCTR(vocab=200)
    results = []
    for main, startup in ((model.main, model.startup), loaded):
        exe = Executor()
        exe.run(startup)
        losses = [exe.run(main, feed=b, fetch_list=[model.loss.name])[0] for b in data.batches(64, 3)]
        results.append((losses, {p.name: exe.scope[p.name] for p in main.parameters()}))
    (la, pa), (lb, pb) = results
    assert np.array_equal(la, lb) and la[0] != la[-1]
    assert pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_params_npz_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    program = Program()
    program.params = {
        "fc_0.w_0": rng.normal(size=(3, 4)).astype(np.float32),
        "emb/table@GRAD": rng.integers(0, 9, (5, 2)),
        "scalar": np.float64(2.5) * np.ones(()),
        "a name with spaces": np.arange(4, dtype=np.int32),
    }
    program.save(tmp_path / "p")
    assert (tmp_path / "p.json").exists() and (tmp_path / "p.npz").exists()
    back = Program.load(tmp_path / "p").params
    assert list(back) == list(program.params)
    for name, value in program.params.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert np.array_equal(back[name], value)


def test_str_shows_one_op_a_line():
    model = wide_deep(optimizer=nn.SGD(0.05))
    lines = str(model.main).splitlines()
    op_lines = [line for line in lines if line.startswith("  {")]
    assert len(op_lines) == len(model.main.ops)
    for line, op in zip(op_lines, model.main.ops, strict=True):
        assert f"= {op.type}(" in line and f"[{op.role}" in line
    assert "  var deep_emb.w_0: float32[1000, 8] (persistable, is_parameter, is_sparse)" in lines


def test_new_ids_stay_unique_after_loading():
    main = Program.from_json(wide_deep(optimizer=nn.SGD(0.05)).main.to_json())
    op = main.append_op("relu", {"X": "dense"}, {"Y": "r"})
    assert op.id not in {o.id for o in main.ops[:-1]}


def test_clone_is_independent():
    main = wide_deep().main
    twin = main.clone()
    twin.ops[0].attrs["op_device"] = "cpu"
    twin.var("dense").shape = (-1, 99)
    assert "op_device" not in main.ops[0].attrs and main.var("dense").shape == (-1, 13)


def test_inference_program_is_the_forward_part():
    """Pruned to `pred` it has no backward/optimize ops and needs no label; it predicts what an
    independently built forward-only W&D predicts with the same (trained) weights."""
    trained = wide_deep(vocab=300, optimizer=nn.Adam(0.01))
    infer = inference_program(trained.main, [trained.pred])
    assert {op.role for op in infer.ops} == {"forward"}
    assert "label" not in infer.vars and not any("@GRAD" in n for n in infer.vars)
    assert not any(n.endswith("_moment1_0") for n in infer.vars)
    exe = Executor()
    exe.run(trained.startup)
    data = SyntheticCTR(vocab=300)
    for b in data.batches(64, 5):
        exe.run(trained.main, feed=b)
    test = data.batch(10**6, 128)
    features = {"sparse": test["sparse"], "dense": test["dense"]}
    (pred,) = exe.run(infer, feed=features, fetch_list=[trained.pred])
    reference = wide_deep(vocab=300)
    (want,) = exe.run(reference.main, feed=test, fetch_list=[reference.pred])
    assert np.array_equal(pred, want)
    assert Program.from_json(infer.to_json()).to_json() == infer.to_json()
    with pytest.raises(KeyError, match="nope"):
        inference_program(trained.main, ["nope"])


def test_inference_program_turns_dropout_off():
    main, startup, loss = every_layer_program(nn.SGD(0.1))
    infer = inference_program(main)
    drop = [op for op in infer.ops if op.type == "dropout"]
    assert [op.attrs["training_mode"] for op in drop] == [0]
    assert [op.attrs["training_mode"] for op in main.ops if op.type == "dropout"] == [1]
    exe = Executor()
    exe.run(startup)
    rng = np.random.default_rng(0)
    feed = {
        "ids": rng.integers(0, 50, (8, 3)),
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "cls": rng.integers(0, 3, (8, 1)),
    }
    out = drop[0].outputs["output"][0]
    first, second = (exe.run(infer, feed=feed, fetch_list=[out])[0] for _ in range(2))
    (inp,) = exe.run(infer, feed=feed, fetch_list=[drop[0].inputs["data"][0]])
    assert np.array_equal(first, second) and np.array_equal(first, inp)
