"""Tutorial 2: Wide&Deep placed on CPU and GPU trainers and trained by processes on this machine.

    python tutorials/02_heter_training.py                     # ~45 s on 2 shared cores: held-out AUC 0.80
    python tutorials/02_heter_training.py --steps 100 --trainers cpu=1,gpu=1 --mode async

What it shows, continuing tutorial 1 (same model, same data):
  1. `transpile` places every forward and backward op by its type — embedding lookups on `cpu`
     trainers, the MLP and the loss on the `gpu` trainer — and moves the parameters to
     parameter-server tables; `plan.summary()` shows the result;
  2. `runtime.train` runs the plan on the local engine: parameter-server shards and one process per
     trainer, tensors crossing between them over ZeroMQ, each global batch split over the cpu
     trainers and into micro-batches that flow through the pipeline;
  3. it reports the loss and AUC per step (here every `--log-every` steps), where each trainer's time
     went, and hands back the trained tables, which we evaluate on held-out data.
On a machine without CUDA the gpu trainer runs on CPU kernels ("emulated", and logged as such);
`--require-gpu` refuses that instead.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
from threadpoolctl import threadpool_limits

from runtime import Executor, train
from runtime.data import SyntheticCTR
from runtime.evaluation.metrics import auc
from transpiler import builder as nn
from transpiler import inference_program, transpile
from transpiler.config import default_micro_batches
from transpiler.models import wide_deep

OPTIMIZERS = {"sgd": nn.SGD, "adagrad": nn.Adagrad, "adam": nn.Adam}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train Wide&Deep heterogeneously on the local engine.")
    ap.add_argument("--steps", type=int, default=600, help="training steps (one global batch each)")
    ap.add_argument("--batch", type=int, default=256, help="examples per global batch")
    ap.add_argument("--trainers", default="cpu=2,gpu=1", help="processes per trainer type")
    ap.add_argument("--servers", type=int, default=2, help="parameter-server shards")
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per cpu trainer and step (default: train's, see below)",
    )
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--log-every", type=int, default=100, help="print progress every N steps")
    ap.add_argument("--eval-size", type=int, default=8192, help="held-out examples")
    ap.add_argument("--require-gpu", action="store_true", help="refuse to emulate the gpu trainer")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    threadpool_limits(1)  # the trainer processes pin their BLAS too; this one only evaluates
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # shows the emulation warning

    # 1. The single-process program of tutorial 1, then the plan. The default TranspileConfig maps
    # op categories to trainer types: io, sparse -> cpu; dense, loss -> gpu; light ops (reshape,
    # concat, activations) go wherever fewer bytes cross. Boundary tensors get send/recv ops,
    # parameters become parameter-server tables with pull/push ops, optimizer ops leave the trainers.
    model = wide_deep(vocab=args.vocab, optimizer=OPTIMIZERS[args.optimizer](lr=args.lr), seed=args.seed)
    plan = transpile(model.main)
    print(plan.summary())
    print("why the first MLP layer runs where it does:", plan.explain("gemm_0.tmp"))

    # 2. Train. `data` is the synthetic click log of tutorial 1; global batch t = data.batch(t, batch):
    # each cpu trainer takes its half and splits it into micro-batches. In sync mode every step's
    # gradients are summed on the servers and applied once, which is single-process training on
    # the global batch; async mode applies them as they come.
    data = SyntheticCTR(vocab=args.vocab, seed=args.seed)
    trainers = {k: int(v) for k, v in (p.split("=") for p in args.trainers.split(","))}
    # Micro-batches per cpu trainer and step: more let the trainer types overlap within a step, but
    # each costs messages and makes the kernels smaller. By default train takes the fewest that give
    # every trainer an item each step (1 here: 2 cpu trainers feed 1 gpu trainer); on this model 1
    # ran ~1.4x faster than 4. `hetps tune` searches them for your model and machine.
    micro_batches = args.micro_batches or default_micro_batches(trainers, "cpu")

    def progress(r: dict) -> None:
        step = r["step"] + 1
        if step % args.log_every == 0 or step == args.steps:
            print(
                f"step {step:5d}  loss {r['loss']:.4f}  batch AUC {r['auc']:.4f}  "
                f"({step * args.batch / max(r['time'], 1e-9):,.0f} examples/s)"
            )

    print(
        f"training {args.steps} steps of {args.batch} on {trainers}, {args.servers} server shard(s), "
        f"{micro_batches} micro-batch(es) per cpu trainer, {args.mode} mode"
    )
    history = train(
        plan,
        data,
        steps=args.steps,
        batch_size=args.batch,
        trainers=trainers,
        servers=args.servers,
        mode=args.mode,
        micro_batches=micro_batches,
        allow_emulation=not args.require_gpu,
        return_params=True,
        callback=progress,
    )
    print(
        f"{history.steps} steps in {history.wall_s:.1f} s after a {history.startup_s:.1f} s start-up; "
        f"where each trainer's time went:"
    )
    print(history.time_use())

    # 3. Evaluate the trained tables on held-out data with the forward part of the program.
    held_out = data.batch(10**6, args.eval_size)
    exe = Executor()
    exe.scope.update(history.params)
    (pred,) = exe.run(
        inference_program(model.main, [model.pred]),
        feed={k: held_out[k] for k in model.feeds if k != "label"},
        fetch_list=[model.pred],
    )
    score = auc(held_out["label"], pred)
    print(f"loss over the last 10 steps {np.mean(history.loss[-10:]):.4f}")
    print(f"final held-out AUC {score:.4f} (teacher's AUC: {data.teacher_auc():.4f})")
    return score


if __name__ == "__main__":
    main()
