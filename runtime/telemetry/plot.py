"""`plot_metrics`: training curves (loss, AUC, examples/s against step) from metrics JSONL files.

Held-out evaluations (`train(eval_data=..., eval_every=N)`, "eval" records) are drawn on the loss
and AUC panels as a second line with square markers, labelled "<run> held-out".

Online training's passes ("pass" records: `train` on a stream) draw their online (test-then-train)
loss and AUC at each pass's last step, as a line with diamond markers labelled "<run> online".

Several files draw as several labelled lines on the same axes (e.g. a sync run beside an async
one). matplotlib's object API is used without pyplot, so plotting works headless and in threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from runtime.telemetry.outputs import eval_records, read_metrics, step_records

PANELS = (("loss", "loss"), ("auc", "AUC"), ("examples_per_s", "examples / s"))


def plot_metrics(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draw every metrics file of `paths` into one PNG at `out` (panels: loss, AUC, examples/s).

    Raises ValueError when a file holds no step records (it names the file)."""
    from matplotlib.figure import Figure

    paths = [Path(p) for p in paths]
    labels = list(labels) if labels is not None else [p.stem for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"{len(paths)} metrics files but {len(labels)} labels")
    runs = []
    for p in paths:
        steps = step_records(read_metrics(p))
        if not steps:
            raise ValueError(
                f'{p} holds no step records (lines with "kind": "step"); '
                "write one with runtime.train(..., metrics=PATH) or hetps train --metrics"
            )
        records = read_metrics(p)
        passes = [
            {"step": r["step"], "loss": r.get("online_loss"), "auc": r.get("online_auc")}
            for r in records
            if r.get("kind") == "pass"
        ]
        runs.append((steps, eval_records(records), passes))
    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, len(PANELS))
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for label, (steps, evals, passes) in zip(labels, runs, strict=True):
            pts = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs,
                    ys,
                    label=f"{label} train" if evals else label,
                    linewidth=1.2,
                    marker="." if len(pts) < 40 else None,
                )
            held = [(r["step"], r[key]) for r in evals if key != "examples_per_s" and r.get(key) is not None]
            if held:
                xs, ys = zip(*held, strict=True)
                ax.plot(xs, ys, label=f"{label} held-out", linewidth=1.5, marker="s", markersize=4)
            online = [(r["step"], r[key]) for r in passes if key != "examples_per_s" and r[key] is not None]
            if online:
                xs, ys = zip(*online, strict=True)
                ax.plot(xs, ys, label=f"{label} online", linewidth=1.5, marker="D", markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1 or any(evals or passes for _, evals, passes in runs):
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    return out
