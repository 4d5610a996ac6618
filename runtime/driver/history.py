"""What `train` returns (`History`) and raises (`TrainingError`, `CheckpointSaveError`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ops_registry.errors import HetpsError
from runtime.evaluation.metrics import auc


class TrainingError(HetpsError, RuntimeError):
    """A process of the run failed (the message names it and holds its traceback or signal)."""

    def __init__(self, who: str, detail: str) -> None:
        self.who, self.detail = who, detail
        super().__init__(f"{who} failed: {detail}")


class CheckpointSaveError(TrainingError):
    """Training finished but its final checkpoint could not be saved; `history` is the run's result."""

    def __init__(self, path: str, cause: BaseException, history: History) -> None:
        self.history = history
        super().__init__(
            "the final checkpoint",
            (
                f"training finished ({history.steps} steps), but saving to {path!r} failed: "
                f"{type(cause).__name__}: {cause}; the previous checkpoint there (if any) is intact, and "
                "the run's History is this error's .history"
            ),
        )


@dataclass(frozen=True)
class Restart:
    """One restart of a run (`train(..., max_restarts=N)`, runtime/driver/restart.py): `at` seconds
    after the run's training started (and `when`, Unix time) `culprit` failed with `error` (its last
    line) at step `failed_at_step`; the run went on from step `resumed_from` (`checkpoint`, or the
    start: None), so `steps_lost` steps and `seconds_lost` seconds of training were done again, with
    `trainers` and `servers` (fewer than before when the engine could not place them all: `note`)."""

    at: float
    when: float
    culprit: str
    error: str
    failed_at_step: int
    resumed_from: int
    checkpoint: str | None
    steps_lost: int
    seconds_lost: float
    trainers: dict[str, int]
    servers: int
    note: str = ""

    def __str__(self) -> str:
        where = self.checkpoint or "the start"
        return (
            f"at {self.at:.1f} s, step {self.failed_at_step}: {self.culprit} failed ({self.error}); "
            f"restarted from step {self.resumed_from} ({where}), {self.steps_lost} steps and "
            f"{self.seconds_lost:.1f} s lost" + (f"; {self.note}" if self.note else "")
        )


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
    {"step", "loss", "auc", "examples"}; `started_at`: the origin of `time` on the driver
    process's `time.perf_counter()` clock (to relate other measurements made there to the steps);
    `refused_messages`: messages to the driver's inbox without their sender's link key, or replayed,
    skipped; `refused_connections`: logins to it refused (each trainer's own counts are in
    `trainers[name]["refused_messages"]`, `["refused_connections"]`); `task_auc`: a multi-task
    plan's per-step AUC of each task (`Plan.tasks`), whose first task's is also `auc`; `filled`: per
    column, the missing values a dataset's policies filled (counted by `open_dataset`'s pass before
    training); `restarts`: a `Restart` per restart of the run (`max_restarts=`), the steps they lost
    not in the per-step lists; `saved`: the checkpoints this run saved completely, oldest first;
    `removed_rows`: a run that ends a pass (`RunConfig.ends_pass`), the rows its pass end removed
    per sparse table with a lifecycle (summed over shards; {} without one).
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
    started_at: float = 0.0
    refused_messages: int = 0
    refused_connections: int = 0
    task_auc: dict[str, list[float]] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    removed_rows: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.loss)

    def steps_done(self, at: float) -> float:
        """How many of the run's steps had ended at `at` (the driver's `time.perf_counter()`),
        interpolated between the steps' end times: to relate what is measured at a step callback,
        which runs up to 0.1 s after its step (runtime/transport/reports.py), to the steps done meanwhile."""
        return float(np.interp(at - self.started_at, self.time, np.arange(1, len(self.time) + 1)))

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
        busy + ps + send when other processes held the cores, more than 100% with kernel threads)."""
        lines = []
        for name, s in sorted(self.trainers.items()):
            wall = max(s.get("wall_s", 0.0), 1e-9)
            pct = {k: 100 * s.get(k, 0.0) / wall for k in ("busy_s", "ps_s", "wait_s", "send_s", "cpu_s")}
            threads = f", {k} kernel threads" if (k := s.get("kernel_threads", 1)) > 1 else ""
            lines.append(
                f"{name:>6}: busy {pct['busy_s']:5.1f}%  ps {pct['ps_s']:5.1f}%  "
                f"wait {pct['wait_s']:5.1f}%  send {pct['send_s']:4.1f}%  cpu {pct['cpu_s']:5.1f}%  "
                f"({s['items']} micro-batches, {wall:.1f} s{threads})"
            )
        return "\n".join(lines)
