"""Show/click from training (transpiler/show_click.py, runtime/trainer/ps_access.py): a table with a
`lifecycle` gets, with every sparse push, (show, click) per looked-up id occurrence — show 1, click
its sample's label (Paddle's PushSparseVarsWithLabelAsync) — and the shard adds them to the rows.
References: the hand count over the run's batches (data.batch(t, n) for step t), Paddle's decay at
pass ends written out; the plan refuses lookups away from the trainer that reads the label."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.data import SyntheticCTR
from runtime.driver.train import train
from runtime.ps import Shard
from transpiler import TranspileConfig, transpile
from transpiler import builder as nn
from transpiler.errors import PlanError
from transpiler.models import wide_deep

SLOTS, VOCAB, BATCH, STEPS = 4, 100, 64, 6


def plan(**cfg):
    m = wide_deep(num_slots=SLOTS, vocab=VOCAB, dim=4, hidden=(8,), optimizer=nn.Adam(lr=0.02))
    return transpile(m.main, TranspileConfig(lifecycle={"decay": 0.5}, **cfg))


def hand_counts(steps: int) -> dict[int, tuple[float, float]]:
    """id -> (shows, clicks) over batches 0..steps-1: each occurrence shows once, clicks by its label."""
    out: dict[int, list[float]] = {}
    data = SyntheticCTR(vocab=VOCAB, num_slots=SLOTS)
    for t in range(steps):
        b = data.batch(t, BATCH)
        for row, y in zip(b["sparse"], b["label"].reshape(-1), strict=True):
            for i in row.tolist():
                c = out.setdefault(i, [0.0, 0.0])
                c[0] += 1.0
                c[1] += float(y)
    return {i: (s, c) for i, (s, c) in out.items()}


def saved_stats(ckpt: Path, table: str) -> dict[int, tuple[float, float]]:
    """id -> (Show, Click) of `table`'s rows in the newest checkpoint under `ckpt`, read with numpy."""
    path = sorted(ckpt.glob("step-*"))[-1]
    doc = json.loads((path / "manifest.json").read_text())
    out = {}
    for e in (e for e in doc["files"] if e["table"] == table):
        with np.load(path / e["file"]) as z:
            stats = zip(z["Show"].tolist(), z["Click"].tolist(), strict=True)
            out.update(zip(z["ids"].tolist(), stats, strict=True))
    return out


@pytest.mark.parametrize(
    "mode, trainers, micro, servers",
    [("sync", {"cpu": 2, "gpu": 1}, 1, 2), ("async", {"cpu": 1, "gpu": 1}, 2, 1)],
)
def test_rows_show_click_after_training_equal_the_hand_count(tmp_path, mode, trainers, micro, servers):
    p = plan()
    assert set(p.show_click_feeds) == {"wide_emb.w_0", "deep_emb.w_0"}
    assert {s.label for s in p.show_click_feeds.values()} == {"label"}
    ckpt = tmp_path / "ckpt"
    kw = dict(
        batch_size=BATCH, trainers=trainers, mode=mode, servers=servers, allow_emulation=True, progress=False
    )
    train(
        p,
        SyntheticCTR(vocab=VOCAB, num_slots=SLOTS),
        steps=STEPS,
        checkpoint=str(ckpt),
        micro_batches=micro,
        **kw,
    )
    want = hand_counts(STEPS)
    for table in p.show_click_feeds:
        got = saved_stats(ckpt, table)
        assert set(got) == set(want), table
        for i, (s, c) in want.items():
            assert got[i] == pytest.approx((s, c), rel=1e-6), (table, i)


def test_a_saved_plan_keeps_its_show_click_feeds(tmp_path):
    from transpiler import Plan

    p = plan()
    p.save(tmp_path / "plan")
    assert Plan.load(tmp_path / "plan").show_click_feeds == p.show_click_feeds


def test_lookups_away_from_the_label_reader_are_refused_naming_the_table():
    with pytest.raises(PlanError, match=r"table 'deep_emb.w_0': its lookups run on trainer types \['gpu'\]"):
        plan(op_type_devices={"embedding": "gpu"})


def test_pushed_show_click_then_pass_ends_follow_paddles_decay():
    """Shard level: two passes of pushes with (show, click); at each pass end (shrink) show and click
    decay by 0.5 (Paddle's Shrink), then the next pass adds its counts."""
    p = plan()
    spec = p.table("wide_emb.w_0")
    shard = Shard([spec])
    ids = np.array([3, 7, 3, 9], np.int64)
    sc = np.array([[1, 1], [1, 0], [1, 0], [1, 1]], np.float32)  # id 3 twice: shows 2, clicks 1
    grad = np.zeros((4, spec.shape[1]), np.float32)
    shard.push(spec.name, grad, ids, show_click=sc)
    shard.shrink()
    shard.push(spec.name, grad[:2], ids[:2], show_click=sc[:2])
    shard.shrink()
    got = shard.table(spec.name).rows_of(np.array([3, 7, 9]))
    # id 3: (2 * .5 + 1) * .5 = 1.0 shows, (1 * .5 + 1) * .5 = .75 clicks; 7: (.5 + 1) * .5, 0; 9: .25, .25
    np.testing.assert_allclose(got["Show"], [1.0, 0.75, 0.25])
    np.testing.assert_allclose(got["Click"], [0.75, 0.0, 0.25])
    with pytest.raises(Exception, match=r"show/click must be a finite, non-negative float32"):
        shard.push(spec.name, grad, ids, show_click=sc[:3])
    shard.close()


def shared_table_program():
    """Feeds `user` [n, 1] and `item` [n, 2] looked up in one table `shared` (rows pushed through the
    trainer's general path: a table of two feeds), a logistic loss on `click`."""
    from transpiler.ir import Program

    main, startup = Program(), Program()
    with nn.program_guard(main, startup):
        a, b = nn.data("user", [-1, 1], "int64"), nn.data("item", [-1, 2], "int64")
        y = nn.data("click", [-1, 1], "float32")
        init = {"type": "uniform", "low": -0.1, "high": 0.1}
        w = nn.create_parameter([50, 3], name="shared", is_sparse=True, initializer=init)
        ea = nn.append("embedding", {"W": w, "Ids": a}, {"is_sparse": 1}, dtype="float32")["Out"]
        eb = nn.append("embedding", {"W": w, "Ids": b}, {"is_sparse": 1}, dtype="float32")["Out"]
        logit = nn.fc(nn.concat([nn.reshape(ea, [-1, 3]), nn.reshape(eb, [-1, 6])], axis=1), 1)
        loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, y))
        nn.SGD(lr=0.1).minimize(loss)
    return main


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_table_of_two_feeds_counts_the_occurrences_of_both(tmp_path, mode):
    p = transpile(shared_table_program(), TranspileConfig(lifecycle={"decay": 0.5}))
    assert p.show_click_feeds["shared"].ids == ("user", "item")
    rng = np.random.default_rng(0)
    data = [
        {
            "user": rng.integers(0, 50, (16, 1)),
            "item": rng.integers(0, 50, (16, 2)),
            "click": (rng.random((16, 1)) < 0.3).astype(np.float32),
        }
        for _ in range(4)
    ]
    ckpt = tmp_path / "ckpt"
    train(
        p,
        data,
        steps=4,
        checkpoint=str(ckpt),
        trainers={"cpu": 1, "gpu": 1},
        mode=mode,
        allow_emulation=True,
        progress=False,
    )
    want: dict[int, list[float]] = {}
    for bt in data:
        for col in ("user", "item"):
            for r, lab in zip(bt[col], bt["click"].reshape(-1), strict=True):
                for i in r.tolist():
                    c = want.setdefault(i, [0.0, 0.0])
                    c[0] += 1.0
                    c[1] += float(lab)
    got = saved_stats(ckpt, "shared")
    assert set(got) == set(want)
    for i, c in want.items():
        assert got[i] == pytest.approx(tuple(c)), i


@pytest.mark.parametrize("clip", [None, 1.0], ids=["sync", "sync-clipped"])
def test_sync_pushes_add_show_click_once_the_step_is_applied(clip):
    """Sync mode, 2 pushers: a step's (show, click) wait with its gradients and are added, summed
    over both pushers, when the step is applied (a clipped table's: at clip_apply, not before)."""
    from dataclasses import replace

    spec = replace(plan().table("wide_emb.w_0"), clip_norm=clip)
    shard = Shard([spec], mode="sync", pushes_per_step=2)
    grad = np.ones((2, spec.shape[1]), np.float32)
    ids = np.array([4, 8], np.int64)
    shard.push(spec.name, grad, ids, 0, "a", show_click=np.array([[2, 1], [1, 0]], np.float32))
    assert not shard.table(spec.name).exists(ids).any()  # one pusher in: nothing applied yet
    shard.push(spec.name, grad, ids, 0, "b", show_click=np.array([[1, 1], [3, 2]], np.float32))
    if clip is not None:
        assert not shard.table(spec.name).exists(ids).any()  # held for its clip scale
        shard.clip_apply(0, 0.5)
    got = shard.table(spec.name).rows_of(ids)
    np.testing.assert_array_equal(got["Show"], [3.0, 4.0])
    np.testing.assert_array_equal(got["Click"], [2.0, 2.0])
    shard.close()
