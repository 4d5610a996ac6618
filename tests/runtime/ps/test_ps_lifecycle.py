"""Feature lifecycle (runtime/ps/lifecycle.py) against Paddle's CtrCommonAccessor formulas written out
here in numpy on a dict of rows (ctr_accessor.cc: Update, Shrink, UpdateStatAfterSave):

    Update:  show += push_show; click += push_click; unseen_days = 0
    Shrink:  show *= decay; click *= decay; score = (show - click) * nonclk + click * click_coeff;
             delete if score < delete_threshold or unseen_days > delete_after_unseen_days
    after the day's save: unseen_days += 1

with delete_after_unseen_days = ttl_passes - 1, rows created from the per-id initializer, SGD."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ops_registry import init_rows
from runtime.ps import PSError, make_table
from runtime.ps.tiered_store import EngineMemory
from transpiler.tables import TableSpec

ENGINE_FLOOR = EngineMemory.of_budget(1).nbytes  # RocksDB's share of a budget under 8 MiB (tiered_store)

INIT = {"type": "uniform", "low": -0.1, "high": 0.1, "seed": 9}
RULE = {"ttl_passes": 2, "decay": 0.9, "nonclk_coeff": 0.1, "click_coeff": 1.0, "delete_threshold": 0.35}
SPEC = TableSpec(
    "emb", "sparse", [-1, 2], initializer=INIT, optimizer={"type": "sgd", "lr": 0.5}, lifecycle=RULE
)


class Paddle:
    """A dict of rows: id -> [param (2), show, click, unseen_days]."""

    def __init__(self):
        self.rows, self.created, self.deleted = {}, 0, 0

    def push(self, ids, grad):
        for i, g in zip(ids.tolist(), grad, strict=True):
            if i not in self.rows:
                self.rows[i] = [init_rows(INIT, (1, 2), "float32", [i])[0].astype(np.float32), 0.0, 0.0, 0]
                self.created += 1
            self.rows[i][0] = self.rows[i][0] - np.float32(0.5) * g
            self.rows[i][3] = 0

    def show_click(self, ids, labels):
        for i, y in zip(ids.tolist(), labels.tolist(), strict=True):
            if i in self.rows:
                self.rows[i][1] += 1.0
                self.rows[i][2] += y

    def shrink(self):
        days = RULE["ttl_passes"] - 1
        for i in list(self.rows):
            r = self.rows[i]
            r[1] *= RULE["decay"]
            r[2] *= RULE["decay"]
            score = (r[1] - r[2]) * RULE["nonclk_coeff"] + r[2] * RULE["click_coeff"]
            if score < RULE["delete_threshold"] or r[3] > days:
                del self.rows[i]
                self.deleted += 1
            else:
                r[3] += 1


@pytest.mark.parametrize("storage", [None, "disk"])
def test_show_click_decay_threshold_and_ttl_follow_paddles_accessor(storage):
    spec = replace(SPEC, storage="disk", memory_budget=ENGINE_FLOOR + 2000) if storage else SPEC
    t, ref = make_table(spec), Paddle()
    rng = np.random.default_rng(1)
    for _ in range(6):  # passes
        for _ in range(5):  # batches
            ids = rng.zipf(1.4, 30) % 200 + rng.integers(0, 3) * 100
            labels = (rng.random(ids.size) < 0.3).astype(np.float32)
            uniq = np.unique(ids)
            grad = rng.normal(size=(uniq.size, 2)).astype(np.float32)
            t.push(grad, uniq)
            ref.push(uniq, grad)
            t.show_click(ids, labels)
            ref.show_click(ids, labels)
        assert t.shrink() > 0 or ref.deleted == 0
        ref.shrink()
        d = t.state_dict()
        order = np.argsort(d["ids"])
        assert d["ids"][order].tolist() == sorted(ref.rows)
        want = np.array([ref.rows[i][1:] for i in sorted(ref.rows)], np.float64)
        got = np.stack([d["Show"][order], d["Click"][order], d["Unseen"][order]], 1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            d["Param"][order], np.stack([ref.rows[i][0] for i in sorted(ref.rows)]), rtol=1e-6
        )
    c = t.table_counts()
    assert (c["rows"], c["admitted"], c["evicted"]) == (len(ref.rows), ref.created, ref.deleted)
    assert ref.deleted > 0 and (c["spilled"] > 0) == bool(storage)


def test_ttl_alone_removes_a_row_after_its_nth_pass_without_a_push():
    t = make_table(replace(SPEC, lifecycle={"ttl_passes": 3}))
    t.push(np.ones((2, 2), np.float32), np.array([1, 2]))
    for p in range(1, 5):
        t.shrink()
        if p < 4:
            t.push(np.ones((1, 2), np.float32), np.array([2]))  # 2 is seen every pass
        # row 1, pushed in pass 1 only, goes at the end of pass 4: the 3rd pass without a push
        assert sorted(t.state_dict()["ids"].tolist()) == ([1, 2] if p < 4 else [2])


def test_bad_lifecycle_rules_are_refused_naming_the_table():
    for rule, what in (
        ({"ttl": 3}, "keys among"),
        ({"ttl_passes": 0}, "ttl_passes"),
        ({"decay": 1.5}, "decay"),
    ):
        with pytest.raises(PSError, match=f"table 'emb'.*{what}"):
            make_table(replace(SPEC, lifecycle=rule))
    with pytest.raises(PSError, match="no lifecycle"):
        make_table(replace(SPEC, lifecycle=None)).show_click(np.array([1]), np.array([1.0]))


def test_the_shrink_request_ends_a_pass_on_every_shard_and_needs_the_admin_key():
    """Two server shards, ttl_passes 2, no threshold: ids 0-9 pushed in pass 1, ids 0-3 in pass 2,
    none in pass 3. By hand: pass 1 and 2 remove nothing, pass 3 removes 4..9 (two passes unseen)
    and keeps 0-3 (one); pass 4 removes 0-3. A trainer's key cannot shrink."""
    from runtime.ps import PSClient, Servers

    spec = replace(SPEC, lifecycle={"ttl_passes": 2})
    with Servers([spec], num_shards=2) as servers, servers.client() as admin:
        removed = []
        for ids in (np.arange(10), np.arange(4), None, None):
            if ids is not None:
                admin.push("emb", np.ones((ids.size, 2), np.float32), ids)
            removed.append(admin.shrink())
            held = sum(s["emb"]["rows"] for s in admin.stats())
            removed[-1]["held"] = held
        assert removed == [
            {"emb": 0, "held": 10},
            {"emb": 0, "held": 10},
            {"emb": 6, "held": 4},
            {"emb": 4, "held": 0},
        ]
        with PSClient(servers.endpoints, secret=servers.secret, pusher="cpu:0", timeout=10) as trainer:
            with pytest.raises(PSError, match="admin"):
                trainer.shrink()
