"""Tutorial 4: an ONNX model — import it, train it heterogeneously, export its sub-programs to ONNX.

    python tutorials/04_onnx_model.py                       # ~30 s on 2 cores: held-out AUC ~0.71
    python tutorials/04_onnx_model.py --steps 60            # the CI setting

ONNX is how models leave their framework. `tutorials/models/wide_deep.onnx` is a Wide&Deep that
paddle2onnx exported from a PaddlePaddle `nn.Layer` (inputs `sparse` int64 [N, 26], `dense` float32
[N, 13]; output: a click probability; untrained weights). It is an *inference* graph: no loss, no
optimizer. This tutorial
  1. imports it with `from_onnx(..., loss="bce")`: the ONNX initializers become parameters (their
     values travel with the program), the two `Gather`s over 2-D weight tables become sparse
     embedding tables, and a mean binary cross-entropy against a new input `label` is attached;
  2. transpiles it — with an optimizer from the config, as ONNX carries none — and trains it on the
     local engine (2 cpu trainers, 1 emulated gpu trainer, 1 parameter server);
  3. scores held-out data with the trained weights (`return_params=True` brings them back);
  4. exports each trainer type's sub-program to ONNX: forward compute ops stay standard ONNX
     nodes; send/recv, pull/push and the gradient ops (ONNX has no training ops) become nodes of the
     custom domain `ai.hetps`, so Netron shows the split and `onnx.checker` accepts it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from runtime import Executor, train
from runtime.data import SyntheticCTR
from runtime.evaluation.metrics import auc
from transpiler import TranspileConfig, from_onnx, inference_program, transpile

MODELS = Path(__file__).resolve().parent / "models"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="ONNX W&D -> heterogeneous training -> ONNX split")
    ap.add_argument("--model", default=str(MODELS / "wide_deep.onnx"), help="ONNX model file")
    ap.add_argument("--steps", type=int, default=300, help="training steps (one global batch each)")
    ap.add_argument("--batch", type=int, default=256, help="examples per global batch")
    ap.add_argument("--lr", type=float, default=0.003, help="Adam learning rate")
    ap.add_argument("--eval-size", type=int, default=8192, help="held-out examples")
    ap.add_argument("--out", default=None, help="where the sub-programs go (default: a temp dir)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = Path(args.model)
    if not model.is_file():
        raise SystemExit(
            f"no ONNX model at {model}: pass --model PATH (the tutorial's own model is "
            "tutorials/models/wide_deep.onnx)"
        )

    # 1. Import. Names are the ONNX value names; `fetch_names` lists the graph outputs.
    program = from_onnx(model, loss="bce")
    output = program.attrs["fetch_names"][0]
    params = program.parameters()
    print(
        f"imported {model.name}: {len(program.ops)} ops, {len(params)} parameters "
        f"({sum(v.is_sparse for v in params)} sparse tables), output {output!r}, "
        f"loss {program.attrs['loss_name']!r}"
    )

    # 2. Transpile and train. Feeds: the model's inputs are called sparse/dense, and the attached
    #    loss reads `label` — the column names SyntheticCTR produces.
    plan = transpile(program, TranspileConfig(optimizer={"type": "adam", "lr": args.lr}))
    print(plan.summary())
    data = SyntheticCTR(vocab=1000, seed=2)
    hist = train(
        plan,
        data,
        steps=args.steps,
        batch_size=args.batch,
        trainers={"cpu": 2, "gpu": 1},
        mode="sync",
        allow_emulation=True,
        return_params=True,
    )
    window = max(1, min(20, args.steps // 4))
    first, last = float(np.mean(hist.loss[:window])), float(np.mean(hist.loss[-window:]))
    print(f"{hist.steps} steps, {hist.examples_per_s():,.0f} examples/s; loss {first:.4f} -> {last:.4f}")

    # 3. Held-out AUC, before and after: the forward part of the imported program, run by the
    #    single-process Executor with the initial (exported) and the trained weights.
    infer = inference_program(program, [output])
    held_out = data.batch(10**6, args.eval_size)
    features = {k: held_out[k] for k in ("sparse", "dense")}

    def held_out_auc(weights: dict) -> float:
        infer.params = weights
        (pred,) = Executor().run(infer, feed=features, fetch_list=[output])
        return auc(held_out["label"], pred)

    before = held_out_auc(program.params)
    after = held_out_auc({**program.params, **hist.params})
    print(
        f"held-out AUC: {before:.3f} with the exported weights -> {after:.3f} trained "
        f"(teacher {data.teacher_auc():.3f})"
    )

    # 4. Export the split: one ONNX model per trainer type.
    import onnx

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hetps-onnx-"))
    files = plan.to_onnx(out)
    for f in files:
        m = onnx.load(f)
        onnx.checker.check_model(m)
        comm = sorted(
            {n.op_type for n in m.graph.node if n.domain == "ai.hetps" and not n.op_type.endswith("_grad")}
        )
        print(f"{f}: {len(m.graph.node)} nodes; comm / PS / loss ops of domain ai.hetps: {comm}")
    return {
        "loss_first": first,
        "loss_last": last,
        "auc_before": before,
        "auc_after": after,
        "onnx": [str(f) for f in files],
    }


if __name__ == "__main__":
    main()
