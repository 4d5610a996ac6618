"""Tutorial 3: bring your PaddlePaddle program — device_guard placement, import, heterogeneous training.

    python tutorials/03_paddle_program.py                 # ~25 s on 2 cores: AUC ~0.80
    python tutorials/03_paddle_program.py --steps 40      # the CI setting

A Paddle user already has a `paddle.static` training program. This tutorial takes one, unchanged,
to hetps's heterogeneous parameter-server runtime:
  1. write Wide&Deep with `paddle.static`, marking the MLP `device_guard("gpu")` (Paddle's own way
     to say where ops run) and the embeddings `is_sparse=True`; `minimize` it with Adam;
  2. run Paddle's startup program, so the weights exist in a Paddle scope;
  3. `transpiler.from_paddle` reads the program and those weights: forward ops are mapped to hetps
     ops, the backward part is regenerated, the optimizer (Adam, its lr and betas) is read from
     Paddle's optimize ops;
  4. `transpile` places every op: the `device_guard` marks win, everything unmarked goes by op type
     (embedding lookups -> cpu trainers, dense math -> gpu trainers), and the grad ops follow their
     forward ops; then it splits the program into a cpu and a gpu sub-program;
  5. `runtime.train` runs 2 cpu trainers, 1 gpu trainer and a parameter server (local engine).
     Without a CUDA GPU the gpu trainer is *emulated* on CPU kernels — allowed explicitly, and logged.

Why the legacy IR: Paddle 3.x builds PIR programs by default, and PIR ignores `device_guard`;
`paddle.pir_utils.OldIrGuard()` builds the legacy ProgramDesc, which keeps it. (A PIR program
imports too — hetps then places by op type alone.) In 3.3.1's legacy static mode some high-level
APIs are broken (`paddle.sum`, `paddle.matmul`); the model below uses the ones that work.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from runtime import train
from runtime.data import SyntheticCTR
from transpiler import from_paddle, transpile

SLOTS, NUM_DENSE = 26, 13


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Paddle W&D with device_guard -> hetps")
    ap.add_argument("--steps", type=int, default=300, help="training steps (one global batch each)")
    ap.add_argument("--batch", type=int, default=256, help="examples per global batch")
    ap.add_argument("--vocab", type=int, default=1000, help="ids per categorical slot's hash space")
    ap.add_argument("--dim", type=int, default=8, help="embedding width of the deep part")
    ap.add_argument("--lr", type=float, default=0.003, help="Adam learning rate")
    ap.add_argument("--cpu-trainers", type=int, default=2)
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="default: train's (the fewest that give every trainer an item each step; tutorial 2 says more)",
    )
    return ap.parse_args(argv)


def paddle_wide_deep(paddle, vocab: int, dim: int, lr: float):
    """Wide&Deep as a Paddle user writes it (legacy static mode): returns (main, startup, loss)."""
    main, startup = paddle.static.Program(), paddle.static.Program()
    main.random_seed = startup.random_seed = 7
    with paddle.static.program_guard(main, startup):
        ids = paddle.static.data("sparse", [-1, SLOTS], "int64")
        dense = paddle.static.data("dense", [-1, NUM_DENSE], "float32")
        label = paddle.static.data("label", [-1, 1], "float32")
        # wide: one learned scalar per id, summed over the slots (mean * SLOTS: paddle.sum is broken here)
        w = paddle.static.nn.embedding(ids, size=[vocab, 1], is_sparse=True)
        wide = paddle.mean(paddle.reshape(w, [-1, SLOTS]), axis=1, keepdim=True) * float(SLOTS)
        # deep: embeddings (sparse tables, left to placement: they go to cpu trainers) ...
        emb = paddle.static.nn.embedding(ids, size=[vocab, dim], is_sparse=True)
        # ... and an MLP the user pins to the GPU, exactly as for Paddle's own heterogeneous PS
        with paddle.static.device_guard("gpu"):
            h = paddle.concat([paddle.reshape(emb, [-1, SLOTS * dim]), dense], axis=1)
            for size in (64, 32):
                h = paddle.static.nn.fc(h, size, activation="relu")
            logit = paddle.add(paddle.static.nn.fc(h, 1), wide)
            loss = paddle.mean(
                paddle.nn.functional.binary_cross_entropy_with_logits(logit, label, reduction="none")
            )
        paddle.optimizer.Adam(lr).minimize(loss)
    return main, startup, loss


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    import paddle  # imported here: it takes seconds, and only this tutorial needs it

    paddle.enable_static()

    # 1-2. The user's program, and its initial weights in a scope (what `exe.run(startup)` makes).
    with paddle.pir_utils.OldIrGuard():
        main_prog, startup, loss = paddle_wide_deep(paddle, args.vocab, args.dim, args.lr)
        scope = paddle.static.Scope()
        with paddle.static.scope_guard(scope):
            paddle.static.Executor(paddle.CPUPlace()).run(startup)
        # 3. Import. The result is an ordinary hetps Program; Paddle's variable names are kept, so
        #    the loss is still called what Paddle called it.
        program = from_paddle(main_prog, scope=scope)
    print(
        f"imported: {len(program.ops)} ops, optimizer {program.attrs['optimizer']}, "
        f"loss {program.attrs['loss_name']!r}"
    )

    # 4. Placement and split. `explain` says why an op runs where it does.
    plan = transpile(program)
    print(plan.summary())
    mlp = next(op for op in program.ops if op.type == "matmul")
    lookup = next(op for op in program.ops if op.type == "embedding")
    print(plan.explain(mlp))  # -> gpu: the op_device Paddle's device_guard wrote
    print(plan.explain(lookup))  # -> cpu: category 'sparse' (embedding lookups read big tables)

    # 5. Train: readers (the cpu trainers, which own the data ops) each take half of every global
    #    batch in micro-batches; the gpu trainer runs the MLP; the parameter server applies Adam.
    data = SyntheticCTR(vocab=args.vocab, num_slots=SLOTS, num_dense=NUM_DENSE, seed=1)
    t0 = time.perf_counter()
    hist = train(
        plan,
        data,
        steps=args.steps,
        batch_size=args.batch,
        trainers={"cpu": args.cpu_trainers, "gpu": 1},
        micro_batches=args.micro_batches,
        mode="sync",
        allow_emulation=True,
    )
    took = time.perf_counter() - t0
    window = max(1, min(20, args.steps // 4))
    first, last = float(np.mean(hist.loss[:window])), float(np.mean(hist.loss[-window:]))
    auc = hist.auc_over(window)  # each batch is scored before the model trains on it: held-out AUC
    print(f"{hist.steps} steps in {took:.1f} s ({hist.examples_per_s():,.0f} examples/s after warm-up)")
    print(hist.time_use())
    print(
        f"loss {first:.4f} -> {last:.4f}; AUC of the last {window} steps {auc:.3f} "
        f"(the data's teacher reaches {data.teacher_auc():.3f})"
    )
    return {"loss_first": first, "loss_last": last, "auc": auc}


if __name__ == "__main__":
    main()
