"""Tutorial 1: train Wide&Deep on synthetic click logs, in one process.

    python tutorials/01_wide_deep.py                    # ~10 s on one core: AUC ~0.80
    python tutorials/01_wide_deep.py --steps 200 --batch 128 --eval-every 50

What it shows, in the order a hetps user meets it:
  1. author a static program with the builder (`transpiler.frontends.builder`, like `paddle.static`),
  2. let an optimizer append the backward and update ops (`minimize`),
  3. initialise parameters with the startup program and train with `runtime.Executor`,
  4. evaluate with the forward-only part of the program (`transpiler.inference_program`).
The same program is what later tutorials place on CPU and GPU trainers and parameter servers.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from runtime import Executor
from runtime.data import SyntheticCTR
from runtime.evaluation.metrics import auc
from transpiler import builder as nn
from transpiler import inference_program
from transpiler.models import wide_deep

OPTIMIZERS = {"sgd": nn.SGD, "adagrad": nn.Adagrad, "adam": nn.Adam}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train Wide&Deep on synthetic CTR data (single process).")
    ap.add_argument("--steps", type=int, default=1000, help="training steps (one batch each)")
    ap.add_argument("--batch", type=int, default=256, help="examples per step")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--vocab", type=int, default=1000, help="ids per categorical slot's hash space")
    ap.add_argument("--dim", type=int, default=8, help="embedding width of the deep part")
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 32], help="MLP layer sizes")
    ap.add_argument("--eval-every", type=int, default=100, help="print loss and held-out AUC every N steps")
    ap.add_argument("--eval-size", type=int, default=8192, help="held-out examples")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    # numpy's BLAS would start one thread per core; for these small GEMMs, and on a machine other
    # processes share, one thread is several times faster (see docs/design.md).
    threadpool_limits(1)

    # 1-2. The model. `wide_deep` is ~20 lines of builder calls (transpiler/models.py):
    #   wide  = sum over the 26 slots of a learned scalar per id  (embedding dim 1 + reduce_sum)
    #   deep  = MLP over [26 id embeddings, 13 dense features]     (embedding, reshape, concat, fc)
    #   loss  = mean log loss of sigmoid(wide + deep)
    # Passing an optimizer makes `minimize(loss)` append gradient ops (`x@GRAD`, sparse rows for
    # the embeddings) and one update op per parameter, so one run of `model.main` = one step.
    opt = OPTIMIZERS[args.optimizer](lr=args.lr)
    model = wide_deep(
        vocab=args.vocab, dim=args.dim, hidden=tuple(args.hidden), optimizer=opt, seed=args.seed
    )
    n_ops = {
        role: sum(op.role == role for op in model.main.ops)
        for role in ("forward", "loss", "backward", "optimize")
    }
    print(f"Wide&Deep: {len(model.main.parameters())} parameters, ops {n_ops}")

    # 4 (prepared now). The forward part, pruned to what `pred` needs: no label feed, no updates.
    # It shares parameter names with the training program, so the same Executor (whose scope
    # holds the trained values) evaluates the current model.
    infer = inference_program(model.main, [model.pred])

    # 3. Initialise the parameters (deterministic from the seed), then train.
    exe = Executor()
    exe.run(model.startup)

    # Synthetic Criteo-like data from a hidden "teacher" model: batch i is a pure function of
    # (seed, i), so training batches (0, 1, 2, ...) and the held-out set (index 10**6) never overlap.
    data = SyntheticCTR(vocab=args.vocab, seed=args.seed)
    held_out = data.batch(10**6, args.eval_size)
    features = {k: held_out[k] for k in model.feeds if k != "label"}
    print(f"teacher AUC on the held-out set (the best any model can do): {data.teacher_auc():.3f}")

    def evaluate() -> float:
        (pred,) = exe.run(infer, feed=features, fetch_list=[model.pred])
        return auc(held_out["label"], pred)

    losses, score, start = [], float("nan"), time.perf_counter()
    for step in range(1, args.steps + 1):
        (loss,) = exe.run(model.main, feed=data.batch(step, args.batch), fetch_list=[model.loss])
        losses.append(float(loss))
        if step % args.eval_every == 0 or step == args.steps:
            score = evaluate()
            rate = step * args.batch / (time.perf_counter() - start)
            print(
                f"step {step:5d}  loss {np.mean(losses[-args.eval_every :]):.4f}  "
                f"held-out AUC {score:.4f}  ({rate:,.0f} examples/s)"
            )
    print(f"final held-out AUC {score:.4f}")
    return score


if __name__ == "__main__":
    main()
