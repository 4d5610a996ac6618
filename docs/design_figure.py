"""Draws docs/design.png, the architecture picture of docs/design.md:

python docs/design_figure.py          # writes docs/design.png
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

Point = tuple[float, float]

CPU, GPU, PS, IR, PASS = "#4c72b0", "#55a868", "#c44e52", "#8172b2", "#937860"
DRIVER, DATA, TUNE, GREY = "#555555", "#2a9d8f", "#dd8452", "#777777"


def box(
    ax: Axes,
    x: float,
    y: float,
    w: float,
    h: float,
    text: str,
    colour: str,
    size: float = 9.0,
    fill: float = 0.16,
    weight: str = "normal",
) -> None:
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
    ax.text(
        x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, linespacing=1.35
    )


def arrow(
    ax: Axes,
    a: Point,
    b: Point,
    colour: str = "#333333",
    style: str = "-|>",
    rad: float = 0.0,
    dashed: bool = False,
) -> None:
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
            shrinkA=0,
            shrinkB=0,
        )
    )


def label(
    ax: Axes,
    x: float,
    y: float,
    text: str,
    colour: str = "#333333",
    size: float = 8.5,
    ha: str = "center",
    **kw: object,
) -> None:
    ax.text(x, y, text, ha=ha, va="center", fontsize=size, color=colour, **kw)


def heading(ax: Axes, x: float, y: float, text: str, ha: str = "left") -> None:
    ax.text(x, y, text, ha=ha, va="center", fontsize=11.5, weight="bold")


def draw(out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(16, 10.6))
    ax.set_xlim(0, 16)
    ax.set_ylim(-0.35, 10.25)
    ax.axis("off")
    frontends(ax)
    passes(ax)
    tuner(ax)
    driver(ax)
    processes(ax)
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.99)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def frontends(ax: Axes) -> None:
    """1. a model file or the builder -> one Program (transpiler/)."""
    heading(ax, 0.2, 9.95, "1. one training Program")
    names = ("builder API", "PaddlePaddle program\n(legacy or PIR)", "ONNX graph\n(any exporter)")
    for i, name in enumerate(names):
        y = 8.6 - i * 0.95
        box(ax, 0.2, y, 1.9, 0.75, name, IR, 9)
        arrow(ax, (2.12, y + 0.37), (2.5, 8.25 - 0.0 * i))
    label(ax, 1.15, 6.4, "load_model(path) reads any model file", IR, 8.5)
    box(ax, 2.5, 6.95, 1.35, 2.45, "Program\nblocks of\nops and vars,\nparams,\nloss", IR, 9)


def passes(ax: Axes) -> None:
    """2. transpile: six passes, lint after each, the Plan."""
    heading(ax, 4.2, 9.95, "2. transpile(program, config)")
    names = [
        "1 append_backward\n(registry's gradient rules)",
        "2 assign_devices\n(op → trainer type)",
        "3 insert_ps\n(pull / push, tables)",
        "4 insert_comm\n(send / recv pairs)",
        "5 split\n(a program per type)",
        "6 verify\n(schedule: no deadlock)",
    ]
    w, h, xs, ys = 1.75, 0.8, (4.2, 6.2, 8.2), (8.6, 7.45)
    for i, name in enumerate(names):
        x, y = xs[i % 3], ys[i // 3]
        box(ax, x, y, w, h, name, PASS, 8.5)
        if i % 3:
            arrow(ax, (x - 0.23, y + h / 2), (x - 0.02, y + h / 2))
    arrow(ax, (3.87, 8.4), (4.18, 8.9))  # program -> first pass
    arrow(ax, (xs[2] + 0.3, ys[0] - 0.02), (xs[0] + 1.45, ys[1] + h + 0.02))  # row 1 -> row 2
    label(
        ax,
        7.08,
        7.2,
        "Program.lint() after every pass; ops change only through Block methods",
        PASS,
        8.5,
        style="italic",
    )
    arrow(ax, (xs[2] + w + 0.02, ys[1] + h / 2), (10.3, ys[1] + h / 2))  # verify -> Plan
    plan = (
        "Plan\na program per trainer\ntype, table specs,\nchannels, config,\n"
        "placement reasons\n(save / draw / ONNX)"
    )
    box(ax, 10.3, 6.95, 1.9, 2.45, plan, IR, 8.5)


def tuner(ax: Axes) -> None:
    """The cost model and the tuner (hetps tune), and the layers."""
    heading(ax, 12.8, 9.95, "cost model and tuner")
    text = (
        "runtime/profile: measure this machine\ntranspiler/cost: predict examples/s\n"
        "transpiler/tune: search placement,\ntrainers, micro-batches, shards\n"
        "hetps tune → config.yaml + run.yaml"
    )
    box(ax, 12.8, 8.0, 3.0, 1.6, text, TUNE, 8.5)
    arrow(ax, (12.78, 8.8), (12.22, 8.8), TUNE, dashed=True)
    label(ax, 12.5, 9.0, "config", TUNE, 8.5)
    label(ax, 14.2, 7.55, "three packages; imports point down", "#333333", 9, weight="bold")
    for k, name in enumerate(("runtime/", "transpiler/", "ops_registry/")):
        x = 12.55 + k * 1.15
        box(ax, x, 6.95, 0.95, 0.42, name, GREY, 8, 0.06)
        if k:
            arrow(ax, (x - 0.2, 7.16), (x - 0.02, 7.16), GREY)
    label(
        ax, 14.2, 6.6, "ops_registry: one OpDef per op type\n(category, shape, kernel, gradient)", GREY, 8.5
    )


def driver(ax: Axes) -> None:
    """3. train(): the driver, the engine, pauses and telemetry."""
    heading(ax, 0.2, 5.95, "3. train(plan, data): a process per trainer and per shard")
    label(
        ax, 0.2, 5.55, "engine local: processes, ipc://\nengine ray: Ray actors, tcp://", GREY, 8.5, ha="left"
    )
    text = (
        "driver (the calling process): ResolvedRun.make → engine places and starts the processes\n"
        "Listener: reports → History in step order · grants steps · names a failed or stopped process\n"
        "Pauses: checkpoints and held-out evaluation between steps · Telemetry: metrics, trace"
    )
    box(ax, 3.1, 4.35, 7.9, 1.1, text, DRIVER, 8.5, 0.07)
    arrow(ax, (11.25, 6.93), (10.6, 5.47), IR)  # Plan -> driver
    label(ax, 11.35, 6.2, "Plan", IR, 9, ha="left")
    life = (
        "checkpoints: step-N, atomic,\nany shard count; resume\nevaluate / predict: forward graph\n"
        "export: one servable ONNX model"
    )
    box(ax, 12.6, 4.45, 3.2, 1.3, life, GREY, 8.5, 0.07)
    arrow(ax, (11.02, 5.1), (12.58, 5.1), GREY, dashed=True)
    label(ax, 11.8, 5.28, "pauses", GREY, 8.5)


def processes(ax: Axes) -> None:
    """The processes of a run and what flows between them."""
    box(
        ax,
        0.2,
        2.2,
        2.05,
        1.5,
        "data\nSyntheticCTR,\nfeed dicts, files\n(open_dataset:\na shard per reader)",
        DATA,
        8.5,
    )
    cpu0 = (
        "cpu trainer 0 (reader)\nits rows of each global batch → items\nunique ids → pull rows → lookups\n"
        "Executor + comm_ops handlers over"
    )
    box(ax, 3.1, 2.15, 3.4, 1.85, "", CPU, 9)
    label(ax, 4.8, 3.4, cpu0, "#222222", 8.5, linespacing=1.35)
    for k, unit in enumerate(("StepBook", "PSAccess", "Mail")):
        box(ax, 3.25 + k * 1.08, 2.38, 0.98, 0.42, unit, CPU, 8, 0.28)
    box(ax, 3.1, 0.45, 3.4, 1.3, "cpu trainer 1 (reader)\nthe same sub-program,\nother rows", CPU, 9)
    gpu = (
        "gpu trainer (the same units)\nMLP, loss, their backward\ncupy (numpy when emulated)\n"
        "runs an item's segment once\nits tensors have arrived"
    )
    box(ax, 7.9, 1.1, 2.9, 2.1, gpu, GPU, 8.5)
    box(
        ax, 12.3, 2.5, 3.5, 1.2, "parameter-server shard 0\ntables + their optimizers\nsync or async", PS, 8.5
    )
    box(
        ax,
        12.3,
        0.75,
        3.5,
        1.2,
        "parameter-server shard 1\nsparse rows by id hash,\ndense tables whole",
        PS,
        8.5,
    )
    # data -> readers
    arrow(ax, (2.27, 3.1), (3.08, 3.1), DATA)
    arrow(ax, (2.27, 2.4), (3.08, 1.2), DATA)
    # tensors between trainers
    for ys, yd in ((3.55, 2.9), (1.45, 1.6)):
        arrow(ax, (6.52, ys), (7.88, yd), CPU)
        arrow(ax, (7.88, yd - 0.3), (6.52, ys - 0.4), GPU)
    label(ax, 6.62, 3.8, "Tensors: activations,\nlabels · Announce, End", CPU, 8.5, ha="left")
    label(ax, 7.2, 2.2, "Tensors: @GRADs", GPU, 8.5)
    # gpu <-> shards
    arrow(ax, (10.82, 2.75), (12.28, 3.1), PS, style="<|-|>")
    arrow(ax, (10.82, 1.6), (12.28, 1.35), PS, style="<|-|>")
    label(
        ax,
        11.55,
        2.2,
        "dense tables:\none gpu trainer\nholds them, writes\nback at pauses;\nseveral pull\nand push",
        PS,
        7.5,
    )
    # readers <-> shards (below everything)
    arrow(ax, (4.8, 0.43), (14.05, 0.73), PS, style="<|-|>", rad=0.12)
    label(ax, 9.4, -0.12, "pull sparse rows / push row grads (every reader, every shard)", PS, 8.5)
    # driver <-> processes
    arrow(ax, (4.0, 4.33), (4.0, 4.02), DRIVER, dashed=True)
    label(ax, 3.55, 4.17, "Grant", DRIVER, 8.5)
    arrow(ax, (9.35, 3.22), (9.35, 4.33), DRIVER, dashed=True)
    label(
        ax,
        9.45,
        3.78,
        "Ready, StepReport, Losses,\nDone, Failed (from every process)",
        DRIVER,
        8.5,
        ha="left",
    )
    arrow(ax, (11.02, 4.55), (12.9, 3.72), DRIVER, dashed=True)
    label(ax, 13.05, 4.05, "assign, load, save (admin key)", DRIVER, 8.5, ha="left")


if __name__ == "__main__":
    print(draw(Path(__file__).with_name("design.png")))
