"""Placement, boundaries and the config: where ops land, what crosses, and why."""

from __future__ import annotations

import json

import pytest

from transpiler import Program, TranspileConfig, models, transpile
from transpiler import builder as nn
from transpiler.passes import assign_devices
from transpiler.tables import Sharding, StateSpec


def wide_deep() -> models.Model:
    return models.wide_deep(
        num_slots=26, vocab=100, dim=8, num_dense=13, hidden=(32, 16), optimizer=nn.SGD(0.1)
    )


def out_of(prog: Program, op_type: str, nth: int = 0) -> str:
    return [op for op in prog.ops if op.type == op_type][nth].output_names()[0]


def test_wide_deep_boundary_is_exactly_the_hand_derived_set():
    """Forward: the concatenated deep embeddings (26 x 8), the pooled wide embedding, the dense
    features and the label go cpu -> gpu; backward: the two embedding gradients come back. Each once."""
    m = wide_deep()
    emb, wide = out_of(m.main, "reshape"), out_of(m.main, "reduce_sum")
    plan = transpile(m.main)
    got = [(c["src"], c["dst"], c["tensor"], c["direction"]) for c in plan.channels]
    want = [
        ("cpu", "gpu", emb, "forward"),
        ("cpu", "gpu", wide, "forward"),
        ("cpu", "gpu", "dense", "forward"),
        ("cpu", "gpu", "label", "forward"),
        ("gpu", "cpu", f"{emb}@GRAD", "backward"),
        ("gpu", "cpu", f"{wide}@GRAD", "backward"),
    ]
    assert sorted(got) == sorted(want)
    bytes_ = {c["tensor"]: c["bytes_per_example"] for c in plan.channels}
    assert bytes_[emb] == 26 * 8 * 4 and bytes_[wide] == 4 and bytes_["dense"] == 13 * 4
    for dev, prog in plan.programs.items():  # one send per tensor per crossing, not per consumer
        sent = [op.attrs["tensor"] for op in prog.ops if op.type == "send"]
        assert len(sent) == len(set(sent)), dev
    assert "total cpu -> gpu: 892 B per example" in plan.summary()


def test_placement_by_type_and_backward_follows_forward():
    m = wide_deep()
    placed = m.main.clone()
    assign_devices(placed, TranspileConfig())
    by_id = {op.id: op for op in placed.ops}
    kinds = {
        "data": "cpu",
        "embedding": "cpu",
        "gemm": "gpu",
        "sigmoid_cross_entropy_with_logits": "gpu",
        "sgd": "ps",
    }
    for op in placed.ops:
        if op.type in kinds:
            assert op.device == kinds[op.type], op
        if op.role == "backward" and op.type != "sum":
            assert op.device == by_id[op.attrs["fwd_id"]].device, op
    assert all(op.device for op in placed.ops)


def test_explicit_op_device_wins_and_overrides_by_name_and_type():
    m = wide_deep()
    gemm = next(op for op in m.main.ops if op.type == "gemm")
    gemm.attrs["op_device"] = "cpu"  # as Paddle's device_guard("cpu") would
    cfg = TranspileConfig(
        op_type_devices={"gemm": "cpu", "embedding": "gpu"},
        name_devices={gemm.output_names()[0]: "gpu", "relu_1*": "cpu"},
    )
    plan = transpile(m.main, cfg)
    assert plan.placement[str(gemm.id)]["device"] == "cpu"
    assert "explicit op_device" in plan.explain(gemm.id)
    relu1 = next(op for op in m.main.ops if op.type == "relu" and op.output_names()[0].startswith("relu_1"))
    assert plan.placement[str(relu1.id)]["device"] == "cpu"
    assert "matches 'relu_1*'" in plan.explain(relu1.output_names()[0])
    emb = next(op for op in m.main.ops if op.type == "embedding")
    assert plan.placement[str(emb.id)]["device"] == "gpu"
    assert "op_type_devices['embedding']" in plan.explain(emb)
    pulls = [op for op in plan.programs["gpu"].ops if op.type == "pull_sparse"]
    assert {op.attrs["table"] for op in pulls} == {"wide_emb.w_0", "deep_emb.w_0"}


def test_a_name_pattern_that_matches_nothing_is_an_error_naming_real_outputs():
    """docs/cli.md used to show {"fc_2*": cpu}, which matches no builder output (gemm_2.tmp) and
    was silently ignored."""
    m = wide_deep()
    with pytest.raises(ValueError, match=r"pattern 'fc_2\*' matches no op output .* e\.g\. sparse"):
        transpile(m.main, TranspileConfig(name_devices={"fc_2*": "cpu", "relu_1*": "cpu"}))
    gemm2 = out_of(m.main, "gemm", 2)
    plan = transpile(m.main, TranspileConfig(name_devices={"gemm_2*": "cpu"}))
    assert f"output {gemm2!r} matches 'gemm_2*'" in plan.explain(gemm2)


def test_light_ops_cut_fewer_bytes_and_explain_says_so():
    m = wide_deep()
    plan = transpile(m.main)
    wide = next(op for op in m.main.ops if op.type == "reduce_sum")  # [B,26,1] -> [B,1]: pool on cpu
    assert plan.placement[str(wide.id)]["device"] == "cpu"
    assert plan.explain(wide.id).endswith("on cpu: 8, on gpu: 208")
    concat = next(op for op in m.main.ops if op.type == "concat")  # joins the dense part on gpu
    assert plan.placement[str(concat.id)]["device"] == "gpu"
    sgd = next(op for op in m.main.ops if op.type == "sgd")
    assert "parameter server" in plan.explain(sgd.id)


def test_dlrm_gradient_sums_go_where_one_tensor_crosses():
    """A pooled embedding feeds Z and Z^T: its two gradient parts are summed on gpu, so one
    gradient (not two) crosses back to cpu per slot."""
    m = models.dlrm(num_slots=4, vocab=50, dim=4, bag=3, optimizer=nn.SGD(0.1))
    plan = transpile(m.main)
    pooled = [op.output_names()[0] for op in m.main.ops if op.type == "reduce_sum"]
    sums = [op for op in plan.programs["gpu"].ops if op.type == "sum"]
    assert {op.output_names()[0] for op in sums} >= {f"{p}@GRAD" for p in pooled}
    back = [c["tensor"] for c in plan.channels if c["direction"] == "backward"]
    assert sorted(back) == sorted(f"{p}@GRAD" for p in pooled)
    assert "gradient-accumulation 'sum'" in plan.explain(f"{pooled[0]}@GRAD")


def test_sparse_tables_pull_unique_rows_and_push_row_grads():
    m = wide_deep()
    plan = transpile(m.main)
    kinds = {t.name: t.kind for t in plan.tables}
    assert kinds["deep_emb.w_0"] == kinds["wide_emb.w_0"] == "sparse"
    assert kinds["fc_0.w_0"] == "dense"
    cpu = plan.programs["cpu"]
    assert [op.type for op in cpu.ops].count("unique_ids") == 1  # shared by both lookups of `sparse`
    assert sorted(op.attrs["table"] for op in cpu.ops if op.type == "push_sparse") == [
        "deep_emb.w_0",
        "wide_emb.w_0",
    ]
    deep = plan.table("deep_emb.w_0")
    assert deep.shape == [100, 8] and deep.optimizer.type == "sgd"
    assert deep.sharding == Sharding(by="id_hash", num_shards=1)
    dense = transpile(m.main, TranspileConfig(sparse_tables=["wide_emb.w_0"]))
    assert {t.name: t.kind for t in dense.tables}["deep_emb.w_0"] == "dense"
    with pytest.raises(ValueError, match="fc_0.w_0.*not an embedding lookup"):
        transpile(m.main, TranspileConfig(sparse_tables=["fc_0.w_0"]))


def test_optimizer_specs_carry_hyper_parameters_and_state():
    m = models.wide_deep(
        num_slots=2, vocab=10, dim=2, num_dense=2, hidden=(4,), optimizer=nn.Adam(0.003, beta1=0.8)
    )
    t = transpile(m.main, TranspileConfig(num_servers=2)).table("fc_0.w_0")
    opt = t.optimizer
    assert (opt.type, opt.hyper["lr"], opt.hyper["beta1"], opt.hyper["beta2"]) == ("adam", 0.003, 0.8, 0.999)
    assert opt.state["Beta1Pow"] == StateSpec(out="Beta1PowOut", shape=[1], init=0.8)
    assert opt.state["Moment1"].shape == t.shape
    assert t.sharding.by == "table" and t.sharding.shard in (0, 1)


def test_config_loads_from_yaml_and_json(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "trainer_types: [cpu, gpu, npu]\nop_type_devices: {relu: npu}\n"
        "mode: async\noptimizer: {type: adam, lr: 0.002}\n"
    )
    cfg = TranspileConfig.load(tmp_path / "c.yaml")
    assert cfg.trainer_types == ["cpu", "gpu", "npu"] and cfg.mode == "async"
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_dict()))
    assert TranspileConfig.load(tmp_path / "c.json") == cfg
    with pytest.raises(ValueError, match="mode 'geo' is not supported"):
        TranspileConfig(mode="geo")
    with pytest.raises(ValueError, match="unknown TranspileConfig keys \\['modes'\\]"):
        TranspileConfig.from_dict({"modes": "sync"})
    with pytest.raises(ValueError, match="'tpu' is not a trainer type"):
        TranspileConfig(op_type_devices={"gemm": "tpu"})
    with pytest.raises(ValueError, match="mode 'fast'"):
        TranspileConfig(mode="fast")
    plan = transpile(wide_deep().main, cfg)  # relu on a third trainer type: cpu -> gpu -> npu -> gpu
    assert list(plan.programs) == ["cpu", "gpu", "npu"]
    assert all(
        op.type in ("relu", "relu_grad") or op.role in ("comm", "ps") for op in plan.programs["npu"].ops
    )


def test_old_category_name_elementwise_still_works_with_a_warning():
    """`elementwise` was renamed `light`: a config that pins it still pins every light op."""
    from ops_registry import get_op

    with pytest.warns(DeprecationWarning, match="'elementwise' is now called 'light'"):
        config = TranspileConfig(category_map={**TranspileConfig().category_map, "elementwise": "gpu"})
    assert config.category_map["light"] == "gpu" and "elementwise" not in config.category_map
    plan = transpile(wide_deep().main, config)
    light = [
        op
        for p in plan.programs.values()
        for op in p.ops
        if op.role == "forward" and get_op(op.type).category == "light"
    ]
    assert light and {op.device for op in light} == {"gpu"}
