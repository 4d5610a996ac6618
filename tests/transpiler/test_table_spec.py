"""`TableSpec`, the typed table record of a Plan: plan files saved before it existed load and save
back byte for byte, its plain-data form names bad keys, and the runtime takes only the record."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.ps import make_table
from transpiler import PlanError, TableSpec, TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.models import wide_deep
from transpiler.plan import Plan
from transpiler.tables import OptimizerSpec, Sharding, StateSpec

# Saved by the code of commit f02a415, when plan.tables were plain dicts (tests/data/README.md).
OLD_PLAN = Path(__file__).parents[1] / "data" / "plan_f02a415"


def test_a_plan_saved_before_table_specs_loads_and_saves_back_byte_for_byte(tmp_path):
    plan = Plan.load(OLD_PLAN)
    raw = json.loads((OLD_PLAN / "plan.json").read_text())["tables"]
    assert [type(t) for t in plan.tables] == [TableSpec] * 6
    emb = plan.table("deep_emb.w_0")  # read field by field against the file, by hand
    want = next(t for t in raw if t["name"] == "deep_emb.w_0")
    assert (emb.kind, emb.shape, emb.dtype) == ("sparse", [50, 4], "float32")
    assert emb.initializer == want["initializer"] and emb.optimizer.to_dict() == want["optimizer"]
    assert emb.sharding == Sharding(by="id_hash", num_shards=2, shard=None)
    assert (emb.entry, emb.evict_after) == ({"type": "count", "threshold": 2}, 100)
    dense = plan.table("fc_0.w_0")
    assert dense.sharding == Sharding(by="table", num_shards=2, shard=0)
    assert (dense.entry, dense.evict_after) == (None, None)
    plan.save(tmp_path / "again")
    for f in ("plan.json", "programs/cpu.json", "programs/gpu.json"):
        assert (tmp_path / "again" / f).read_bytes() == (OLD_PLAN / f).read_bytes(), f


def test_todays_transpile_writes_the_tables_as_the_old_code_did(tmp_path):
    """The same model and config as the saved plan: the "tables" part of plan.json is the same
    text (keys, their order, the optional keys only where set)."""
    model = wide_deep(
        num_slots=3,
        vocab=50,
        dim=4,
        num_dense=2,
        hidden=(8,),
        optimizer=nn.Adam(lr=0.01, lr_schedule={"type": "step", "step_size": 10, "gamma": 0.5}),
    )
    config = TranspileConfig(num_servers=2, sparse_entry={"type": "count", "threshold": 2}, evict_after=100)
    transpile(model.main, config).save(tmp_path / "new")
    old = json.loads((OLD_PLAN / "plan.json").read_text())["tables"]
    new = json.loads((tmp_path / "new" / "plan.json").read_text())["tables"]
    assert json.dumps(new, indent=1) == json.dumps(old, indent=1)
    assert [list(t) for t in new] == [list(t) for t in old]


def test_to_dict_leaves_out_only_unset_optional_keys():
    spec = TableSpec(name="w", kind="dense", shape=[2, 3])
    assert spec.to_dict() == {
        "name": "w",
        "kind": "dense",
        "shape": [2, 3],
        "dtype": "float32",
        "initializer": None,
        "optimizer": None,
    }
    assert TableSpec.from_dict(spec.to_dict()) == spec


def test_from_dict_names_unknown_and_missing_keys():
    with pytest.raises(
        ValueError,
        match=r"table spec 'w': unknown keys \['kindd', 'vocab'\]; missing keys "
        r"\['kind'\]",
    ):
        TableSpec.from_dict({"name": "w", "kindd": "dense", "vocab": 3, "shape": [2]})
    with pytest.raises(ValueError, match=r"missing keys \['name', 'shape'\]"):
        TableSpec.from_dict({"kind": "dense"})
    with pytest.raises(ValueError, match="must be a mapping"):
        TableSpec.from_dict(["w", "dense"])


def test_a_plan_file_with_a_bad_table_key_is_refused_naming_the_file_and_key(tmp_path):
    bad = tmp_path / "plan"
    shutil.copytree(OLD_PLAN, bad)
    meta = json.loads((bad / "plan.json").read_text())
    meta["tables"][1]["shards"] = meta["tables"][1].pop("sharding")
    (bad / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(PlanError, match=r"plan\.json: table spec 'fc_0.b_0': unknown keys \['shards'\]"):
        Plan.load(bad)


def test_make_table_takes_the_record_not_a_dict():
    d = {"name": "w", "kind": "dense", "shape": [2], "initializer": {"type": "constant", "value": 1.0}}
    with pytest.raises(TypeError, match=r"TableSpec\.from_dict makes one"):
        make_table(d)
    assert make_table(TableSpec.from_dict(d)).pull().tolist() == [1.0, 1.0]


def test_the_optimizer_is_a_typed_record_too():
    plan = Plan.load(OLD_PLAN)
    opt = plan.table("fc_0.w_0").optimizer
    assert isinstance(opt, OptimizerSpec) and opt.type == "adam"
    assert opt.hyper["lr_schedule"] == {"type": "step", "step_size": 10, "gamma": 0.5}
    assert opt.state["Moment1"] == StateSpec(out="Moment1Out", shape=[14, 8], init=0.0)
    assert opt.state["Beta2Pow"] == StateSpec(out="Beta2PowOut", shape=[1], init=0.999)
    # a hand-written optimizer dict is read into the record; one without state keeps none
    spec = TableSpec(name="w", kind="dense", shape=[2], optimizer={"type": "sgd", "lr": 0.5})
    assert spec.optimizer == OptimizerSpec("sgd", {"lr": 0.5}) and spec.to_dict()["optimizer"] == {
        "type": "sgd",
        "lr": 0.5,
    }
    with pytest.raises(
        ValueError,
        match=r"table spec 'w': optimizer 'adam': state slot 'Moment1' must have "
        r"exactly the keys \['out', 'shape', 'init'\]",
    ):
        TableSpec(
            name="w",
            kind="dense",
            shape=[2],
            optimizer={"type": "adam", "lr": 0.1, "state": {"Moment1": {"init": 0.0}}},
        )
    with pytest.raises(ValueError, match="table spec 'w': an optimizer spec must be a mapping with a 'type'"):
        TableSpec(name="w", kind="dense", shape=[2], optimizer={"lr": 0.1})


def test_the_plan_hash_of_an_old_plan_is_unchanged():
    """Checkpoints record `plan_hash` to refuse resuming with another plan; the code of f02a415
    gave the saved plan this hash, so checkpoints made before TableSpec still resume."""
    from runtime.driver.checkpoints import plan_hash

    assert plan_hash(Plan.load(OLD_PLAN)) == "f710a6da70976182"


def test_a_sharding_dict_is_read_into_the_record_and_a_bad_one_named():
    spec = TableSpec(name="w", kind="dense", shape=[2], sharding={"by": "table", "shard": 1, "num_shards": 2})
    assert spec.sharding == Sharding(by="table", num_shards=2, shard=1)
    assert list(spec.to_dict()["sharding"]) == ["by", "shard", "num_shards"]  # the plan file's order
    with pytest.raises(
        ValueError, match=r"table spec 'w': a sharding must be a mapping with 'by', 'num_shards'"
    ):
        TableSpec(name="w", kind="dense", shape=[2], sharding={"by": "table", "shards": 2})
