"""Tutorial 5: heterogeneous training on a Ray cluster (here: a local Ray instance).

    python tutorials/05_ray_cluster.py                        # ~45 s with starting a local Ray: AUC ~0.84
    python tutorials/05_ray_cluster.py --address auto         # joins the cluster of `ray start --head`
    python tutorials/05_ray_cluster.py --steps 30 --batch 128 # the CI setting

The program and the plan are those of tutorial 2 (Wide&Deep, cpu and gpu trainers, a parameter
server); only the engine changes. With `engine=RayEngine(...)`:
  - every parameter-server shard and every trainer is a Ray actor; Ray places them by their
    resource requests: a gpu trainer asks for one GPU — or, on a CPU-only cluster, for one unit of
    the custom resource `gpu_trainer` (a locally started Ray offers it; `ray start
    --resources='{"gpu_trainer": 1}'` on a real node), and then it runs emulated on CPU kernels;
  - each actor reserves a tcp port on its node and the addresses are exchanged through Ray before
    training starts; tensors then go trainer to trainer over ZeroMQ, not through Ray;
  - an actor that dies is reported like a failed local process: `TrainingError` naming it.
docs/cluster.md shows the two-node set-up (`ray start --head`, `ray start --address=...`).
"""

from __future__ import annotations

import argparse

import numpy as np

from runtime import train
from runtime.data import SyntheticCTR
from runtime.engines import RayEngine
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Wide&Deep on cpu + gpu trainers placed by Ray.")
    ap.add_argument(
        "--address",
        default=None,
        help="Ray cluster: 'auto', 'ray://host:10001'; default: a Ray already running in this "
        "process, else a private local one",
    )
    ap.add_argument("--steps", type=int, default=300, help="training steps (one global batch each)")
    ap.add_argument("--batch", type=int, default=256, help="examples per global batch")
    ap.add_argument("--cpu-trainers", type=int, default=2)
    ap.add_argument(
        "--gpu-resource",
        default=None,
        help="resource a gpu trainer asks for (default: GPU if the cluster has GPUs, else gpu_trainer)",
    )
    ap.add_argument("--trace", default=None, help="write a Chrome-trace timeline of the run here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)

    # The model and its plan: nothing Ray-specific.
    model = wide_deep(vocab=1000, dim=8, hidden=(64, 32), optimizer=nn.Adam(lr=0.003))
    plan = transpile(model.main)
    print(plan.summary().splitlines()[0])

    # The engine. Without an address and without a Ray in this process it starts a private local
    # Ray (own temp dir, small object store, no dashboard) and shuts it down at the end; a Ray
    # that is already initialised (e.g. by your own `ray.init`) is used and left running.
    engine = RayEngine(args.address, gpu_resource=args.gpu_resource)
    data = SyntheticCTR(vocab=1000, seed=5)
    hist = train(
        plan,
        data,
        steps=args.steps,
        batch_size=args.batch,
        trainers={"cpu": args.cpu_trainers, "gpu": 1},
        servers=1,
        mode="sync",
        engine=engine,
        allow_emulation=True,
        trace=args.trace,
    )

    # Where Ray put each process: the ZeroMQ address it bound on its node, and its pid there.
    for name in sorted(engine.addresses):
        print(f"  {name:>6} ran at {engine.addresses[name]} (pid {engine.pid_of[name]})")
    window = max(1, min(20, args.steps // 4))
    first, last = float(np.mean(hist.loss[:window])), float(np.mean(hist.loss[-window:]))
    auc = hist.auc_over(window)  # each batch is scored before the model trains on it
    print(
        f"{hist.steps} steps: loss {first:.4f} -> {last:.4f}; AUC of the last {window} steps {auc:.3f}; "
        f"{hist.examples_per_s():,.0f} examples/s (+{hist.startup_s:.1f} s until all trainers were ready)"
    )
    print(hist.time_use())
    if args.trace:
        print(f"timeline: {args.trace} (open it in https://ui.perfetto.dev)")
    return {"loss_first": first, "loss_last": last, "auc": auc}


if __name__ == "__main__":
    main()
