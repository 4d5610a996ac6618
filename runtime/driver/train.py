"""`train`: run a Plan on trainer processes and parameter-server shards, and report a History.

The driver (the calling process) transpiles a Program when given one, checks what can be checked
before any process starts (trainer counts, devices, the data source, end conditions), then starts
the shards (`runtime.ps.serve`) and the trainers (`runtime.trainer.process.run_trainer`) through an engine
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

import functools
import inspect
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.data import sources
from runtime.driver import restart
from runtime.driver.checkpoints import check_root, step_dir
from runtime.driver.history import CheckpointSaveError, History, TrainingError
from runtime.driver.listener import LOOKAHEAD, Listener
from runtime.driver.pauses import Pauses, resume_state
from runtime.driver.settings import (
    FLAT,
    CheckpointConfig,
    EvalConfig,
    FailureConfig,
    OnlineConfig,
    ResolvedRun,
    RunConfig,
    Settings,
    TelemetryConfig,
    TrainerSpec,
    check_first_batch,
)
from runtime.driver.timed import TimedPauses
from runtime.engines import Engine, make_engine
from runtime.ps import PSClient
from runtime.ps.client import PSTimeoutError
from runtime.ps.launch import load_values, pull_all, start_servers
from runtime.telemetry.outputs import Telemetry
from runtime.trainer.process import run_trainer
from runtime.transport import reports
from runtime.transport.channels import DRIVER, Inbox, Links, Outbox
from runtime.transport.process_id import SERVER, ProcessId, process_names
from runtime.transport.wire import client_key, link_key
from transpiler.config import kind_of
from transpiler.ir import Program
from transpiler.plan import Plan, transpile
from transpiler.settings import ScaleConfig

if TYPE_CHECKING:
    from runtime.driver.online import OnlineHistory

__all__ = [
    "LOOKAHEAD",
    "CheckpointConfig",
    "CheckpointSaveError",
    "EvalConfig",
    "FailureConfig",
    "History",
    "OnlineConfig",
    "RunConfig",
    "ScaleConfig",
    "Settings",
    "TelemetryConfig",
    "TrainingError",
    "train",
]


def train(
    plan_or_program: Plan | Program,
    data: Any,
    *,
    scale: ScaleConfig | None = None,
    run: RunConfig | None = None,
    checkpoint: CheckpointConfig | str | Path | None = None,
    eval: EvalConfig | None = None,
    telemetry: TelemetryConfig | None = None,
    failure: FailureConfig | None = None,
    engine: str | Engine = "local",
    address: str | None = None,
    secret: bytes | None = None,
    online: OnlineConfig | None = None,
    **flat: Any,
) -> History | OnlineHistory:
    """Train `plan_or_program` (a Program is transpiled with the default config) on `data`.

    - `data`: generated data with `batch(i, n)` (then `run.batch_size` is the global batch size) or a
      re-iterable of global feed dicts (see `runtime.data.sources`).
    - `scale` (`ScaleConfig`: trainers per type, servers, micro-batches, mode, dense_on_trainer,
      kernel_threads, device_map), `run` (`RunConfig`: steps, epochs, until_loss, batch_size,
      stall_timeout, allow_emulation, return_params, device_graphs), `checkpoint` (`CheckpointConfig`:
      dir, every, keep, resume), `eval` (`EvalConfig`: data, every), `telemetry` (`TelemetryConfig`: metrics,
      trace, progress, tensorboard, callback), `failure` (`FailureConfig`: max_restarts,
      min_trainers; runtime/driver/restart.py): the run's settings, each field documented on its
      record (runtime/driver/settings.py, transpiler/settings.py). `tune(...).scale` goes to `scale=`
      as it is.
    - `**flat`: the same settings as flat keywords, e.g. `steps=10, trainers={"cpu": 2, "gpu": 1}`,
      `checkpoint="DIR", checkpoint_every=5, keep=2`, `eval_data=..., eval_every=...`,
      `metrics="run.jsonl"` (`settings.FLAT` says which record holds which); a flat keyword beside
      the record that holds it is refused.
    - `engine`: "local" (processes on this machine), "ray" (Ray actors; `address` = the cluster to
      join, None = start a local Ray) or an Engine instance; `secret`: the run's message key (default:
      the engine's, else a fresh one).
    - a stream source (`runtime.data.streams`: pass directories, NATS) as `data`, with `online=`
      (`OnlineConfig`) or without an end condition, trains pass after pass (test-then-train, a
      checkpoint per pass, publishing) and returns an `OnlineHistory`: see runtime/driver/online.py.
      With `steps=` and no `online=`, a stream source is a plain re-iterable of feed dicts.

    The trainers report each step to the driver: `telemetry.callback(record)` is called in step order
    with {"step", "loss", "auc", "examples", "time"}, up to 0.1 s after the step ended. A checkpoint
    directory is checked before anything starts, and a failed final save raises
    CheckpointSaveError, which carries the History. A resumed run counts `steps` / `epochs` over the
    whole run (a step-20 checkpoint resumed with steps=40 trains steps 20-39 on the batches an
    uninterrupted run would); a checkpoint of another plan is refused; the shard count may differ.
    """
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        flat["checkpoint"] = checkpoint  # the flat checkpoint=DIR
        checkpoint = None
    settings = Settings.of(
        flat, scale=scale, run=run, checkpoint=checkpoint, eval=eval, telemetry=telemetry, failure=failure
    )
    plan = _verified(plan_or_program)
    if _is_online(data, settings, online):  # pass after pass, each pass one `train`
        return _online(plan, data, settings, online, dict(engine=engine, address=address, secret=secret))
    engines = _Engines(engine, address)
    attempt = functools.partial(_attempt, plan, data, engines=engines, secret=secret)
    return restart.run(plan, settings, attempt, lambda scale: engines.get().fits(_needs(scale)))


def _online(plan: Plan, data: Any, settings: Settings, online: OnlineConfig | None, how: dict) -> Any:
    """Train a stream source pass after pass (runtime/driver/online.py), each pass one `train(**how)`."""
    from runtime.driver.online import train_online

    return train_online(plan, data, settings, online, functools.partial(train, **how))


def _is_online(data: Any, settings: Settings, online: OnlineConfig | None) -> bool:
    """Whether `data` is trained pass after pass: `online=` given, or a stream source with no end."""
    r = settings.run
    ends = r.steps is not None or r.epochs is not None or r.until_loss is not None
    if online is None and (ends or "runtime.data.streams.base" not in sys.modules):
        return False  # (a stream source's module is imported by then; its import needs pyarrow)
    from runtime.data.streams.base import StreamSource

    if online is None and not isinstance(data, StreamSource):
        return False
    if not isinstance(data, StreamSource):
        raise TypeError(
            f"online= needs a stream source as data (runtime.data.streams), got {type(data).__name__}"
        )
    return True


class _Engines:
    """The run's engine: made on first use, and used again (reset) by each restart."""

    def __init__(self, engine: str | Engine, address: str | None) -> None:
        self.spec, self.address, self.engine = engine, address, None

    def get(self) -> Engine:
        if self.engine is None:
            self.engine = make_engine(self.spec, self.address)
        return self.engine

    def fresh(self) -> Engine:
        """The engine for the next attempt: a used one forgets its last attempt's processes (an
        Engine instance given to `train` may come from an earlier `train`: an online run's pass
        before, or the caller's own run)."""
        if self.engine is not None or isinstance(self.spec, Engine):
            self.get().reset()
        return self.get()


def _needs(scale: ScaleConfig) -> dict[str, dict[str, float]]:
    """Every process of a run with (resolved) `scale` and its resource hints."""
    kinds = {t: kind_of(t, scale.device_map) for t in scale.trainers}
    return {
        **{n: {} for n in process_names(SERVER, scale.servers)},
        **{n: {"gpu": 1} if kinds[ProcessId.parse(n).kind] == "gpu" else {} for n in scale.trainer_names()},
    }


def _attempt(plan: Plan, data: Any, settings: Settings, engines: _Engines, secret: bytes | None) -> History:
    """One run of `plan` on `data` from its resume point (one attempt of a restarting run)."""
    cfg = ResolvedRun.make(plan, data, settings)
    sources.prepare(data, cfg.counts[cfg.reader], plan.programs[cfg.reader])  # checks shards
    pauses, roots, start_from = _pauses(plan, cfg)
    schema = getattr(data, "schema", None)
    if pauses.root is not None and hasattr(schema, "to_dict"):  # the feature pipeline travels along
        from runtime.data.files.features import save_features

        save_features(pauses.root, schema)
    check_first_batch(plan, cfg)
    eng = engines.fresh()
    t = cfg.telemetry
    tel = Telemetry(
        t.metrics,
        t.trace,
        t.progress,
        total=None if cfg.run.steps is None else cfg.run.steps - pauses.start,
        meta={
            "trainers": cfg.counts,
            "servers": cfg.scale.servers,
            "mode": cfg.scale.mode,
            "micro_batches": cfg.scale.micro_batches,
            "batch_size": cfg.run.batch_size,
            "engine": type(eng).__name__,
            "tables": len(plan.tables),
            **({"filled": data.filled} if getattr(data, "filled", None) else {}),
        },
        tensorboard=t.tensorboard,
    )
    session = _Session(
        plan,
        cfg,
        eng,
        secret if secret is not None else eng.secret or os.urandom(32),
        pauses,
        tel,
        History(first_step=pauses.start, filled=dict(getattr(data, "filled", None) or {})),
        tel.chain(t.callback),
        roots,
        start_from,
    )
    _run_to_end(session)
    return session.history


def _signature_with_flat_names() -> inspect.Signature:
    """`train`'s signature with the flat keywords (`FLAT`) in place of `**flat`, so `help(train)` and
    `inspect.signature(train).bind(...)` know them."""
    sig = inspect.signature(train)
    named = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    flat = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in FLAT if n != "checkpoint"
    ]
    return sig.replace(parameters=[*named, *flat])


train.__signature__ = _signature_with_flat_names()  # type: ignore[attr-defined]


def _verified(plan_or_program: Plan | Program) -> Plan:
    if isinstance(plan_or_program, Plan):
        plan_or_program.verify()  # a hand-edited plan (unknown op, dangling tensor, cycle) fails here
        return plan_or_program
    return transpile(plan_or_program)  # verifies what it makes


def _pauses(plan: Plan, cfg: ResolvedRun) -> tuple[Pauses, list[Path], Path | None]:
    """The run's pauses (checkpoints, evaluations), and the directories the servers may read and
    write: an unusable checkpoint directory (or resume point) is refused now, not after training."""
    ck, ev = cfg.checkpoint, cfg.eval
    root = None if ck.dir is None else check_root(ck.dir)
    start_from, start = resume_state(plan, None if ck.resume is None else str(ck.resume), cfg.run.steps)
    pauses = TimedPauses(
        plan,
        cfg.data,
        start,
        cfg.run.steps,
        cfg.pushes,
        cfg.checkpoint_settings(),
        root,
        ck.every,
        ck.keep,
        ev.data,
        ev.every,
        cfg.stall_timeout,
        ev.output,
        every_s=ck.every_s,
        group=ev.group,
        slice_by=ev.slice_by,
    )
    return pauses, [p for p in (root, start_from) if p is not None], start_from


@dataclass
class _Session:
    """One run on the driver's side: what it trains, the engine, and what it reports to."""

    plan: Plan
    settings: ResolvedRun
    engine: Engine
    secret: bytes
    pauses: Pauses
    tel: Telemetry
    history: History
    callback: Callable[[dict[str, Any]], None] | None
    roots: list[Path]
    start_from: Path | None  # the checkpoint to resume from
    # `secret`: the run's master key of the links (channels.Links), held by the driver alone; the
    # shards' master key: each trainer gets only its own key under it (wire.client_key)
    ps_secret: bytes = field(default_factory=lambda: os.urandom(32))


def _run_to_end(s: _Session) -> None:
    """Run the session; however it ends, stop its processes and close its telemetry."""
    error = None
    try:
        _run(s)
    except BaseException as e:
        error = e
        if isinstance(e, TrainingError) and not hasattr(e, "history"):
            e.history = s.history  # what the attempt did (a restart keeps its steps before the restore)
        raise
    finally:
        s.engine.stop()
        h = s.history
        if s.pauses.root is not None:
            h.saved = [str(step_dir(s.pauses.root, step)) for step in s.pauses.saved]
        s.tel.close(
            {
                "steps": h.steps,
                "wall_s": h.wall_s,
                "startup_s": h.startup_s,
                "examples_per_s": h.examples_per_s(),
                "time_use": h.trainers,
                "tables": h.tables,
            },
            error,
        )


def _run(s: _Session) -> None:
    t0 = time.perf_counter()  # start-up counts placement too (on Ray: ray.init and the actors)
    cfg, eng = s.settings, s.engine
    names = cfg.trainer_names()
    needs = _needs(cfg.scale)
    eng.place(needs)
    servers = process_names(SERVER, cfg.scale.servers)
    endpoints = {n: eng.endpoint(n) for n in names}
    links = Links.derive(s.secret, DRIVER, endpoints, [*names, *servers])  # (only the driver holds s.secret)
    inbox = Inbox(eng.endpoint(DRIVER), links)
    out = Outbox(links)
    ps_eps = [eng.endpoint(n) for n in servers]
    admin = os.urandom(32)  # assign / save / load: only this driver may (the trainers lack this key)
    listen = Listener(cfg, eng, inbox, out, endpoints, s.history, s.callback, s.tel, s.pauses, t0)
    try:
        start_servers(
            eng,
            s.plan.tables,
            ps_eps,
            mode=cfg.scale.mode,
            secret=s.secret,
            admin=admin,
            report=inbox.endpoint,
            pushes=cfg.pushes or 1,
            trace=s.tel.tracing,
            roots=s.roots,
            ps_secret=s.ps_secret,
            holders={n: str(ProcessId(t, 0)) for n, t in cfg.held.items()},
        )
        s.pauses.client = PSClient(
            ps_eps, secret=s.ps_secret, timeout=cfg.stall_timeout, admin_secret=admin, watch=listen.watch
        )
        if s.start_from is not None:
            s.pauses.client.load(s.start_from, step=s.pauses.start)
        elif s.plan.params:
            load_values(s.plan, ps_eps, s.ps_secret, admin, watch=listen.watch)
        for name in names:
            spec = _trainer_spec(s, name, endpoints, ps_eps, inbox.endpoint, listen.first_grant())
            eng.start(
                name,
                run_trainer,
                {"spec": spec.to_dict()},
                report=inbox.endpoint,
                secret=link_key(s.secret, name, DRIVER),  # (its failure report)
                resources=needs[name],
            )
        _listen_and_finish(s, listen, ps_eps, admin)
    finally:
        if s.pauses.client is not None:
            s.pauses.client.close()
        out.close()
        s.history.refused_messages = inbox.refused
        s.history.refused_connections = inbox.refused_connections
        inbox.close()


def _listen_and_finish(s: _Session, listen: Listener, ps_eps: list[str], admin: bytes) -> None:
    """Run the driver's loop to the trainers' end, then finish; a failure that a lost process caused
    names that process."""
    eng = s.engine
    try:
        listen.run()
    except TrainingError as e:
        lost = _lost_process(eng)  # a pause or the stall timeout failing on a dead process: name it
        if lost is None or ProcessId.maybe(e.who) is not None:
            raise
        raise lost from e
    lost = _lost_process(eng)
    if lost is not None:  # a shard that died after the trainers' last step: its tables are gone
        raise lost
    try:
        _finish(s, ps_eps, admin, listen.watch)
    except (PSTimeoutError, OSError) as e:
        raise _lost_process(eng) or e from e


def _lost_process(eng: Engine) -> TrainingError | None:
    """A TrainingError naming the first process of the run that ended with a failure, or else one
    that is stopped, if any."""
    for name, failure in eng.ended().items():
        if failure is not None:
            return TrainingError(name, failure.how)
    for name, how in eng.stalled().items():
        return TrainingError(name, f"{how}; the run cannot go on without it")
    return None


def _trainer_spec(
    s: _Session, name: str, endpoints: dict[str, str], ps_eps: list[str], report: str, grant: int | None
) -> TrainerSpec:
    cfg = s.settings
    pid = ProcessId.parse(name)
    t = pid.kind
    return TrainerSpec(
        name=name,
        type=t,
        index=pid.index,
        scale=cfg.scale,
        run=cfg.run,
        program=s.plan.programs[t].to_json(),
        reader=cfg.reader,
        tables=s.plan.tables,
        loss=s.plan.loss_name,
        loss_reduction=cfg.loss_reduction,
        held=[n for n, h in cfg.held.items() if h == t],
        endpoints=endpoints,
        driver=report,
        ps=ps_eps,
        links=Links.derive(s.secret, name, {**endpoints, DRIVER: report}, [*endpoints, DRIVER]),
        data=cfg.data if t == cfg.reader else None,
        trace=s.tel.tracing,
        start=s.pauses.start,
        grant=grant,
        report_s=reports.EVERY_S if cfg.until_loss is None else 0.0,  # (until_loss: grants follow losses)
        ps_key=client_key(s.ps_secret, name),
    )


def _finish(s: _Session, ps_eps: list[str], admin: bytes, watch: Callable[[], None]) -> None:
    """After every trainer is done: a pass end (`RunConfig.ends_pass`), table statistics, trace
    spans, final values, the final checkpoint and evaluation."""
    history, pauses = s.history, s.pauses
    timeout = s.settings.stall_timeout
    with PSClient(ps_eps, secret=s.ps_secret, timeout=timeout, admin_secret=admin, watch=watch) as client:
        if s.settings.run.ends_pass:  # the pass end of the feature lifecycle, before the final save
            history.removed_rows = client.shrink()
        stats = client.stats()  # per shard; the tables' memory goes to History.tables and metrics
        history.tables = {
            n: {k: sum(st[n][k] for st in stats if n in st) for k in ("rows", "bytes")} for n in client.specs
        }
        for n, t in history.tables.items():  # a sparse table's rows admitted / evicted / spilled per shard
            if any("admitted" in st.get(n, {}) for st in stats):
                keys = ("rows", "admitted", "evicted", "spilled")
                t["shards"] = [{k: st[n][k] for k in keys} for st in stats if n in st]
        s.tel.tables(pauses.start + history.steps, history.tables)
        if s.tel.tracing:
            for k, spans in enumerate(client.trace()):
                s.tel.spans(str(ProcessId.server(k)), spans)
        if s.settings.run.return_params:
            history.params = pull_all(client, s.plan)
        end = pauses.start + history.steps
        if pauses.root is not None:
            try:
                pauses.save(end)
            except Exception as e:
                raise CheckpointSaveError(str(pauses.root), e, history) from e
        pauses.finish(end, history, s.tel)
