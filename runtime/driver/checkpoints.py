"""A run's checkpoints: where they go, what they record, which one a resume starts from.

`train(..., checkpoint=DIR, checkpoint_every=N, keep=K)` writes `DIR/step-00000020/` (each one a
`runtime.ps` checkpoint, saved atomically: see runtime/ps/checkpoint.py) every N steps and at the end
and keeps the K newest. Its manifest carries the run state (`RunState`) beside the tables (each
with its optimizer state: moments, Adam's Beta1Pow/Beta2Pow bias-correction powers, the sync step
count; a streaming table also its admission and eviction state, runtime/ps/entry.py):
- `step`: the steps trained, i.e. the next step to run; the data position follows from it (step t
  trains on global batch t: for generated data `batch(t, n)`, for an iterable source the t-th batch
  of its epochs, `epoch` = t // batches per epoch and `batch` = t % that when the source has a
  length); the RNG state too: random ops (dropout) draw from (seed, step), so nothing else is kept;
- `plan`: a hash of what decides the run's arithmetic (the sub-programs and the tables' names,
  kinds, shapes, dtypes, initializers and optimizers; not the shard count, which may change);
- `settings`: the run's mode, batch size, micro-batches and trainer counts (for the record).

`train(..., resume=DIR)` starts from `latest(DIR)` (the newest complete checkpoint, or DIR itself
when it is one); a newer checkpoint that cannot be read (no manifest, a corrupt one) is skipped with a
RuntimeWarning naming it and the reason, so a resume falls back to the older one visibly. A
checkpoint of another plan is refused by `check_resume` with the reason; the same model placed
differently (`model`: a hash of the tables and the ops without their devices and the send/recv
between trainer types: after `hetps tune`, or another `TranspileConfig`) is loaded, the tables
resharded to the servers there are. Both a save and `latest`
first remove staging directories of saves whose process died (`remove_stale_stages`).

A periodic save happens between steps: the driver stops granting steps at the save step, waits
until the servers have applied every push of the steps before it (`wait_applied`), saves (and
evaluates held-out data, `eval_every`), then lets the readers go on. In sync mode the tables then
hold exactly the state after that step, so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.ps import PSClient
from runtime.ps.checkpoint import (
    MANIFEST,
    CheckpointError,
    check_target,
    read_manifest,
    remove_stale_stages,
)
from transpiler.plan import Plan

STEP_DIR = re.compile(r"step-(\d{8})")


@dataclass
class RunState:
    """What a checkpoint of `train` records besides the tables (see the module docstring)."""

    step: int
    plan: str
    epoch: int | None = None
    batch: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # `model_hash`: the same model however it is placed


def model_hash(plan: Plan) -> str:
    """A hash of the model apart from its placement: the tables (as in `plan_hash`) and every op
    but the send/recv between trainer types, whichever sub-program holds it, without its device."""
    tables = [
        {k: d.get(k) for k in ("name", "kind", "shape", "dtype", "initializer", "optimizer")}
        for d in (t.to_dict() for t in sorted(plan.tables, key=lambda t: t.name))
    ]
    ops = sorted(
        json.dumps(
            [op.type, op.inputs, op.outputs, {k: v for k, v in op.attrs.items() if k != "op_device"}],
            sort_keys=True,
            default=str,
        )
        for p in plan.programs.values()
        for op in p.ops
        if op.role != "comm"
    )
    doc = {"tables": tables, "ops": ops}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_hash(plan: Plan) -> str:
    """A hash of what decides the run's arithmetic (not of the shard count)."""
    tables = [
        {k: d.get(k) for k in ("name", "kind", "shape", "dtype", "initializer", "optimizer")}
        for d in (t.to_dict() for t in sorted(plan.tables, key=lambda t: t.name))
    ]
    doc = {"tables": tables, "programs": {t: p.to_dict() for t, p in sorted(plan.programs.items())}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_state(plan: Plan, step: int, data: Any, settings: dict[str, Any]) -> RunState:
    per_epoch = _batches_per_epoch(data)
    return RunState(
        step,
        plan_hash(plan),
        step // per_epoch if per_epoch else None,
        step % per_epoch if per_epoch else None,
        settings,
        model_hash(plan),
    )


def _batches_per_epoch(data: Any) -> int | None:
    if hasattr(data, "batch") or not hasattr(data, "__len__"):
        return None
    try:
        return len(data) or None
    except TypeError:
        return None


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def check_root(root: str | Path) -> Path:
    """`root` as an absolute Path after making it; CheckpointError when it cannot hold checkpoints."""
    root = Path(root).absolute()
    if (root / MANIFEST).exists():
        raise CheckpointError(
            f"{str(root)!r} is itself one checkpoint; train(checkpoint=DIR) keeps "
            "step-NNNNNNNN checkpoints inside DIR: give a new directory (resume=DIR "
            "reads this one)"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot save a checkpoint at {str(root)!r}: {e.strerror or e} (train keeps its checkpoints "
            "in this directory)"
        ) from None
    check_target(step_dir(root, 0))  # can a save stage a new directory there?
    return root


def checkpoints(root: str | Path) -> list[Path]:
    """The step checkpoints in `root`, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name))


def latest(root: str | Path) -> Path:
    """The newest complete checkpoint in `root` (or `root` itself when it is a checkpoint)."""
    root = Path(root)
    if (root / MANIFEST).exists():
        return root
    if not root.is_dir():
        raise CheckpointError(f"nothing to resume from: {str(root)!r} is not a directory")
    remove_stale_stages(root)
    for path in reversed(checkpoints(root)):
        try:
            read_manifest(path)
        except CheckpointError as e:
            warnings.warn(
                f"skipping checkpoint {str(path)!r}, an older one is used: {e}", RuntimeWarning, stacklevel=2
            )
            continue
        return path
    raise CheckpointError(
        f"nothing to resume from: {str(root)!r} holds no complete checkpoint "
        "(step-NNNNNNNN directories with a manifest)"
    )


def read_state(path: str | Path) -> RunState:
    doc = read_manifest(path)
    run = doc.get("run")
    if not isinstance(run, dict):
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no run state (it was saved by PSClient.save, "
            "not train): it can be loaded into servers but not resumed"
        )
    names = {f.name for f in fields(RunState)}
    if not {"step", "plan"} <= set(run) <= names or not isinstance(run["step"], int):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {MANIFEST} has run state with fields {sorted(run)}, expected "
            f"'step' (an int) and 'plan', and only {sorted(names)}"
        )
    return RunState(**run)


def check_resume(plan: Plan, path: str | Path) -> RunState:
    """The run state of checkpoint `path` after checking it belongs to `plan`: CheckpointError
    naming the first table that differs, or the plan hash."""
    doc = read_manifest(path)
    state = read_state(path)
    saved = {t["name"]: t for t in doc["tables"]}
    mine = {t.name: t for t in plan.tables}
    if set(saved) != set(mine):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of another plan: it has tables {sorted(saved)}, "
            f"this plan {sorted(mine)}"
        )
    for name, t in mine.items():
        for key in ("kind", "shape", "dtype"):
            if saved[name].get(key) != getattr(t, key):
                raise CheckpointError(
                    f"checkpoint {str(path)!r}: table {name!r} has {key} "
                    f"{saved[name].get(key)}, this plan's has {getattr(t, key)}"
                )
        mine_opt = t.optimizer.to_dict() if t.optimizer else None
        if (saved[name].get("optimizer") or {}).get("type") != (mine_opt or {}).get("type"):
            raise CheckpointError(
                f"checkpoint {str(path)!r}: table {name!r} was trained with optimizer "
                f"{saved[name].get('optimizer')}, this plan has {mine_opt}"
            )
    if state.plan != plan_hash(plan):
        if state.model is not None and state.model == model_hash(plan):
            return state  # the same model placed differently (other trainer types, tuned): loaded as it is
        why = (
            "its ops differ, not only their placement"
            if state.model is not None
            else "it was saved before checkpoints recorded the placement-free model hash, so a "
            "change of placement cannot be told from a change of the model"
        )
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of another plan (hash {state.plan}, this plan "
            f"{plan_hash(plan)}): its tables match, but {why}"
        )
    return state


def save(client: PSClient, root: Path, state: RunState, keep: int) -> Path:
    """Save the servers' tables with `state` as `root/step-N`, then drop all but the `keep` newest."""
    path = step_dir(root, state.step)
    client.save(path, run=asdict(state))
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def wait_applied(client: PSClient, expected: dict[str, int], timeout: float) -> None:
    """Wait until every shard holding table t applied `expected[t]` pushes of it since it started."""
    deadline = time.monotonic() + timeout
    while True:
        late = {
            n: (s[n]["applied"], want)
            for s in client.stats()
            for n, want in expected.items()
            if n in s and s[n]["applied"] < want
        }
        if not late:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the servers did not apply the pushes before a checkpoint within {timeout} s "
                f"(table: (applied, expected)): {late}"
            )
        time.sleep(0.005)
