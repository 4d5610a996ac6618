"""`plot_metrics`: training curves (loss, AUC, examples/s against step) from metrics JSONL files.

Held-out evaluations (`train(eval_data=..., eval_every=N)`, "eval" records) are drawn on the loss
and AUC panels as a second line with square markers, labelled "<run> held-out"; their GAUC
(`eval_group=`), when recorded, as a line with triangle markers on the AUC panel, "<run> held-out GAUC".

Online training's passes ("pass" records: `train` on a stream) draw their online (test-then-train)
loss and AUC at each pass's last step, as a line with diamond markers labelled "<run> online".

Several files draw as several labelled lines on the same axes (e.g. a sync run beside an async
one). A file that several runs appended to (`--metrics run.jsonl` given twice) draws each run as
its own line, "<file> #2", ...: a run starts at each "start" record whose steps begin again at
or before the previous run's last step (a resumed run, which goes on from its checkpoint's
step, continues the line of the run it resumes). The AUC panel's training line is each step's
own batch (a noisy, in-sample figure); the held-out line is the evaluation data's.
matplotlib's object API is used without pyplot, so plotting works headless and in threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from runtime.telemetry.outputs import eval_records, read_metrics, step_records

PANELS = (
    ("loss", "loss"),
    ("auc", "AUC (train: each step's batch; held-out: eval data)"),
    ("examples_per_s", "examples / s"),
)


def split_runs(records: list[dict]) -> list[list[dict]]:
    """The records of one metrics file cut into runs (see the module docstring)."""
    runs: list[list[dict]] = [[]]
    last = -1
    for i, r in enumerate(records):
        if r.get("kind") == "start" and runs[-1]:
            first = next((x["step"] for x in records[i + 1 :] if x.get("kind") == "step"), None)
            if first is not None and first <= last:
                runs.append([])
        if r.get("kind") == "step":
            last = r["step"]
        runs[-1].append(r)
    return [run for run in runs if any(x.get("kind") == "step" for x in run)]


def pass_records(records: list[dict]) -> list[dict]:
    """Online training's passes: each pass's online (test-then-train) loss and AUC at its last step."""
    return [
        {"step": r["step"], "loss": r.get("online_loss"), "auc": r.get("online_auc")}
        for r in records
        if r.get("kind") == "pass"
    ]


def panel_lines(
    key: str, label: str, steps: list[dict], evals: list[dict], passes: list[dict]
) -> list[tuple[str, tuple, tuple, dict]]:
    """The lines of one run on the panel of `key`: (legend label, steps, values, plot style) each,
    for the training steps, the held-out evaluations (on the AUC panel their GAUC too, when
    recorded) and online passes."""
    held = key != "examples_per_s"
    series = [
        (label, [(r["step"], r[key]) for r in steps if r.get(key) is not None], dict(linewidth=1.2)),
        (f"{label} held-out", [(r["step"], r.get(key)) for r in evals if held], dict(marker="s")),
        (
            f"{label} held-out GAUC",
            [(r["step"], r.get("gauc")) for r in evals if key == "auc"],
            dict(marker="^"),
        ),
        (f"{label} online", [(r["step"], r.get(key)) for r in passes if held], dict(marker="D")),
    ]
    out = []
    for i, (name, pts, style) in enumerate(series):
        pts = [(x, y) for x, y in pts if y is not None]
        if not pts:
            continue
        if i == 0:
            name = f"{label} train" if evals else label
            style["marker"] = "." if len(pts) < 40 else None
        else:
            style.update(linewidth=1.5, markersize=4)
        xs, ys = zip(*pts, strict=True)
        out.append((name, xs, ys, style))
    return out


def plot_metrics(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draw every metrics file of `paths` into one PNG at `out` (panels: loss, AUC, examples/s).

    Raises ValueError when a file holds no step records (it names the file)."""
    from matplotlib.figure import Figure

    paths = [Path(p) for p in paths]
    labels = list(labels) if labels is not None else [p.stem for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(paths)} metrics files but {len(labels)} labels")
    runs, names = [], []
    for p, label in zip(paths, labels, strict=True):
        parts = split_runs(read_metrics(p))
        if not parts:
            raise ValueError(
                f'{p} holds no step records (lines with "kind": "step"); '
                "write one with runtime.train(..., metrics=PATH) or hetps train --metrics"
            )
        for i, part in enumerate(parts):
            runs.append((step_records(part), eval_records(part), pass_records(part)))
            names.append(label if i == 0 else f"{label} #{i + 1}")
    labels = names
    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, len(PANELS))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for label, (steps, evals, passes) in zip(labels, runs, strict=True):
            for name, xs, ys, style in panel_lines(key, label, steps, evals, passes):
                ax.plot(xs, ys, label=name, **style)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1 or any(evals or passes for _, evals, passes in runs):
            ax.legend(fontsize=8)
        ax.title.set_fontsize(9 if len(title) > 20 else 12)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    return out
