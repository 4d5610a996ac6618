"""What the online loop (runtime/driver/online.py) does at a pass end and between passes, on real
pass directories and real trainer and server processes: the feature lifecycle (TTL) applied
before each pass's save, per-pass checkpoints as a delta chain that goes on across passes and a
resume, restoring to the tables a full-save run holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime import OnlineConfig, predict, train
from runtime.data.streams import PassDirectorySource
from runtime.driver.publish import ServedModel
from runtime.evaluation.forward import load_tables
from runtime.ps.checkpoint import read_manifest
from transpiler import builder as nn
from transpiler.config import TranspileConfig
from transpiler.models import wide_deep
from transpiler.plan import transpile

SPARSE = ("deep_emb.w_0", "wide_emb.w_0")


def write_users(logs: Path, hour: int, users: list[str], n: int = 32) -> None:
    """Pass `hour`: `n` records cycling over `users` (click by a fixed rule)."""
    d = logs / f"20240101/{hour:02d}"
    d.mkdir(parents=True)
    rows = "".join(f"{r % 2},{(r % 5) / 5:.2f},{users[r % len(users)]}\n" for r in range(n))
    (d / "part-00000.csv").write_text("click,x,user\n" + rows)
    (d / "_SUCCESS").write_text("")


def make_plan(vocab: int, **config) -> object:
    model = wide_deep(num_slots=1, num_dense=1, vocab=vocab, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.5))
    return transpile(model.main, TranspileConfig(name_devices={"*": "cpu"}, **config))


def schema(vocab: int) -> dict:
    return {"label": "click", "dense": ["x"], "sparse": ["user"], "vocab": vocab}


def ids_of(logs: Path, vocab: int, batch: int) -> dict[str, set[int]]:
    """Per pass, the hashed ids its records look up (read by the source, as the trainers get them)."""
    src = PassDirectorySource(logs, schema(vocab), batch_size=batch, follow=False)
    return {p.id: {int(i) for b in p.batches for i in b["sparse"].ravel()} for p in src.passes()}


def batches(logs: Path, vocab: int, batch: int, pass_id: str) -> list[dict]:
    src = PassDirectorySource(logs, schema(vocab), batch_size=batch, follow=False)
    return {p.id: list(p.batches) for p in src.passes()}[pass_id]


def online(plan, logs, root, vocab, batch, **kw):
    src = PassDirectorySource(logs, schema(vocab), batch_size=batch, follow=False)
    return train(plan, src, checkpoint=root, trainers={"cpu": 1}, mode="sync", progress=False, **kw)


def held(plan, ck: Path) -> dict[str, set[int]]:
    shard = load_tables(plan, ck)
    return {n: set(shard.tables[n].ids().tolist()) for n in SPARSE}


@pytest.mark.slow
@pytest.mark.parametrize("delta_every", [None, 3])
def test_rows_unseen_for_ttl_passes_are_removed_at_the_pass_end_before_its_save(tmp_path, delta_every):
    """ttl_passes 2. Pass 0 looks up 8 ids (A), passes 1 and 2 four others (B), passes 3 and 4 one
    more (C). By hand: A's rows go at the end of pass 2 (unseen in passes 1 and 2), B's at the end
    of pass 4; removed per pass and table [0, 0, 8, 0, 4]; pass 2's checkpoint holds B only, pass
    4's C only. With delta checkpoints (full at passes 0 and 3) the deltas hold the rows the pass
    looked up, not every row its pass end changed. The published model (a full ONNX, then deltas)
    scores pass 0's records (rows removed since) and pass 4's as `predict` on the last checkpoint."""
    logs = tmp_path / "logs"
    a, b, c = [f"u{k}" for k in range(8)], ["u15", "u18", "u19", "u21"], ["u24"]
    for h, users in enumerate((a, b, b, c, c)):
        write_users(logs, h, users)
    ids = ids_of(logs, 64, 32)
    sets = [ids[f"20240101/{h:02d}"] for h in range(5)]
    assert [len(s) for s in sets] == [8, 4, 4, 1, 1] and not (sets[0] & sets[1]) and not (sets[1] & sets[3])
    plan = make_plan(64, lifecycle={"ttl_passes": 2}, checkpoint_delta_every=delta_every)
    cfg = OnlineConfig(publish=tmp_path / "pub", full_every=10, on_regression="ignore")
    hist = online(plan, logs, tmp_path / "ck", 64, 32, keep=5, online=cfg)
    assert [r["removed_rows"] for r in hist.passes] == [dict.fromkeys(SPARSE, n) for n in (0, 0, 8, 0, 4)]
    cks = [tmp_path / "ck" / f"step-{s:08d}" for s in range(1, 6)]
    assert held(plan, cks[1]) == dict.fromkeys(SPARSE, sets[0] | sets[1])
    assert held(plan, cks[2]) == dict.fromkeys(SPARSE, sets[1])
    assert held(plan, cks[4]) == dict.fromkeys(SPARSE, sets[3])
    served = ServedModel.load(tmp_path / "pub")
    assert [r["action"] for r in hist.passes] == ["published"] * 5
    for pid in ("20240101/00", "20240101/04"):
        data = batches(logs, 64, 32, pid)
        got = np.concatenate([served.predict(b) for b in data])
        np.testing.assert_allclose(got, predict(plan, data, checkpoint=cks[4]), atol=1e-5)
    if delta_every:
        for i in (1, 2, 4):  # the delta each pass added: the ids it looked up
            doc = read_manifest(cks[i])
            for n in SPARSE:
                (e,) = [e for e in doc["files"] if e["table"] == n and e.get("delta") == i % 3]
                with np.load(cks[i] / e["file"]) as z:
                    assert set(z["ids"].tolist()) == sets[i] and z["Shrinks"].tolist() == [1]


def tables(plan, ck: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every table's saved state in checkpoint `ck` (a sparse table's rows in id order)."""
    shard, out = load_tables(plan, ck), {}
    for n, t in shard.tables.items():
        d = t.state_dict()
        order = np.argsort(d["ids"]) if "ids" in d else None
        out[n] = {
            k: a[order] if order is not None and a.shape[:1] == order.shape else a for k, a in d.items()
        }
    return out


@pytest.mark.slow
def test_per_pass_checkpoints_as_a_delta_chain_restore_the_tables_of_full_saves(tmp_path):
    """checkpoint_delta_every 3: pass 0 touches ~1500 rows, passes 1-4 twenty; the delta run stops
    after 2 passes and resumes. Each pass's checkpoint: full at passes 0 and 3, deltas 1, 2, 1
    between (the chain goes on across the resume), the same tables as the full-save run's, and
    a delta's new files under a tenth of the full checkpoint's sparse files."""
    logs = tmp_path / "logs"
    write_users(logs, 0, [f"u{k}" for k in range(2000)], 2048)
    for h in range(1, 5):
        write_users(logs, h, [f"u{k}" for k in range(20)], 64)
    full = online(make_plan(4096), logs, tmp_path / "full", 4096, 256, keep=5)
    plan = make_plan(4096, checkpoint_delta_every=3)
    first = online(plan, logs, tmp_path / "delta", 4096, 256, keep=5, online=OnlineConfig(max_passes=2))
    rest = online(plan, logs, tmp_path / "delta", 4096, 256, keep=5, resume=tmp_path / "delta")
    assert len(first.passes) == 2 and len(rest.passes) == 3
    steps = [r["step"] for r in full.passes]
    assert steps == [r["step"] for r in (*first.passes, *rest.passes)]
    for i, step in enumerate(steps):
        a, b = (tmp_path / d / f"step-{step:08d}" for d in ("full", "delta"))
        files = read_manifest(b)["files"]
        for n in SPARSE:
            assert sorted(e.get("delta", 0) for e in files if e["table"] == n) == list(range(i % 3 + 1))
        got, want = tables(plan, b), tables(plan, a)
        assert sorted(got) == sorted(want)
        for n in want:
            for k in want[n]:
                np.testing.assert_array_equal(got[n][k], want[n][k], err_msg=f"pass {i}: {n}.{k}")
        if i % 3:
            new = sum(e["bytes"] for e in files if e.get("delta") == i % 3)
            whole = sum(e["bytes"] for e in read_manifest(a)["files"] if e["table"] in SPARSE)
            assert new < whole / 10, (i, new, whole)


@pytest.mark.slow
def test_on_stall_wait_waits_for_a_late_done_flag_then_trains_the_pass(tmp_path):
    """Pass 1's flag appears ~1.5 s after pass 0 was trained, past the source's 0.3 s timeout:
    the stall is reported (metrics "stall" records) and waited through, then pass 1 is trained."""
    import threading

    from runtime.telemetry.outputs import read_metrics

    logs = tmp_path / "logs"
    write_users(logs, 0, ["u1", "u2"])
    write_users(logs, 1, ["u3"], 48)
    (logs / "20240101/01/_SUCCESS").unlink()
    timers = []

    def flag_later(rec):
        if not timers:
            timers.append(threading.Timer(1.5, (logs / "20240101/01/_SUCCESS").write_text, ("",)))
            timers[0].start()

    src = PassDirectorySource(logs, schema(64), batch_size=32, follow=True, poll=0.05, timeout=0.3)
    cfg = OnlineConfig(on_stall="wait", max_passes=2)
    hist = train(make_plan(64), src, checkpoint=tmp_path / "ck", trainers={"cpu": 1}, progress=False,
                 online=cfg, metrics=tmp_path / "m.jsonl", callback=flag_later)  # fmt: skip
    timers[0].join()
    assert [(p["pass"], p["examples"]) for p in hist.passes] == [("20240101/00", 32), ("20240101/01", 48)]
    recs = read_metrics(tmp_path / "m.jsonl")
    stalls = [r for r in recs if r["kind"] == "stall"]
    assert stalls and all("20240101/01 has had no done flag" in r["error"] for r in stalls)
    assert all(r["after_pass"] == "20240101/00" for r in stalls)
    assert hist.state.examples == 80 and hist.state.step == 3


@pytest.mark.slow
def test_a_shard_killed_mid_pass_restarts_the_pass_on_the_same_engine_and_ends_as_the_unbroken_run(
    tmp_path,
):
    """One LocalEngine instance for every pass; max_restarts=1; ps:0 is SIGKILLed at the second
    step of pass 1: that pass restarts from pass 0's checkpoint, and the last checkpoint holds the
    tables the run without a kill holds (sync mode: exactly)."""
    import os
    import signal

    from runtime.engines import LocalEngine

    logs = tmp_path / "logs"
    for h in range(3):
        write_users(logs, h, [f"u{k}" for k in range(3 * h, 3 * h + 6)], 96)
    plan = make_plan(64)
    ref = online(plan, logs, tmp_path / "ref", 64, 32, engine=LocalEngine(), servers=2)
    eng, killed = LocalEngine(), []

    def kill(rec):
        if rec["step"] == 4 and not killed:
            killed.append(eng.pids()["ps:0"])
            os.kill(killed[0], signal.SIGKILL)

    hist = online(plan, logs, tmp_path / "ck", 64, 32, engine=eng, servers=2, max_restarts=1, callback=kill)
    assert killed and [p["restarts"] for p in hist.passes] == [0, 1, 0]
    assert [p["step"] for p in hist.passes] == [p["step"] for p in ref.passes] == [3, 6, 9]
    got, want = (
        tables(plan, tmp_path / "ck" / "step-00000009"),
        tables(plan, tmp_path / "ref" / "step-00000009"),
    )
    for n in want:
        for k in want[n]:
            np.testing.assert_array_equal(got[n][k], want[n][k], err_msg=f"{n}.{k}")
