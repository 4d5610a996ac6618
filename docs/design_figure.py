"""Draws docs/design.png, the architecture picture of docs/design.md:

python docs/design_figure.py          # writes docs/design.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

CPU, GPU, PS, IR, PASS = "#4c72b0", "#55a868", "#c44e52", "#8172b2", "#937860"


def box(ax, x, y, w, h, text, colour, size=10, fill=0.18):
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            fc=matplotlib.colors.to_rgba(colour, fill),
            ec=colour,
            lw=1.6,
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def arrow(ax, a, b, text="", colour="#333333", style="-|>", rad=0.0, dashed=False, offset=(0, 0.12)):
    ax.add_patch(
        FancyArrowPatch(
            a,
            b,
            arrowstyle=style,
            mutation_scale=14,
            color=colour,
            lw=1.5,
            connectionstyle=f"arc3,rad={rad}",
            ls="--" if dashed else "-",
        )
    )
    if text:
        ax.text(
            (a[0] + b[0]) / 2 + offset[0],
            (a[1] + b[1]) / 2 + offset[1],
            text,
            ha="center",
            va="center",
            fontsize=8.5,
            color=colour,
        )


def draw(out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(14, 8.5))
    ax.set_xlim(0, 14)
    ax.set_ylim(-0.5, 8)
    ax.axis("off")
    frontends(ax)
    passes(ax)
    runtime(ax)
    layers(ax)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def frontends(ax) -> None:
    """1. frontends -> one static training program."""
    ax.text(1.6, 7.65, "1. a static training program", ha="center", fontsize=11, weight="bold")
    for i, name in enumerate(("builder API", "PaddlePaddle\nstatic Program", "ONNX graph")):
        box(ax, 0.2, 6.3 - i * 0.95, 1.5, 0.75, name, IR, 9)
        arrow(ax, (1.75, 6.68 - i * 0.95), (2.2, 5.9 - 0.0 * i))
    box(ax, 2.2, 5.1, 1.2, 1.6, "Program\n(ops, vars,\nparams)\n+ loss", IR, 9)


def passes(ax) -> None:
    """2. the passes, the lint after each, the Plan."""
    ax.text(6.0, 7.65, "2. transpiler passes (plain functions)", ha="center", fontsize=11, weight="bold")
    names = [
        "append_backward",
        "assign_devices\n(op type → trainer type)",
        "insert_ps\n(pull / push)",
        "insert_comm\n(send / recv)",
        "split",
        "verify",
    ]
    for i, name in enumerate(names):
        x, y = 3.7 + (i % 3) * 1.6, 6.45 - (i // 3) * 1.05
        box(ax, x, y, 1.45, 0.75, name, PASS, 8)
        if i % 3:
            arrow(ax, (x - 0.16, y + 0.37), (x, y + 0.37))
    arrow(ax, (3.42, 5.9), (3.68, 6.6))
    ax.text(6.0, 5.18, "Program.lint() after every pass (ops change only through Block methods)",
            ha="center", fontsize=8.5, style="italic", color=PASS)
    arrow(ax, (3.7 + 2 * 1.6 + 0.3, 6.43), (3.7 + 1.1, 6.2))
    plan = "Plan\none program per\ntrainer type,\ntables, channels\n(save / draw /\nONNX export)"
    box(ax, 8.6, 5.1, 1.6, 1.6, plan, IR, 8.5)
    arrow(ax, (3.7 + 2 * 1.6 + 1.47, 5.77), (8.58, 5.9))


def runtime(ax) -> None:
    """3. the processes of a run and what flows between them."""
    ax.text(
        5.2,
        4.3,
        "3. runtime: processes (local engine) or Ray actors, tensors over ZeroMQ",
        ha="center",
        fontsize=11,
        weight="bold",
    )
    box(ax, 0.5, 2.6, 2.6, 1.3, "cpu trainer 0\ndata → unique ids → lookups\n(embedding rows)", CPU, 9)
    box(ax, 0.5, 0.9, 2.6, 1.3, "cpu trainer 1\n(reads its slice\nof each global batch)", CPU, 9)
    gpu = "gpu trainer\nMLP, loss, their\nbackward (cupy; numpy\nwhen EMULATED)"
    box(ax, 5.4, 1.7, 2.8, 1.5, gpu, GPU, 9)
    box(ax, 10.6, 2.6, 2.6, 1.1, "parameter server shard 0\ntables + optimizer", PS, 9)
    box(ax, 10.6, 0.9, 2.6, 1.1, "parameter server shard 1\n(rows by id hash)", PS, 9)
    box(ax, 5.4, 3.65, 2.8, 0.5, "driver: losses, AUC → metrics, trace", "#555555", 8.5, 0.08)
    arrow(ax, (6.8, 3.25), (6.8, 3.62), "", "#555555", dashed=True)
    for y, label in ((3.25, True), (1.55, False)):
        arrow(ax, (3.15, y + 0.1), (5.35, 2.6), "activations, labels" if label else "", CPU, offset=(0, 0.3))
        arrow(ax, (5.35, 2.3), (3.15, y - 0.15), "@GRADs" if label else "", GPU, offset=(0.3, 0.05))
    arrow(ax, (8.25, 2.75), (10.55, 3.15), "pull dense / push grads", PS, style="<|-|>", offset=(0, 0.2))
    arrow(ax, (8.25, 2.15), (10.55, 1.45), "", PS, style="<|-|>")
    arrow(
        ax,
        (1.8, 0.85),
        (11.9, 0.85),
        "pull sparse rows / push row grads (every cpu trainer, every shard)",
        PS,
        style="<|-|>",
        rad=0.18,
        offset=(0, -0.62),
    )
    arrow(ax, (9.4, 5.08), (8.25, 4.2), "", "#555555", dashed=True)
    ax.text(
        9.0,
        4.35,
        "the driver starts a process per\ntrainer and shard with its program",
        fontsize=8.5,
        color="#555555",
        va="center",
    )



def layers(ax) -> None:
    """The three packages; imports point down."""
    ax.text(12.1, 7.6, "imports point down", ha="center", fontsize=10, weight="bold")
    for i, (name, what) in enumerate(
        (
            ("runtime/", "runs Plans"),
            ("transpiler/", "IR, frontends, passes"),
            ("ops_registry/", "op types, shapes,\nkernels, gradients"),
        )
    ):
        box(ax, 11.1, 6.75 - i * 0.85, 2.0, 0.62, f"{name}\n{what}", "#777777", 8, 0.06)
        if i:
            arrow(ax, (12.1, 6.75 - (i - 1) * 0.85), (12.1, 7.38 - i * 0.85))


if __name__ == "__main__":
    print(draw(Path(__file__).with_name("design.png")))
