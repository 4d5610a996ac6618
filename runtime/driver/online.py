"""Online training: `train(plan, stream_source, online=OnlineConfig(...))` runs pass after pass.

For each pass the source yields (runtime/data/streams: pass directories, NATS JetStream):

1. read the pass in the driver, as global batches of the source's `batch_size` (one pass in
   memory at a time, read only when training is ready for it: the back-pressure on the stream;
   each reader trainer takes its share of every global batch, so readers stay step-aligned);
2. **test-then-train**: evaluate the model so far on the pass before training on it (the pass's
   online loss and AUC, `runtime.evaluate` on the last checkpoint);
3. train it (`runtime.train` resumed from the last checkpoint, one epoch of the pass, its
   `FailureConfig` restarts included), which ends the pass (`RunConfig.ends_pass`: the sparse
   tables' feature lifecycle, `PSClient.shrink`) and saves the checkpoint `step-N` in the
   checkpoint directory (full, or a delta with the plan's `checkpoint_delta_every`);
4. the **guard**: the online AUC / loss against the trailing accepted passes, and a NaN / Inf
   check of the rows that changed since the last publish (`OnlineConfig` says what happens on a
   regression: hold, rollback, ignore);
5. **publish** (runtime/driver/publish.py): a full ONNX model every `full_every` publishes, else a
   delta of the changed rows, atomically;
6. **commit**: `online.json` in the checkpoint directory names the checkpoint and the stream
   position after the pass (written atomically: the commit point). A run killed at any moment
   resumes (`resume=DIR`) from the last commit: the pass in flight is trained again from the
   checkpoint before it, so every example is in the model exactly once.

Each pass writes a "pass" record to the metrics JSONL file (and TensorBoard scalars): examples,
steps, online loss / AUC, training loss, the publish (kind, version, rows, bytes, seconds), the
guard's verdict, and freshness: seconds from the pass's newest event time (a pass directory's
time is its folder's, read as UTC; a pass read before its window ended counts from the read) and
from the moment the pass was read whole, to trained and to published. A pass whose event time is
before the previous pass's (a record far out of order on a broker) is trained and counted as `late`.
The step records of the passes go to the same file.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ops_registry.errors import ConfigError, HetpsError
from runtime.data.streams.base import Pass, StreamPosition, StreamSource, StreamStalled
from runtime.driver.checkpoints import check_root, checkpoints, step_dir
from runtime.driver.publish import Publisher
from runtime.driver.settings import CheckpointConfig, OnlineConfig, Settings, TelemetryConfig
from runtime.telemetry.outputs import Telemetry
from transpiler.plan import Plan

STATE = "online.json"


class BadPass(HetpsError):
    """A pass could not be read (a malformed file); nothing of it was trained or committed."""


@dataclass
class OnlineState:
    """What `online.json` holds: the committed checkpoint (a directory name in the checkpoint
    root, None before the first pass) and step, the stream position after the last committed pass,
    counts, and the online metrics of the trailing accepted passes (for the guard)."""

    checkpoint: str | None = None
    step: int = 0
    position: dict | None = None
    passes: int = 0
    examples: int = 0
    last_pass: str = ""
    last_start: float | None = None
    trailing: list[dict] = field(default_factory=list)

    def save(self, root: Path) -> None:
        tmp = root / f".{STATE}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(root / STATE)

    @classmethod
    def load(cls, root: Path) -> OnlineState:
        try:
            return cls(**json.loads((root / STATE).read_text()))
        except (ValueError, TypeError) as e:
            raise HetpsError(f"{root / STATE} is not an online training state: {e}") from None


@dataclass
class OnlineHistory:
    """What an online run did: one record per pass (the metrics file's "pass" records), the
    checkpoint directory and the last committed state."""

    passes: list[dict] = field(default_factory=list)
    root: Path | None = None
    state: OnlineState | None = None

    @property
    def examples(self) -> int:
        return sum(p["examples"] for p in self.passes)

    @property
    def published(self) -> list[dict]:
        return [p["published"] for p in self.passes if p["published"]]


class _Resumed:
    """One epoch of a pass's batches for `train` resumed at step `skip`: `train` counts steps over
    the whole run and skips the first `skip` batches of its data, so they are the first batch
    repeated (pickled once)."""

    def __init__(self, batches: list[dict], skip: int) -> None:
        self.batches, self.skip = batches, skip

    def __iter__(self):
        return iter([self.batches[0]] * self.skip + self.batches)

    def __len__(self) -> int:
        return self.skip + len(self.batches)


def train_online(
    plan: Plan,
    source: StreamSource,
    settings: Settings,
    online: OnlineConfig | None,
    train_pass: Callable[..., Any],
) -> OnlineHistory:
    """The pass loop (see the module docstring); `train` calls it for a `StreamSource`, with itself
    (its engine arguments bound) as `train_pass`, which trains each pass."""
    online = online or OnlineConfig()
    _check(source, settings)
    root = check_root(settings.checkpoint.dir)
    state = _start_state(root, settings.checkpoint.resume)
    if state.position is not None:
        source.seek(StreamPosition.from_json(json.dumps(state.position)))
    t = settings.telemetry
    tel = Telemetry(
        t.metrics,
        None,
        False,
        meta={
            "online": True,
            "batch_size": source.batch_size,
            "stream": source.kind,
            "resumed": state.passes,
        },
        tensorboard=t.tensorboard,
    )
    loop = _Loop(plan, source, settings, online, root, state, tel, train_pass)
    error = None
    try:
        loop.run()
    except BaseException as e:
        error = e
        raise
    finally:
        tel.close({"passes": state.passes, "examples": state.examples, "step": state.step}, error)
    return OnlineHistory(loop.records, root, state)


def _check(source: StreamSource, settings: Settings) -> None:
    if source.shard != (0, 1):
        raise ConfigError(
            f"the online loop reads the stream once, in the driver, and gives each reader trainer its "
            f"share of every global batch: make the source with shard=(0, 1), not {source.shard}"
        )
    run = settings.run
    given = [n for n in ("steps", "epochs", "until_loss", "batch_size") if getattr(run, n) is not None]
    if given:
        raise ConfigError(
            f"train on a stream runs pass after pass until the stream ends (or OnlineConfig.max_passes): "
            f"{given} do not apply (the source's batch_size is the global batch size)"
        )
    if settings.eval.data is not None:
        raise ConfigError("train on a stream evaluates each pass before training it: drop eval_data=")
    if settings.checkpoint.dir is None:
        raise ConfigError(
            "train on a stream needs checkpoint=DIR: each pass is checkpointed there with the stream "
            "position, so a stopped run resumes (resume=DIR) without training an example twice"
        )


def _start_state(root: Path, resume: Any) -> OnlineState:
    """The committed state to continue from; step directories past it (a pass trained but not
    committed before a crash) are removed, as they will be trained again."""
    has = (root / STATE).exists()
    if resume is None:
        if has or checkpoints(root):
            raise ConfigError(
                f"{root} already holds an online run ({STATE} or step checkpoints): continue it with "
                "resume=DIR, or give a new directory"
            )
        return OnlineState()
    if Path(resume).absolute() != root:
        raise ConfigError(f"an online run resumes from its own checkpoint directory: resume={root}")
    state = OnlineState.load(root) if has else OnlineState()
    for path in checkpoints(root):
        if path.name != state.checkpoint and int(path.name.split("-")[1]) >= state.step:
            shutil.rmtree(path, ignore_errors=True)
    return state


class _Loop:
    def __init__(
        self,
        plan: Plan,
        source: StreamSource,
        settings: Settings,
        online: OnlineConfig,
        root: Path,
        state: OnlineState,
        tel: Telemetry,
        train_pass: Callable[..., Any],
    ) -> None:
        self.plan, self.source, self.settings, self.online = plan, source, settings, online
        self.root, self.state, self.tel, self.train_pass = root, state, tel, train_pass
        self.publisher = (
            Publisher(plan, online.publish, online.full_every, online.rows) if online.publish else None
        )
        self.origin = source.position()  # where the committed position is before the first commit
        self.records: list[dict] = []
        self.t0 = time.perf_counter()
        self.verbose = settings.telemetry.progress is not False
        self.user_callback: Callable | None = settings.telemetry.callback

    def run(self) -> None:
        """Pass after pass until the source ends or `max_passes`; a stall is reported, then raised
        or waited through (`on_stall`), the source sought back to the committed position."""
        while True:
            try:
                for p in self.source.passes():
                    self.one_pass(p)
                    if self.online.max_passes is not None and len(self.records) >= self.online.max_passes:
                        return
                return
            except StreamStalled as e:
                self.tel.log and self.tel.log.write("stall", error=str(e), after_pass=self.state.last_pass)
                self._say(f"stream stalled after pass {self.state.last_pass or '(none)'}: {e}")
                if self.online.on_stall == "raise":
                    raise
                self.source.seek(self._committed())

    def _committed(self) -> StreamPosition:
        p = self.state.position
        return self.origin if p is None else StreamPosition.from_json(json.dumps(p))

    def one_pass(self, p: Pass) -> None:
        from runtime.evaluation.evaluate import evaluate

        batches, ready_at = self._read(p), time.time()
        malformed = getattr(self.source, "malformed", 0)
        if not batches:
            self._commit(p, self.state.checkpoint, self.state.step, 0, None)
            return
        start_ck = self._checkpoint_path()
        t0 = time.perf_counter()
        before = evaluate(self.plan, batches, checkpoint=start_ck)
        eval_s = time.perf_counter() - t0
        hist = self._train(batches, start_ck)
        step = self.state.step + len(batches)
        ck, trained_at = step_dir(self.root, step), time.time()
        update = self.publisher.prepare(ck) if self.publisher is not None else None
        verdict = self._judge(before, update)
        published, action = None, "published" if self.publisher is not None else "trained"
        if verdict is not None and (
            self.online.on_regression != "ignore" or verdict.startswith("non-finite")
        ):
            action = "rolled back" if self.online.on_regression == "rollback" else "held"
        if action == "published":
            published = self.publisher.publish(update, p.id)
        published_at = time.time()
        examples = sum(len(b[next(iter(b))]) for b in batches)
        if action == "rolled back":
            shutil.rmtree(ck, ignore_errors=True)
            self._commit(p, self.state.checkpoint, self.state.step, 0, None)
        else:
            accepted = {"auc": before["auc"], "loss": before["loss"]} if verdict is None else None
            self._commit(p, ck.name, step, examples, accepted)
        end = min(_unix(p.end), ready_at)  # the newest event time a pass read now can hold
        rec = {
            "pass": p.id,
            "start": p.start.isoformat(),
            "end": p.end.isoformat(),
            "examples": examples,
            "steps": len(batches),
            "step": step if action != "rolled back" else self.state.step,
            "online_loss": before["loss"],
            "online_auc": before["auc"],
            "train_loss": float(np.mean(hist.loss)),
            "eval_s": eval_s,
            "train_s": hist.wall_s + hist.startup_s,
            "action": action,
            "verdict": verdict,
            "published": published,
            "changed_rows": None if update is None else sum(update.changed.values()),
            "removed_rows": hist.removed_rows,
            "restarts": len(hist.restarts),
            "late": self._late,
            "malformed": malformed,
            "lag_event_trained_s": trained_at - end,
            "lag_event_published_s": published_at - end if published else None,
            "lag_ready_trained_s": trained_at - ready_at,
            "lag_ready_published_s": published_at - ready_at if published else None,
        }
        self._report(rec)

    def _read(self, p: Pass) -> list[dict]:
        """The pass's global batches; a pass that cannot be read raises `BadPass` (nothing of it
        trained, the committed position unchanged)."""
        try:
            batches = list(p.batches)
        except StreamStalled:
            raise
        except Exception as e:
            raise BadPass(
                f"pass {p.id} cannot be read: {type(e).__name__}: {e}. Nothing of it was trained; the "
                f"committed position is after pass {self.state.last_pass or '(none)'}: fix or move the "
                "bad file, then run again with resume=DIR"
            ) from e
        start = _unix(p.start)
        self._late = self.state.last_start is not None and start < self.state.last_start
        return batches

    def _checkpoint_path(self) -> Path | None:
        return None if self.state.checkpoint is None else self.root / self.state.checkpoint

    def _train(self, batches: list[dict], start_ck: Path | None):
        base = time.perf_counter() - self.t0

        def on_step(record: dict) -> None:
            record = {**record, "time": record["time"] + base}
            self.tel.step(record)
            if self.user_callback is not None:
                self.user_callback(record)

        s = self.settings
        return self.train_pass(
            self.plan,
            _Resumed(batches, self.state.step),
            scale=s.scale,
            run=replace(s.run, epochs=1, ends_pass=True),
            checkpoint=CheckpointConfig(self.root, keep=max(s.checkpoint.keep, 2), resume=start_ck),
            telemetry=TelemetryConfig(progress=False, callback=on_step),
            failure=s.failure,  # (a lost process restarts the pass from the checkpoint before it)
        )

    def _judge(self, before: dict, update: Any) -> str | None:
        """Why this pass must not be published (None: it may)."""
        if update is not None and update.not_finite:
            return f"non-finite values (NaN / Inf) in the changed rows of {update.not_finite}"
        if not math.isfinite(before["loss"]):
            return f"the online loss is {before['loss']}"
        trail = self.state.trailing[-self.online.trailing :]
        if not trail:
            return None
        aucs = [r["auc"] for r in trail if r["auc"] is not None and math.isfinite(r["auc"])]
        mean_auc = float(np.mean(aucs)) if aucs else math.nan
        if math.isfinite(before["auc"]) and aucs and mean_auc - before["auc"] > self.online.auc_drop:
            return (
                f"online AUC {before['auc']:.4f} is {mean_auc - before['auc']:.4f} below the mean "
                f"{mean_auc:.4f} of the last {len(aucs)} passes (auc_drop={self.online.auc_drop})"
            )
        mean_loss = float(np.mean([r["loss"] for r in trail]))
        if before["loss"] > mean_loss * (1 + self.online.loss_rise):
            return (
                f"online loss {before['loss']:.4f} is above {1 + self.online.loss_rise:g} x the mean "
                f"{mean_loss:.4f} of the last {len(trail)} passes (loss_rise={self.online.loss_rise})"
            )
        return None

    def _commit(
        self, p: Pass, checkpoint: str | None, step: int, examples: int, accepted: dict | None
    ) -> None:
        st = self.state
        st.checkpoint, st.step, st.position = checkpoint, step, json.loads(self.source.position().to_json())
        st.passes += 1
        st.examples += examples
        st.last_pass, st.last_start = p.id, max(_unix(p.start), st.last_start or -math.inf)
        if accepted is not None:
            st.trailing = [*st.trailing, accepted][-max(self.online.trailing, 1) :]
        st.save(self.root)

    def _report(self, rec: dict) -> None:
        self.records.append(rec)
        if self.tel.log:
            self.tel.log.write("pass", **rec)
        if self.tel.tb:
            w, step = self.tel.tb.writer, rec["step"]
            for key in ("online_loss", "online_auc", "lag_event_trained_s", "lag_ready_published_s"):
                if rec[key] is not None and math.isfinite(rec[key]):
                    w.add_scalar(f"pass/{key}", rec[key], step)
        pub = rec["published"]
        what = f"published v{pub['version']} {pub['kind']} ({pub['bytes']} B)" if pub else rec["action"]
        removed = sum(rec["removed_rows"].values())
        what += f"; its pass end removed {removed} rows" if removed else ""
        self._say(
            f"pass {rec['pass']}: {rec['examples']} examples, online AUC {rec['online_auc']:.4f} loss "
            f"{rec['online_loss']:.4f}; trained {rec['lag_ready_trained_s']:.1f} s after it was read "
            f"({rec['lag_event_trained_s']:.0f} s after its events); {what}"
            + (f" -- {rec['verdict']}" if rec["verdict"] else "")
        )

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"[hetps online] {text}", flush=True)


def _unix(t: datetime) -> float:
    """A pass's event time as unix seconds (a naive time, such as a folder's, read as UTC)."""
    return (t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)).timestamp()
