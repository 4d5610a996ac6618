"""How benchmarks/gpu_check.sh's stage 5 fits the GPU machine: cpu trainers and parameter-server
shards from its core count, and the batch matrix (512 / 4096 / 16384) within the time left.

One core goes to each process: the gpu trainer (its host work is the critical path, docs/gpu.md),
one shard per 8 cores, the driver one, and the rest to cpu trainers (16 cores: 12 cpu trainers,
2 shards, 1 gpu trainer). The matrix's time limits are its nominal ones (120 / 60 / 60 s) scaled
down to the seconds left of the check's budget; a run that would get under `MIN_LIMIT_S` is
dropped (said in the output), so the whole check ends within its budget.

    python benchmarks/gpu_layout.py --nproc 16 --left 250 [--steps 100]

prints shell assignments for gpu_check.sh (`eval`): CPU_TRAINERS, SHARDS, GPU_TRAINERS, RUNS
("batch:steps:warmup:limit_s" each) and DROPPED.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MIN_LIMIT_S = 30  # a ctr.py run shorter than this measures mostly process start-up
# (batch, timed steps, warm-up steps, nominal limit in seconds); batch 512's steps come from --steps
MATRIX = ((512, None, 20, 120), (4096, 20, 5, 60), (16384, 8, 3, 60))


@dataclass(frozen=True)
class Layout:
    """Processes of the GPU machine's ctr.py run."""

    cpu: int
    shards: int
    gpu: int


@dataclass(frozen=True)
class Run:
    """One ctr.py run of the batch matrix (async and sync), bounded by `limit_s`."""

    batch: int
    steps: int
    warmup: int
    limit_s: int


def layout(nproc: int, gpus: int = 1) -> Layout:
    """cpu trainers, shards and gpu trainers for `nproc` cores and `gpus` devices: a core for each
    gpu trainer, one shard per 8 cores (at least one), one core for the driver, the rest cpu trainers
    (at least one)."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"gpu_layout: nproc must be a positive core count, got {nproc!r}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpu_layout: gpus must be a positive device count, got {gpus!r}")
    shards = max(1, nproc // 8)
    return Layout(cpu=max(1, nproc - shards - gpus - 1), shards=shards, gpu=gpus)


def runs(left_s: float, steps: int = 100) -> tuple[list[Run], list[int]]:
    """The batch matrix's runs within `left_s` seconds (each nominal limit scaled down to fit), and
    the batch sizes dropped for want of time."""
    if left_s < 0:
        left_s = 0
    nominal = sum(m[3] for m in MATRIX)
    scale = min(1.0, left_s / nominal)
    kept, dropped = [], []
    for batch, n, warmup, limit in MATRIX:
        got = int(limit * scale)
        if got < MIN_LIMIT_S:
            dropped.append(batch)
            continue
        kept.append(Run(batch, steps if n is None else n, warmup, got))
    return kept, dropped


def shell(nproc: int, left_s: float, steps: int = 100, gpus: int = 1) -> str:
    """gpu_check.sh's assignments (see the module docstring)."""
    lay = layout(nproc, gpus)
    kept, dropped = runs(left_s, steps)
    matrix = " ".join(f"{r.batch}:{r.steps}:{r.warmup}:{r.limit_s}" for r in kept)
    return (
        f"CPU_TRAINERS={lay.cpu}\nSHARDS={lay.shards}\nGPU_TRAINERS={lay.gpu}\n"
        f'RUNS="{matrix}"\nDROPPED="{" ".join(map(str, dropped))}"\n'
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, required=True, help="the machine's cores (nproc)")
    ap.add_argument("--left", type=float, required=True, help="seconds left of the check's budget")
    ap.add_argument("--steps", type=int, default=100, help="timed steps at batch 512")
    ap.add_argument("--gpus", type=int, default=1)
    args = ap.parse_args()
    print(shell(args.nproc, args.left, args.steps, args.gpus), end="")


if __name__ == "__main__":
    main()
