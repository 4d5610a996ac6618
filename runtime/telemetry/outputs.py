"""What a run tells its user while and after it trains: metrics lines, a progress bar, a timeline.

- `MetricsLog` appends one JSON object per line (JSONL): a `start` record (the run's settings), one
  `step` record per logged step (loss, AUC, examples/s) and an `end` record. Appending (never
  rewriting) means a crashed run still leaves every step it finished; `read_metrics` reads it back
  and `runtime.telemetry.plot.plot_metrics` draws it.
- `Progress` is a tqdm bar with loss, AUC and examples/s, shown on long runs.
- `TensorBoardLog` writes the same per-step scalars (`loss`, `auc`, `examples_per_s`) as TensorBoard
  event files through tensorboardX (`tensorboard --logdir DIR` shows them), beside the JSONL file.
- `timed(...)` times a block (`with timed(...)`): its seconds go to a statistic, its span to a
  `Recorder`, the one way the runtime times its work.
- `Recorder` collects timed spans inside one trainer or server process (segments, sends, recvs,
  pulls, pushes, each tagged with its micro-batch); processes ship them to the driver, which writes
  one Chrome-trace file (`chrome_trace`, opens in Perfetto / chrome://tracing) with one track per
  trainer and server.

Spans are timed with `time.perf_counter` (the clock the runtime already reads for its statistics)
and stored as wall-clock microseconds, so spans of different processes line up on one timeline
(across machines, as well as their clocks agree).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np

from runtime.transport.process_id import ProcessId

# A recorded span: [name, category, start (wall-clock us), duration (us), args, lane]; lane 0 is the
# thread that made the Recorder, lane 1 any other (e.g. a trainer's background parameter-server calls).
Span = list


class Recorder:
    """Timed spans of one process. A disabled recorder costs one attribute test per call site.
    `span` may be called from several threads (list.append is atomic)."""

    __slots__ = ("on", "spans", "_offset", "_main")

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.spans: list[Span] = []
        self._offset = time.time() - time.perf_counter()
        self._main = threading.get_ident()

    def span(self, name: str, cat: str, t0: float, t1: float, **args: Any) -> None:
        """Record `name` from perf_counter time `t0` to `t1`."""
        if self.on:
            self.spans.append(
                [
                    name,
                    cat,
                    round((t0 + self._offset) * 1e6, 1),
                    round((t1 - t0) * 1e6, 1),
                    args,
                    int(threading.get_ident() != self._main),
                ]
            )

    def take(self) -> list[Span]:
        """The spans recorded so far (the recorder starts afresh)."""
        out, self.spans = self.spans, []
        return out


class timed:  # noqa: N801 (used as a function: `with timed(...)`)
    """Time a block: add its seconds to `stats[key]`, record it as span `name` on `rec` (either
    optional). `with timed(...) as t:` the block may add span arguments known only at its end
    (`if t.recording: t.args["rows"] = n`) or `t.skip()`; a skipped block, or one that raises, is
    neither summed nor recorded (as a failed request is not traced). `t.seconds`: its duration."""

    __slots__ = ("name", "cat", "rec", "stats", "key", "args", "t0", "seconds", "_skip")

    def __init__(
        self,
        name: str = "",
        cat: str = "",
        *,
        rec: Recorder | None = None,
        stats: dict[str, Any] | None = None,
        key: str = "",
        **args: Any,
    ) -> None:
        self.name, self.cat, self.rec, self.stats, self.key, self.args = name, cat, rec, stats, key, args
        self.seconds, self._skip = 0.0, False

    @property
    def recording(self) -> bool:
        return self.rec is not None and self.rec.on

    def skip(self) -> None:
        self._skip = True

    def __enter__(self) -> timed:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        t1 = time.perf_counter()
        self.seconds = t1 - self.t0
        if exc_type is not None or self._skip:
            return
        if self.stats is not None:
            self.stats[self.key] += self.seconds
        if self.rec is not None and self.rec.on:
            self.rec.span(self.name, self.cat, self.t0, t1, **self.args)


def pack_spans(spans: list[Span]) -> np.ndarray:
    """Spans as one uint8 array of JSON, to travel as a message buffer (headers are size-capped)."""
    return np.frombuffer(json.dumps(spans).encode(), dtype=np.uint8)


def unpack_spans(buf: np.ndarray) -> list[Span]:
    return json.loads(np.asarray(buf, dtype=np.uint8).tobytes().decode())


def _track_order(name: str) -> tuple:
    """Servers first, then trainers by type and index ("ps:0" < "cpu:0" < "cpu:1" < "gpu:0")."""
    p = ProcessId.maybe(name)  # (a track not named after a process: among the trainers, by name)
    return (True, name, 0, name) if p is None else (not p.is_server, p.kind, p.index, name)


def chrome_trace(tracks: dict[str, list[Span]], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Chrome-trace JSON object: one process (pid) per track name, spans as complete ('X') events.

    Tracks are named "trainer cpu:0" / "ps shard 0" and sorted servers first; a span's lane is its
    thread (tid) within the track. Timestamps start at 0 (the earliest span). `meta` lands in the
    trace's `otherData`."""
    t0 = min((s[2] for spans in tracks.values() for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for pid, name in enumerate(sorted(tracks, key=_track_order), start=1):
        label = f"ps shard {p.index}" if (p := ProcessId.maybe(name)) and p.is_server else f"trainer {name}"
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        for lane in sorted({s[5] for s in tracks[name]} | {0}):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": lane,
                    "args": {"name": name if lane == 0 else f"{name} background"},
                }
            )
        for span_name, cat, ts, dur, args, lane in tracks[name]:
            events.append(
                {
                    "name": span_name,
                    "cat": cat,
                    "ph": "X",
                    "pid": pid,
                    "tid": lane,
                    "ts": round(ts - t0, 1),
                    "dur": dur,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}


def write_trace(path: str | Path, tracks: dict[str, list[Span]], meta: dict[str, Any] | None = None) -> Path:
    """Write `chrome_trace(tracks, meta)` to `path` (open it in https://ui.perfetto.dev)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(tracks, meta)))
    return path


def _clean(v: Any) -> Any:
    """JSON has no NaN / inf: they become null (e.g. the AUC of a window with one class only), in
    nested records too (an evaluation's "slices")."""
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsLog:
    """Appends metrics records to a JSONL file, one JSON object per line, flushed per line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        if self._f is None:
            raise ValueError(f"metrics log {self.path} is closed")
        rec = {"kind": kind, "time": round(time.time(), 3), **{k: _clean(v) for k, v in fields.items()}}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file; a line that is not a JSON object raises ValueError
    naming the file and line (a run killed mid-write leaves at most a truncated last line, which
    is skipped)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                break
            raise ValueError(f"{path}:{i} is not JSON ({e}); is this a hetps metrics file?") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{i} is not a JSON object; is this a hetps metrics file?")
        out.append(rec)
    return out


def step_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "step"]


def eval_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "eval"]


class Progress:
    """A tqdm progress bar over steps showing loss, AUC and examples/s; `total` None = unknown.
    The bar appears with the first step, so its clock leaves out the processes' start-up."""

    def __init__(self, total: int | None, desc: str = "train", enabled: bool = True) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.bar = None
        self.held_out: dict[str, str] = {}

    def update(
        self,
        n: int = 1,
        loss: float | None = None,
        auc: float | None = None,
        examples_per_s: float | None = None,
    ) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.desc, unit="step", dynamic_ncols=True, leave=True)
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if auc is not None and math.isfinite(auc):
            post["auc"] = f"{auc:.4f}"
        if examples_per_s is not None:
            post["ex/s"] = f"{examples_per_s:,.0f}"
        if self.held_out:
            post.update(self.held_out)
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(n)

    def eval(self, loss: float, auc: float) -> None:
        """Show the latest held-out loss (and AUC) beside the training figures."""
        self.held_out = {"val_loss": f"{loss:.4f}"}
        if math.isfinite(auc):
            self.held_out["val_auc"] = f"{auc:.4f}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.enabled = None, False


class TensorBoardLog:
    """Per-step scalars as TensorBoard event files in `logdir` (one new file per run, as TensorBoard
    expects): `loss`, `auc` (left out while it is undefined: a window with one class only) and
    `examples_per_s`, each at its step number. The run's settings go in as the text `run`."""

    def __init__(self, logdir: str | Path, meta: dict[str, Any] | None = None) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = Path(logdir)
        self.writer = SummaryWriter(logdir=str(self.logdir))
        if meta:
            self.writer.add_text("run", json.dumps(meta, default=str), 0)

    def step(self, step: int, loss: float, auc: float | None, examples_per_s: float | None) -> None:
        self.writer.add_scalar("loss", loss, step)
        if auc is not None and math.isfinite(auc):
            self.writer.add_scalar("auc", auc, step)
        if examples_per_s is not None:
            self.writer.add_scalar("examples_per_s", examples_per_s, step)

    def tasks(self, step: int, task_auc: dict[str, float], prefix: str = "auc") -> None:
        """A multi-task run's per-task AUCs, as `auc/<task>` (`eval_auc/<task>`)."""
        for task, auc in task_auc.items():
            if math.isfinite(auc):
                self.writer.add_scalar(f"{prefix}/{task}", auc, step)

    def eval(self, step: int, loss: float, auc: float, **more: float) -> None:
        """Held-out figures: eval_loss, eval_auc, and eval_<name> of `more` (logloss, calibration,
        gauc ...), each when finite."""
        self.writer.add_scalar("eval_loss", loss, step)
        for name, v in {"auc": auc, **more}.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(f"eval_{name}", v, step)

    def table_counts(self, step: int, shards: dict[str, list[dict[str, int]]]) -> None:
        """Per sparse table and shard k its counts (rows, admitted, evicted, spilled), as
        `tables/<table>/<count>/shard_<k>` at `step`."""
        for table, per_shard in shards.items():
            for k, counts in enumerate(per_shard):
                for count, v in counts.items():
                    self.writer.add_scalar(f"tables/{table}/{count}/shard_{k}", v, step)

    def close(self) -> None:
        self.writer.close()


class Telemetry:
    """The driver's side of one run: the metrics file, TensorBoard events, the progress bar and the
    trace, each optional.

    `step(record)` takes the driver's per-step record {"step", "loss", "auc", "examples", "time"}
    (time: seconds since training started); examples/s is taken over the last `window` steps,
    as steps of a pipelined run complete in bursts. `progress=None` shows the bar when stderr is a
    terminal."""

    def __init__(
        self,
        metrics: str | Path | None = None,
        trace: str | Path | None = None,
        progress: bool | None = None,
        total: int | None = None,
        meta: dict[str, Any] | None = None,
        window: int = 10,
        tensorboard: str | Path | None = None,
    ) -> None:
        self.meta = dict(meta or {})
        self.log = MetricsLog(metrics) if metrics else None
        self.tb = TensorBoardLog(tensorboard, self.meta) if tensorboard else None
        self.trace_path = Path(trace) if trace else None
        self.tracks: dict[str, list[Span]] = {}
        self.bar = Progress(total, enabled=sys.stderr.isatty() if progress is None else progress)
        self.recent: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self.recent.append((0.0, 0))
        self.total_examples = 0
        if self.log:
            self.log.write("start", **self.meta)

    @property
    def tracing(self) -> bool:
        return self.trace_path is not None

    def chain(self, callback: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None]:
        """A step callback that records the step, then calls `callback` (when given)."""

        def on_step(record: dict[str, Any]) -> None:
            self.step(record)
            if callback is not None:
                callback(record)

        return on_step

    def step(self, record: dict[str, Any]) -> None:
        self.total_examples += record["examples"]
        self.recent.append((record["time"], self.total_examples))
        (t0, n0), (t1, n1) = self.recent[0], self.recent[-1]
        rate = (n1 - n0) / (t1 - t0) if t1 > t0 else None
        if self.log:
            self.log.write(
                "step",
                step=record["step"],
                loss=record["loss"],
                auc=record.get("auc"),
                examples=self.total_examples,
                examples_per_s=rate,
                elapsed_s=record["time"],
                **{f"auc_{t}": a for t, a in record.get("task_auc", {}).items()},
            )
        if self.tb:
            self.tb.step(record["step"], record["loss"], record.get("auc"), rate)
            self.tb.tasks(record["step"], record.get("task_auc", {}))
        self.bar.update(1, record["loss"], record.get("auc"), rate)

    def eval(self, record: dict[str, Any]) -> None:
        """A held-out evaluation {"step", "loss", "auc", "examples"} (train(eval_data=...)): an
        "eval" record in the metrics file, `eval_loss` / `eval_auc` (`eval_gauc`, and per slice
        `eval_auc/slice_<value>`, when evaluated) in TensorBoard, the bar's val_loss / val_auc."""
        if self.log:
            self.log.write("eval", **record)
        if self.tb:
            more = {k: v for k, v in record.items() if k in ("logloss", "calibration", "gauc")}
            self.tb.eval(record["step"], record["loss"], record["auc"], **more)
            self.tb.tasks(record["step"], record.get("task_auc", {}), "eval_auc")
            slices = {f"slice_{k}": v["auc"] for k, v in record.get("slices", {}).items()}
            self.tb.tasks(record["step"], slices, "eval_auc")
        self.bar.eval(record["loss"], record["auc"])

    def tables(self, step: int, tables: dict[str, dict[str, Any]]) -> None:
        """The sparse tables' per-shard counts (`History.tables[name]["shards"]`: rows, admitted,
        evicted, spilled) after `step` steps: a "tables" record {"step", "shards": {table: [per
        shard]}} in the metrics file, `tables/<table>/<count>/shard_<k>` scalars in TensorBoard."""
        shards = {n: t["shards"] for n, t in tables.items() if "shards" in t}
        if not shards:
            return
        if self.log:
            self.log.write("tables", step=step, shards=shards)
        if self.tb:
            self.tb.table_counts(step, shards)

    def spans(self, who: str, spans: list[Span]) -> None:
        self.tracks.setdefault(who, []).extend(spans)

    def close(self, summary: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        """End the bar, write the `end` record (the run's summary, or its error) and the trace."""
        self.bar.close()
        if self.log:
            end = dict(summary or {})
            if error is not None:
                end["error"] = f"{type(error).__name__}: {error}"
            self.log.write("end", **end)
            self.log.close()
        if self.tb:
            self.tb.close()
        if self.trace_path is not None and self.tracks:
            write_trace(self.trace_path, self.tracks, self.meta)
