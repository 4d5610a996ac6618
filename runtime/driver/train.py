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

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data import sources
from runtime.driver.checkpoints import check_root
from runtime.driver.history import CheckpointSaveError, History, TrainingError
from runtime.driver.listener import LOOKAHEAD, Listener
from runtime.driver.pauses import Pauses, resume_state
from runtime.driver.settings import RunSettings, TrainerSpec, check_first_batch
from runtime.engines import Engine, make_engine
from runtime.ps import PSClient
from runtime.ps.launch import load_values, pull_all, start_servers
from runtime.telemetry.outputs import Telemetry
from runtime.trainer.process import run_trainer
from runtime.transport import reports
from runtime.transport.channels import Inbox, Outbox
from runtime.transport.process_id import SERVER, ProcessId, process_names
from transpiler.config import kind_of
from transpiler.ir import Program
from transpiler.plan import Plan, transpile

__all__ = ["LOOKAHEAD", "CheckpointSaveError", "History", "RunSettings", "TrainingError", "train"]


def train(
    plan_or_program: Plan | Program,
    data: Any,
    *,
    steps: int | None = None,
    epochs: int | None = None,
    until_loss: float | None = None,
    batch_size: int | None = None,
    trainers: dict[str, int] | None = None,
    servers: int | None = None,
    mode: str | None = None,
    micro_batches: int | None = None,
    engine: str | Engine = "local",
    device_map: dict[str, str] | None = None,
    allow_emulation: bool = False,
    return_params: bool = False,
    checkpoint: str | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
    secret: bytes | None = None,
    stall_timeout: float = 60.0,
    address: str | None = None,
    metrics: str | None = None,
    trace: str | None = None,
    progress: bool | None = None,
    tensorboard: str | None = None,
    checkpoint_every: int | None = None,
    keep: int = 2,
    resume: str | None = None,
    eval_data: Any = None,
    eval_every: int | None = None,
    dense_on_trainer: bool = True,
    kernel_threads: dict[str, int] | None = None,
) -> History:
    """Train `plan_or_program` (a Program is transpiled with the default config) on `data`.

    - `data`: generated data with `batch(i, n)` (then `batch_size` is the global batch size) or a
      re-iterable of global feed dicts (see `runtime.data.sources`).
    - `trainers`: processes per trainer type, default {"cpu": 2, "gpu": 1} (1 for other types);
      the type owning the data ops reads data. `servers`, `mode`: default to the plan's config.
    - `micro_batches`: micro-batches per reader and step (and the most a reader has in flight;
      twice that in async mode); None: the fewest that give every trainer an item each step
      (`transpiler.config.default_micro_batches`: 1 unless a type has more trainers than readers).
    - `device_map` / `allow_emulation`: see `runtime.exec.device.array_module`; a gpu type without CUDA
      is refused before any process starts unless emulation is allowed.
    - `callback(record)` is called in step order with {"step", "loss", "auc", "examples", "time"},
      up to 0.1 s after the step ended (trainers report steps together: runtime/reports.py).
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
      runtime.telemetry.outputs.
    - `dense_on_trainer`: a dense table only one trainer process uses (the gpu trainer's MLP, with
      one gpu trainer) stays on that trainer, which applies its gradients itself and writes it back
      to the servers before each checkpoint and evaluation and at the end (transpiler/held.py,
      runtime/ps/hold.py); False: it goes to the servers and back every step, as every other table.
    - `kernel_threads`: threads per trainer process of a type for its large matrix products
      (ops_registry.parallel; default 1), e.g. {"gpu": 2} lets an emulated gpu trainer use a core
      the other processes leave idle. A CUDA gpu trainer's products run on the device regardless.
    """
    plan = _verified(plan_or_program)
    settings = RunSettings.make(
        plan,
        data,
        steps=steps,
        epochs=epochs,
        until_loss=until_loss,
        batch_size=batch_size,
        trainers=trainers,
        servers=servers,
        mode=mode,
        micro_batches=micro_batches,
        device_map=device_map,
        allow_emulation=allow_emulation,
        stall_timeout=stall_timeout,
        return_params=return_params,
        dense_on_trainer=dense_on_trainer,
        kernel_threads=kernel_threads,
    )
    sources.prepare(data, settings.counts[settings.reader], plan.programs[settings.reader])  # checks shards
    pauses, roots, start_from = _pauses(
        plan, settings, checkpoint, resume, checkpoint_every, keep, eval_data, eval_every
    )
    check_first_batch(plan, settings)
    eng = make_engine(engine, address)
    tel = Telemetry(
        metrics,
        trace,
        progress,
        total=None if steps is None else steps - pauses.start,
        meta={
            "trainers": settings.counts,
            "servers": settings.servers,
            "mode": settings.mode,
            "micro_batches": settings.micro_batches,
            "batch_size": batch_size,
            "engine": type(eng).__name__,
            "tables": len(plan.tables),
        },
        tensorboard=tensorboard,
    )
    session = _Session(
        plan,
        settings,
        eng,
        secret if secret is not None else eng.secret or os.urandom(32),
        pauses,
        tel,
        History(first_step=pauses.start),
        tel.chain(callback),
        roots,
        start_from,
    )
    _run_to_end(session)
    return session.history


def _verified(plan_or_program: Plan | Program) -> Plan:
    if isinstance(plan_or_program, Plan):
        plan_or_program.verify()  # a hand-edited plan (unknown op, dangling tensor, cycle) fails here
        return plan_or_program
    return transpile(plan_or_program)  # verifies what it makes


def _pauses(
    plan: Plan,
    settings: RunSettings,
    checkpoint: str | None,
    resume: str | None,
    every: int | None,
    keep: int,
    eval_data: Any,
    eval_every: int | None,
) -> tuple[Pauses, list[Path], Path | None]:
    """The run's pauses (checkpoints, evaluations), and the directories the servers may read and
    write: an unusable checkpoint directory (or resume point) is refused now, not after training."""
    root = None if checkpoint is None else check_root(checkpoint)
    start_from, start = resume_state(plan, resume, settings.steps)
    pauses = Pauses(
        plan,
        settings.data,
        start,
        settings.steps,
        settings.pushes,
        settings.checkpoint_settings(),
        root,
        every,
        keep,
        eval_data,
        eval_every,
        settings.stall_timeout,
    )
    return pauses, [p for p in (root, start_from) if p is not None], start_from


@dataclass
class _Session:
    """One run on the driver's side: what it trains, the engine, and what it reports to."""

    plan: Plan
    settings: RunSettings
    engine: Engine
    secret: bytes
    pauses: Pauses
    tel: Telemetry
    history: History
    callback: Callable[[dict[str, Any]], None] | None
    roots: list[Path]
    start_from: Path | None  # the checkpoint to resume from


def _run_to_end(s: _Session) -> None:
    """Run the session; however it ends, stop its processes and close its telemetry."""
    error = None
    try:
        _run(s)
    except BaseException as e:
        error = e
        raise
    finally:
        s.engine.stop()
        h = s.history
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
    kinds = {t: kind_of(t, cfg.device_map) for t in cfg.counts}
    needs = {
        **{n: {} for n in process_names(SERVER, cfg.servers)},
        **{n: {"gpu": 1} if kinds[ProcessId.parse(n).kind] == "gpu" else {} for n in names},
    }
    eng.place(needs)
    inbox = Inbox(eng.endpoint("driver"), s.secret)
    out = Outbox(s.secret)
    ps_eps = [eng.endpoint(n) for n in process_names(SERVER, cfg.servers)]
    admin = os.urandom(32)  # assign / save / load: only this driver may (the trainers lack this key)
    endpoints = {n: eng.endpoint(n) for n in names}
    listen = Listener(cfg, eng, inbox, out, endpoints, s.history, s.callback, s.tel, s.pauses, t0)
    try:
        start_servers(
            eng,
            s.plan.tables,
            ps_eps,
            mode=cfg.mode,
            secret=s.secret,
            admin=admin,
            report=inbox.endpoint,
            pushes=cfg.pushes or 1,
            trace=s.tel.tracing,
            roots=s.roots,
        )
        s.pauses.client = PSClient(ps_eps, secret=s.secret, timeout=cfg.stall_timeout, admin_secret=admin)
        if s.start_from is not None:
            s.pauses.client.load(s.start_from, step=s.pauses.start)
        elif s.plan.params:
            load_values(s.plan, ps_eps, s.secret, admin)
        for name in names:
            spec = _trainer_spec(s, name, endpoints, ps_eps, inbox.endpoint, listen.first_grant())
            eng.start(
                name,
                run_trainer,
                {"spec": spec.to_dict()},
                report=inbox.endpoint,
                secret=s.secret,
                resources=needs[name],
            )
        listen.run()
        _finish(s, ps_eps, admin)
    finally:
        if s.pauses.client is not None:
            s.pauses.client.close()
        out.close()
        s.history.refused_messages = inbox.refused
        inbox.close()


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
        program=s.plan.programs[t].to_json(),
        reader=cfg.reader,
        counts=cfg.counts,
        endpoints=endpoints,
        driver=report,
        ps=ps_eps,
        mode=cfg.mode,
        micro_batches=cfg.micro_batches,
        tables=s.plan.tables,
        loss=s.plan.loss_name,
        loss_reduction=cfg.loss_reduction,
        secret=s.secret,
        device_map=cfg.device_map,
        allow_emulation=cfg.allow_emulation,
        stall_timeout=cfg.stall_timeout,
        data=cfg.data if t == cfg.reader else None,
        batch_size=cfg.batch_size,
        steps=cfg.steps,
        epochs=cfg.epochs,
        trace=s.tel.tracing,
        start=s.pauses.start,
        grant=grant,
        held=[n for n, h in cfg.held.items() if h == t],
        report_s=reports.EVERY_S if cfg.until_loss is None else 0.0,  # (until_loss: grants follow losses)
        kernel_threads=cfg.kernel_threads.get(t, 1),
    )


def _finish(s: _Session, ps_eps: list[str], admin: bytes) -> None:
    """After every trainer is done: table statistics, trace spans, final values, the final checkpoint
    and evaluation."""
    history, pauses = s.history, s.pauses
    with PSClient(ps_eps, secret=s.secret, timeout=s.settings.stall_timeout, admin_secret=admin) as client:
        stats = client.stats()  # per shard; the tables' memory goes to History.tables and metrics
        history.tables = {
            n: {k: sum(st[n][k] for st in stats if n in st) for k in ("rows", "bytes")} for n in client.specs
        }
        if s.tel.tracing:
            for k, spans in enumerate(client.trace()):
                s.tel.spans(str(ProcessId.server(k)), spans)
        if s.settings.return_params:
            history.params = pull_all(client, s.plan)
        end = pauses.start + history.steps
        if pauses.root is not None:
            try:
                pauses.save(end)
            except Exception as e:
                raise CheckpointSaveError(str(pauses.root), e, history) from e
        pauses.finish(end, history, s.tel)
