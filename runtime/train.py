"""`train`: run a Plan on trainer processes and parameter-server shards, and report a History.

The driver (the calling process) transpiles a Program when given one, checks what can be checked
before any process starts (trainer counts, devices, the data source, end conditions), then starts
the shards (`runtime.ps.serve`) and the trainers (`runtime.trainer.run_trainer`) through an engine
and listens on its inbox: readers announce steps, the trainers that compute the loss report each
micro-batch's loss (and scores and labels, for the AUC), every trainer reports its time use at the
end. A process that fails is reported with its traceback, or the signal that killed it, within a
second; the run is then torn down and `train` raises `TrainingError` naming it. No process outlives
`train`: success, exception and Ctrl-C all end in the engine's `stop`.

End conditions (any that is given, whichever comes first): `steps`; `epochs` of a finite data source;
`until_loss`: stop once the mean loss of the last 10 steps is <= the target (readers may run up to
`LOOKAHEAD` - 1 steps past that step, as the driver grants steps to readers that many ahead).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transpiler.config import kind_of
from transpiler.ir import Program
from transpiler.plan import Plan, transpile

from . import sources
from .channels import Inbox, Outbox
from .device import array_module
from .engines import Engine, make_engine
from .executor import check_feed
from .lifecycle import check_root
from .metrics import auc
from .pauses import Pauses, resume_state, settings_of
from .ps import PSClient, serve
from .telemetry import Telemetry, unpack_spans
from .trainer import run_trainer

LOOKAHEAD = 3
LOSS_WINDOW = 10
STOPPED_S = 1.0  # a process the engine sees stopped this long is named as the run's failure


class TrainingError(RuntimeError):
    """A process of the run failed (the message names it and holds its traceback or signal)."""

    def __init__(self, who: str, detail: str) -> None:
        self.who, self.detail = who, detail
        super().__init__(f"{who} failed: {detail}")


class CheckpointSaveError(TrainingError):
    """Training finished but its final checkpoint could not be saved; `history` is the run's result."""

    def __init__(self, path: str, cause: BaseException, history: History) -> None:
        self.history = history
        super().__init__("the final checkpoint", (
            f"training finished ({history.steps} steps), but saving to {path!r} failed: "
            f"{type(cause).__name__}: {cause}; the previous checkpoint there (if any) is intact, and "
            "the run's History is this error's .history"))


@dataclass
class History:
    """What a run did, one entry per step in the per-step lists.

    `loss`: the loss on the step's global batch (before the step's update); `auc`: the AUC of the
    step's predictions when labels are binary (NaN otherwise); `time`: seconds from the start of
    training (all processes ready) to the step's last micro-batch; `trainers`: per trainer, seconds
    busy computing (`busy_s`), in parameter-server calls (`ps_s`), waiting for messages (`wait_s`),
    sending (`send_s`), its `wall_s` and micro-batches run; `params`: final table values when
    asked for (`return_params=True`); `tables`: per table at the end, rows and bytes held by the
    servers (summed over shards; see runtime/ps/entry.py for admission and eviction);
    `first_step`: the step the run started at (a resumed run: its checkpoint's), so the lists hold
    steps first_step, first_step + 1, ...; `eval`: the held-out evaluations (`eval_data=`), each
    {"step", "loss", "auc", "examples"}.
    """

    loss: list[float] = field(default_factory=list)
    auc: list[float] = field(default_factory=list)
    examples: list[int] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    trainers: dict[str, dict[str, float]] = field(default_factory=dict)
    startup_s: float = 0.0
    wall_s: float = 0.0
    params: dict[str, np.ndarray] | None = None
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    scores: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list, repr=False)
    first_step: int = 0
    eval: list[dict[str, float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.loss)

    def examples_per_s(self, skip: int = 1) -> float:
        """Throughput over the steps after the first `skip` (warm-up) steps."""
        if self.steps <= skip:
            return float("nan")
        start = self.time[skip - 1] if skip > 0 else 0.0
        return sum(self.examples[skip:]) / max(self.time[-1] - start, 1e-9)

    def auc_over(self, last: int) -> float:
        """The AUC of the predictions of the last `last` steps pooled (NaN without binary labels)."""
        got = self.scores[-last:]
        if not got:
            return float("nan")
        return auc(np.concatenate([y for _, y in got]), np.concatenate([s for s, _ in got]))

    def time_use(self) -> str:
        """One line per trainer, as % of its wall time: computing (`busy`), in parameter-server calls
        (`ps`), waiting for messages (`wait`), sending; and `cpu`, the CPU time it got (less than
        busy + ps + send when other processes held the cores)."""
        lines = []
        for name, s in sorted(self.trainers.items()):
            wall = max(s.get("wall_s", 0.0), 1e-9)
            pct = {k: 100 * s.get(k, 0.0) / wall for k in ("busy_s", "ps_s", "wait_s", "send_s", "cpu_s")}
            lines.append(f"{name:>6}: busy {pct['busy_s']:5.1f}%  ps {pct['ps_s']:5.1f}%  "
                         f"wait {pct['wait_s']:5.1f}%  send {pct['send_s']:4.1f}%  cpu {pct['cpu_s']:5.1f}%  "
                         f"({s['items']} micro-batches, {wall:.1f} s)")
        return "\n".join(lines)


@dataclass
class _StepTally:
    """The driver's tally of one step: data readers that reported it, items, examples, loss reports
    received (`got`), summed loss, and the scores and labels for its AUC."""
    readers: int = 0
    items: int = 0
    examples: int = 0
    got: int = 0
    loss: float = 0.0
    scores: list = field(default_factory=list)
    labels: list = field(default_factory=list)


def train(plan_or_program: Plan | Program, data: Any, *, steps: int | None = None, epochs: int | None = None,
          until_loss: float | None = None, batch_size: int | None = None,
          trainers: dict[str, int] | None = None, servers: int | None = None, mode: str | None = None,
          micro_batches: int = 4, engine: str | Engine = "local", device_map: dict[str, str] | None = None,
          allow_emulation: bool = False, return_params: bool = False, checkpoint: str | None = None,
          callback: Callable[[dict[str, Any]], None] | None = None, secret: bytes | None = None,
          stall_timeout: float = 60.0, address: str | None = None, metrics: str | None = None,
          trace: str | None = None, progress: bool | None = None, tensorboard: str | None = None,
          checkpoint_every: int | None = None, keep: int = 2, resume: str | None = None,
          eval_data: Any = None, eval_every: int | None = None) -> History:
    """Train `plan_or_program` (a Program is transpiled with the default config) on `data`.

    - `data`: generated data with `batch(i, n)` (then `batch_size` is the global batch size) or a
      re-iterable of global feed dicts (see `runtime.sources`).
    - `trainers`: processes per trainer type, default {"cpu": 2, "gpu": 1} (1 for other types);
      the type owning the data ops reads data. `servers`, `mode`: default to the plan's config.
    - `micro_batches`: micro-batches per reader and step (and the most a reader has in flight).
    - `device_map` / `allow_emulation`: see `runtime.device.array_module`; a gpu type without CUDA
      is refused before any process starts unless emulation is allowed.
    - `callback(record)` is called in step order with {"step", "loss", "auc", "examples", "time"}.
    - `return_params`: put the final table values in `History.params` (sparse tables need a known
      vocab); `checkpoint`: a directory that gets a checkpoint `step-NNNNNNNN` every
      `checkpoint_every` steps and at the end, the `keep` newest kept (tables with their optimizer
      state, the step, the plan's hash, the settings: runtime/lifecycle.py); it is checked before
      anything starts, and a failed final save raises CheckpointSaveError, which carries the History.
    - `resume`: continue from the newest complete checkpoint in this directory (or this
      checkpoint); `steps` / `epochs` count the whole run, so a step-20 checkpoint resumed with
      steps=40 trains steps 20-39 on the batches an uninterrupted run would (sync mode: the same
      run). A checkpoint of another plan is refused; the shard count may differ.
    - `eval_data` / `eval_every`: the held-out loss and AUC (forward only, the current tables)
      every `eval_every` steps and at the end, in `History.eval`, the metrics file, TensorBoard
      and the progress bar (runtime/pauses.py).
    - `engine`: "local" (processes on this machine), "ray" (Ray actors; `address` = the cluster to
      join, None = start a local Ray) or an Engine instance.
    - `metrics`: append start / per-step / end records to this JSONL file (`hetps plot` draws it);
      `trace`: write a Chrome-trace timeline of every trainer and server there; `progress`: a tqdm
      bar with loss, AUC and examples/s (None: when stderr is a terminal); `tensorboard`: write the
      per-step loss, AUC and examples/s as TensorBoard event files in this directory. See
      runtime.telemetry.
    """
    if isinstance(plan_or_program, Plan):
        plan = plan_or_program
        plan.verify()  # a hand-edited plan (unknown op, dangling tensor, cycle) fails here, not in trainers
    else:
        plan = transpile(plan_or_program)  # verifies what it makes
    cfg = _Config.make(plan, data, steps, epochs, until_loss, batch_size, trainers, servers, mode,
                       micro_batches, device_map, allow_emulation, stall_timeout)
    sources.prepare(data, cfg.counts[cfg.reader], plan.programs[cfg.reader])  # plans and checks shards
    # an unusable checkpoint directory (or resume point) is refused now, not after training; the
    # servers may read and write only inside them
    root = None if checkpoint is None else check_root(checkpoint)
    start_from, start = resume_state(plan, resume, steps)
    pauses = Pauses(plan, data, start, steps, cfg.pushes, settings_of(cfg), root, checkpoint_every, keep,
                    eval_data, eval_every, cfg.stall_timeout)
    roots = [str(p) for p in (root, start_from) if p is not None]
    _check_first_batch(plan, cfg, data)
    eng = make_engine(engine, address)
    secret = secret if secret is not None else eng.secret or os.urandom(32)
    tel = Telemetry(metrics, trace, progress, total=None if steps is None else steps - start, meta={
        "trainers": cfg.counts, "servers": cfg.servers, "mode": cfg.mode, "micro_batches": micro_batches,
        "batch_size": batch_size, "engine": type(eng).__name__, "tables": len(plan.tables)},
        tensorboard=tensorboard)
    history, error = History(first_step=start), None
    try:
        _run(plan, cfg, data, eng, history, secret, tel.chain(callback), return_params, pauses, tel, roots,
             start_from)
    except BaseException as e:
        error = e
        raise
    finally:
        eng.stop()
        tel.close({"steps": history.steps, "wall_s": history.wall_s, "startup_s": history.startup_s,
                   "examples_per_s": history.examples_per_s(), "time_use": history.trainers,
                   "tables": history.tables}, error)
    return history


@dataclass
class _Config:
    counts: dict[str, int]
    reader: str
    mode: str
    servers: int
    micro_batches: int
    steps: int | None
    epochs: int | None
    until_loss: float | None
    batch_size: int | None
    device_map: dict[str, str] | None
    allow_emulation: bool
    stall_timeout: float
    loss_reduction: str
    pushes: dict[str, int]

    @classmethod
    def make(cls, plan: Plan, data, steps, epochs, until_loss, batch_size, trainers, servers, mode,
             micro_batches, device_map, allow_emulation, stall_timeout) -> _Config:
        if steps is None and epochs is None and until_loss is None:
            raise ValueError("train needs an end condition: steps=, epochs= or until_loss=")
        for what, v in (("steps", steps), ("epochs", epochs), ("micro_batches", micro_batches)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        sources.check_source(data, batch_size, epochs)
        if not plan.loss_name:
            raise ValueError("the plan has no loss: train needs a program with a loss (minimize(loss))")
        types = plan.trainer_types
        readers = [t for t, p in plan.programs.items() if p.attrs.get("feeds")]
        if len(readers) != 1:
            raise ValueError(f"exactly one trainer type must own the data ops, found {readers or 'none'}; "
                             "place every data op on one type (e.g. config.op_type_devices={'data': 'cpu'})")
        if trainers is None:
            counts = {t: {"cpu": 2, "gpu": 1}.get(t, 1) for t in types}
        else:
            counts = dict(trainers)
            if set(counts) != set(types):
                raise ValueError(f"trainers={trainers} must give a count for exactly the plan's trainer "
                                 f"types {types}")
            bad = {t: n for t, n in counts.items() if not isinstance(n, int) or n < 1}
            if bad:
                raise ValueError(f"trainer counts must be positive ints, got {bad}")
        for t in types:  # refuses a gpu type without CUDA (unless emulated) before anything starts
            array_module(t, device_map, allow_emulation)
        mode = mode or plan.config.mode
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: the runtime trains in 'sync' or 'async' mode")
        loss_op = next(op for p in plan.programs.values() for op in p.ops
                       if plan.loss_name in op.output_names() and op.role != "comm")
        pushes: dict[str, int] = {}
        for t, p in plan.programs.items():
            for table in {op.attrs["table"] for op in p.ops if op.type in ("push_dense", "push_sparse")}:
                pushes[table] = pushes.get(table, 0) + counts[t]
        return cls(counts, readers[0], mode, servers or plan.config.num_servers, micro_batches, steps,
                   epochs, until_loss, batch_size, device_map, allow_emulation, stall_timeout,
                   "sum" if loss_op.type == "reduce_sum" else "mean", pushes)


def _check_first_batch(plan: Plan, cfg: _Config, data: Any) -> None:
    """Check the data's first global batch against the feeds of the plan, before any process
    starts: a wrong feed is named with the shape the user made (a trainer sees micro-batches).
    Sharded file sources are checked by `sources.prepare` (each reader reads only its share)."""
    if sources.is_sharded(data):
        return
    batches = sources.global_batches(data, cfg.batch_size, cfg.epochs)
    try:
        batch = next(batches, None)
    finally:
        batches.close()
    if batch is None:
        return
    if not isinstance(batch, dict):
        raise TypeError(f"the data's first batch is a {type(batch).__name__}; a batch is a dict "
                        "{feed name: array with a leading example axis}")
    program = plan.programs[cfg.reader]
    feeds = program.attrs.get("feeds", [])
    missing = [n for n in feeds if n not in batch]
    if missing:
        raise ValueError(f"the data's first batch lacks the feeds {missing} the plan reads; it has "
                         f"{sorted(batch)}")
    try:
        sources.batch_size_of({n: batch[n] for n in feeds})
        for n in feeds:
            if n in program.vars:
                check_feed(n, batch[n], program.var(n))
    except (ValueError, TypeError) as e:
        raise type(e)(f"the data's first batch: {e}") from None


def _run(plan: Plan, cfg: _Config, data: Any, eng: Engine, history: History, secret: bytes | None,
         callback, return_params: bool, pauses: Pauses, tel: Telemetry, roots: list[str],
         start_from: Any) -> None:
    t0 = time.perf_counter()  # start-up counts placement too (on Ray: ray.init and the actors)
    names = [f"{t}:{i}" for t, n in cfg.counts.items() for i in range(n)]
    kinds = {t: kind_of(t, cfg.device_map) for t in cfg.counts}
    needs = {**{f"ps:{k}": {} for k in range(cfg.servers)},
             **{n: {"gpu": 1} if kinds[n.split(":")[0]] == "gpu" else {} for n in names}}
    eng.place(needs)
    inbox = Inbox(eng.endpoint("driver"), secret)
    out = Outbox(secret)
    report = inbox.endpoint
    ps_eps = [eng.endpoint(f"ps:{k}") for k in range(cfg.servers)]
    admin = os.urandom(32)  # assign / save / load: only this driver may (the trainers lack this key)
    endpoints = {n: eng.endpoint(n) for n in names}
    listen = _Listen(cfg, eng, inbox, out, names, endpoints, history, callback, tel, pauses, t0)
    try:
        for k, ep in enumerate(ps_eps):
            eng.start(f"ps:{k}", serve, dict(endpoint=ep, specs=plan.tables, shard=k, num_shards=cfg.servers,
                                             mode=cfg.mode, pushes_per_step=cfg.pushes or 1, secret=secret,
                                             trace=tel.tracing, admin_secret=admin,
                                             checkpoint_root=roots or None),
                      report=report, secret=secret)
        pauses.client = PSClient(ps_eps, secret=secret, timeout=cfg.stall_timeout, admin_secret=admin)
        if start_from is not None:
            pauses.client.load(start_from, step=pauses.start)
        elif plan.params:
            _load_values(plan, ps_eps, secret, admin)
        for name in names:
            t, i = name.split(":")
            spec = _trainer_spec(plan, cfg, data, t, int(i), endpoints, ps_eps, report, secret)
            spec["trace"] = tel.tracing
            spec["start"], spec["grant"] = pauses.start, listen.first_grant()
            eng.start(name, run_trainer, {"spec": spec}, report=report, secret=secret, resources=needs[name])
        listen.run()
        with PSClient(ps_eps, secret=secret, timeout=cfg.stall_timeout, admin_secret=admin) as client:
            stats = client.stats()  # per shard; the tables' memory goes to History.tables and metrics
            history.tables = {n: {k: sum(s[n][k] for s in stats if n in s) for k in ("rows", "bytes")}
                              for n in client.specs}
            if tel.tracing:
                for k, spans in enumerate(client.trace()):
                    tel.spans(f"ps:{k}", spans)
            if return_params:
                history.params = _pull_all(client, plan)
            end = pauses.start + history.steps
            if pauses.root is not None:
                try:
                    pauses.save(end)
                except Exception as e:
                    raise CheckpointSaveError(str(pauses.root), e, history) from e
            pauses.finish(end, history, tel)
    finally:
        if pauses.client is not None:
            pauses.client.close()
        out.close()
        inbox.close()


def _trainer_spec(plan: Plan, cfg: _Config, data, t: str, i: int, endpoints: dict, ps_eps: list,
                  report: str, secret) -> dict[str, Any]:
    reader = t == cfg.reader
    return {
        "name": f"{t}:{i}", "type": t, "index": i, "program": plan.programs[t].to_json(),
        "reader": cfg.reader, "counts": cfg.counts, "endpoints": endpoints, "driver": report,
        "ps": ps_eps, "mode": cfg.mode, "micro_batches": cfg.micro_batches, "tables": plan.tables,
        "loss": plan.loss_name, "loss_reduction": cfg.loss_reduction, "secret": secret,
        "device_map": cfg.device_map, "allow_emulation": cfg.allow_emulation,
        "stall_timeout": cfg.stall_timeout, "data": data if reader else None,
        "batch_size": cfg.batch_size, "steps": cfg.steps, "epochs": cfg.epochs,
    }


class _Listen:
    """The driver's loop: collect reports, grant steps (until_loss), watch the processes."""

    def __init__(self, cfg: _Config, eng: Engine, inbox: Inbox, out: Outbox, names: list[str],
                 endpoints: dict, history: History, callback, tel: Telemetry, pauses: Pauses,
                 t0: float) -> None:
        self.cfg, self.eng, self.inbox, self.out = cfg, eng, inbox, out
        self.names, self.endpoints, self.history, self.callback = names, endpoints, history, callback
        self.tel, self.pauses = tel, pauses
        self.readers = [n for n in names if n.split(":")[0] == cfg.reader]
        self.steps: dict[int, _StepTally] = {}
        self.next = pauses.start     # next step to hand to the history
        self.grant, self.final = self.first_grant(), False
        self.ready: set[str] = set()
        self.done: set[str] = set()
        self.stopped: dict[str, float] = {}  # name -> when the engine first saw it stopped
        self.t0, self.t_start = t0, time.perf_counter()

    def run(self) -> None:
        last = checked = time.perf_counter()
        while len(self.done) < len(self.names):
            msg = self.inbox.recv(200)
            now = time.perf_counter()
            if msg is not None:
                last = now
                self._handle(*msg)
            if now - checked >= 0.2:  # however busy the inbox, look at the processes 5 times a second
                checked = now
                self._check_processes()
                if now - last > self.cfg.stall_timeout:
                    raise TrainingError("the run", f"no report from any process for "
                                        f"{self.cfg.stall_timeout} s (finished: {sorted(self.done)})")
        self.history.wall_s = time.perf_counter() - self.t_start

    def _handle(self, h: dict, arrays: list) -> None:
        kind, who, now = h.get("k"), h.get("who", "?"), time.perf_counter()
        if kind == "error":
            raise TrainingError(who, "\n" + h["tb"])
        if kind == "ready":
            self.ready.add(who)
            if len(self.ready) == len(self.names):
                self.t_start = now
                self.history.startup_s = now - self.t0
        elif kind == "step":
            st = self.steps.setdefault(h["s"], _StepTally())
            st.readers, st.items, st.examples = st.readers + 1, st.items + h["items"], st.examples + h["n"]
        elif kind == "losses":
            st = self.steps.setdefault(h["s"], _StepTally())
            st.got += len(h["items"])
            mean = self.cfg.loss_reduction == "mean"
            st.loss += sum(loss * (n if mean else 1) for n, loss in h["items"])
            if len(arrays) == 2:
                st.scores.append(arrays[0])
                st.labels.append(arrays[1])
        elif kind == "done":
            self.done.add(who)
            self.history.trainers[who] = h["stats"]
            if arrays:  # its trace spans
                self.tel.spans(who, unpack_spans(arrays[0]))
        elif kind != "end":
            raise TrainingError(who, f"sent an unknown report {h}")
        self._advance(now)

    def _advance(self, now: float) -> None:
        """Hand completed steps to the history in order; grant more steps (until_loss)."""
        while ((st := self.steps.get(self.next)) is not None and st.readers == len(self.readers)
               and st.got == st.items):
            del self.steps[self.next]
            h = self.history
            loss = st.loss / max(st.examples, 1) if self.cfg.loss_reduction == "mean" else st.loss
            score = label = None
            if st.scores:
                score, label = np.concatenate(st.scores), np.concatenate(st.labels)
            binary = label is not None and bool(np.isin(label, (0.0, 1.0)).all())
            h.loss.append(loss)
            h.auc.append(auc(label, score) if binary else float("nan"))
            h.examples.append(st.examples)
            h.time.append(now - self.t_start)
            if binary:
                h.scores.append((score, label))
                del h.scores[:-100]
            if self.callback is not None:
                self.callback({"step": self.next, "loss": loss, "auc": h.auc[-1], "examples": st.examples,
                               "time": h.time[-1]})
            self.next += 1
            self._grant()

    def first_grant(self) -> int | None:
        """Readers may start steps < this (None: no limit): LOOKAHEAD steps ahead for until_loss,
        and never past the next pause (a checkpoint or evaluation: runtime/pauses.py)."""
        start = self.pauses.start
        limits = [start + LOOKAHEAD] if self.cfg.until_loss is not None else []
        pause = self.pauses.next_pause(start)
        return min([*limits, pause]) if pause is not None else min(limits, default=None)

    def _grant(self) -> None:
        if self.pauses.due(self.next):
            try:
                self.pauses.pause(self.next, self.history, self.tel)
            except Exception as e:
                raise TrainingError(f"the pause at step {self.next} (checkpoint / evaluation)",
                                    f"{type(e).__name__}: {e}") from e
        if self.final or (self.cfg.until_loss is None and self.grant is None):
            return
        if self.cfg.until_loss is not None:
            recent = self.history.loss[-LOSS_WINDOW:]
            if len(recent) == LOSS_WINDOW and np.mean(recent) <= self.cfg.until_loss:
                self.final = True
        if not self.final:
            pause = self.pauses.next_pause(self.next)
            limits = [self.next + LOOKAHEAD] if self.cfg.until_loss is not None else []
            self.grant = min([*limits, pause]) if pause is not None else min(limits, default=None)
            if self.grant is None:  # no more pauses and no until_loss: readers run to the end
                self.grant = 1 << 62
        for r in self.readers:
            self.out.send(self.endpoints[r], {"k": "grant", "upto": self.grant, "final": self.final})

    def _check_processes(self) -> None:
        """Raise TrainingError for a process that ended before it finished its part."""
        for name, failure in self.eng.ended().items():
            if failure is None and name in self.done:
                continue
            deadline = time.perf_counter() + 0.5  # its last reports (or traceback) may be on the way
            while time.perf_counter() < deadline and name not in self.done:
                msg = self.inbox.recv(50)
                if msg is not None:
                    self._handle(*msg)
            if name in self.done and failure is None:
                continue
            raise TrainingError(name, failure.how if failure else "exited before the run finished")
        now, stalled = time.perf_counter(), self.eng.stalled()
        self.stopped = {name: self.stopped.get(name, now) for name in stalled}
        for name, since in self.stopped.items():
            if now - since >= STOPPED_S:
                raise TrainingError(name, f"{stalled[name]} for {now - since:.1f} s; the run cannot "
                                    "go on without it")


def _load_values(plan: Plan, ps_eps: list[str], secret, admin: bytes) -> None:
    """Give the servers the parameter values the plan carries (ONNX / Paddle imports)."""
    with PSClient(ps_eps, secret=secret, admin_secret=admin) as client:
        for name, value in plan.params.items():
            if name in client.specs:
                sparse = client.specs[name]["kind"] == "sparse"
                client.assign(name, value, np.arange(len(value)) if sparse else None)


def _pull_all(client: PSClient, plan: Plan) -> dict[str, np.ndarray]:
    out = {}
    for t in plan.tables:
        if t["kind"] == "dense":
            out[t["name"]] = client.pull(t["name"])
        elif t["shape"][0] > 0:
            out[t["name"]] = client.pull(t["name"], np.arange(t["shape"][0]))
    return out
