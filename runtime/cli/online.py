"""`hetps train PLAN_DIR --stream SRC --schema schema.yaml --checkpoint DIR`: online training
(runtime/driver/online.py) from the shell, with `OnlineConfig`'s knobs as flags.

SRC is a pass-directory root (`logs/`, or a URI pyarrow.fs or fsspec reads: `file:///data/logs`,
`s3://bucket/logs`; with `--layout '{day}/{hour}'` and `--done-flag`) or a NATS JetStream stream
`nats://HOST:PORT/STREAM/SUBJECT`.
"""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlparse

from runtime.cli.common import EXIT_OK, UsageError


def online_options(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("online training (--stream)")
    g.add_argument(
        "--stream",
        metavar="SRC",
        help="train pass after pass on a stream: a pass-directory root (a path, or a URI such as "
        "file:///data/logs or s3://bucket/logs), or nats://HOST:PORT/STREAM/SUBJECT (needs --schema and "
        "--checkpoint)",
    )
    g.add_argument(
        "--layout", default="{day}/{hour}", help="pass folders below the root (default %(default)s)"
    )
    g.add_argument(
        "--done-flag", default="_SUCCESS", help="the file that marks a pass ready (default %(default)s)"
    )
    g.add_argument(
        "--follow", action="store_true", help="wait for new passes / messages (else stop at the end)"
    )
    g.add_argument("--stream-timeout", type=float, help="seconds without a new pass or message: a stall")
    g.add_argument("--on-stall", choices=("raise", "wait"), default="raise")
    g.add_argument("--pass-seconds", type=float, default=3600.0, help="NATS: a pass's event-time window")
    g.add_argument("--publish", metavar="DIR", help="publish a servable model after each pass to DIR")
    g.add_argument(
        "--full-every", type=int, default=4, help="a full ONNX model every K publishes, deltas between"
    )
    g.add_argument("--rows", choices=("all", "existing"), default="all", help="exported rows, as for export")
    g.add_argument("--on-regression", choices=("hold", "rollback", "ignore"), default="hold")
    g.add_argument("--auc-drop", type=float, default=0.05, help="online AUC drop that is a regression")
    g.add_argument("--loss-rise", type=float, default=0.25, help="relative online loss rise that is one")
    g.add_argument("--trailing", type=int, default=3, help="passes the guard compares with")
    g.add_argument("--max-passes", type=int, help="stop after N passes")


def stream_source(args: argparse.Namespace) -> Any:
    """The source --stream names, read by --schema in global batches of --batch-size."""
    from runtime.data.streams import NatsStreamSource, PassDirectorySource

    if not args.schema:
        raise UsageError("--stream reads records by a schema: add --schema schema.yaml")
    spec = args.stream
    try:
        if spec.startswith("nats://"):
            url = urlparse(spec)
            parts = url.path.strip("/").split("/")
            if len(parts) != 2 or not all(parts):
                raise UsageError(f"--stream {spec}: expected nats://HOST:PORT/STREAM/SUBJECT")
            return NatsStreamSource(
                parts[0],
                parts[1],
                args.schema,
                args.batch_size,
                servers=f"nats://{url.netloc}",
                follow=args.follow,
                timeout=args.stream_timeout,
                pass_seconds=args.pass_seconds,
            )
        return PassDirectorySource(
            spec,
            args.schema,
            args.batch_size,
            layout=args.layout,
            done_flag=args.done_flag,
            follow=args.follow,
            timeout=args.stream_timeout,
        )
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--stream {spec}: {e}") from None


def cmd_train_stream(args: argparse.Namespace, plan: Any, run: dict[str, Any]) -> int:
    from runtime import OnlineConfig, train

    if any(getattr(args, n) is not None for n in ("steps", "epochs", "until_loss")):
        raise UsageError("--stream trains until the stream ends (or --max-passes N): drop --steps/--epochs")
    if not args.checkpoint:
        raise UsageError(
            "--stream needs --checkpoint DIR (each pass is committed there; --resume DIR continues)"
        )
    online = OnlineConfig(
        publish=args.publish,
        full_every=args.full_every,
        rows=args.rows,
        on_regression=args.on_regression,
        auc_drop=args.auc_drop,
        loss_rise=args.loss_rise,
        trailing=args.trailing,
        max_passes=args.max_passes,
        on_stall=args.on_stall,
    )
    for n in ("steps", "epochs", "until_loss"):
        run.pop(n, None)
    src = stream_source(args)
    try:
        hist = train(
            plan, src, checkpoint=args.checkpoint, keep=args.keep, resume=args.resume, online=online, **run
        )
    finally:
        close = getattr(src, "close", None)
        if close is not None:
            close()
    published = hist.published
    print(
        f"{len(hist.passes)} passes, {hist.examples} examples trained; "
        f"{len(published)} published"
        + (f" to {args.publish}" if args.publish else "")
        + f"; committed in {args.checkpoint} (continue: --resume {args.checkpoint})"
    )
    return EXIT_OK
