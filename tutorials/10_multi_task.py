"""Tutorial: a multi-task model (ESMM) trained as multi-task, with an AUC per task.

    python tutorials/10_multi_task.py                 # ~1 min on 2 cores: held-out AUC ctr ~0.78, ctcvr ~0.80
    python tutorials/10_multi_task.py --steps 60      # the CI setting

ESMM (Ma et al., SIGIR 2018) predicts two things for every impression: pCTR (a click) and
pCTCVR = pCTR x pCVR (a click followed by a purchase), both trained over all impressions, so
the CVR tower never sees only the clicked sample. Its loss is BCE(pCTR, click) + BCE(pCTCVR, buy),
with `buy` = click AND purchase. This tutorial
  1. builds it with `transpiler.models.esmm` (shared embeddings -> sparse parameter-server table,
     the two towers -> dense ops on the gpu trainer type) and trains it on 2 cpu trainers + 1
     (emulated) gpu trainer with a checkpoint: one backward over the weighted sum of the task
     losses, each task's AUC in the History (and in the metrics file / TensorBoard);
  2. scores held-out data from the checkpoint: `evaluate` gives each task's AUC, `predict` one
     column per task, the servable ONNX export one output per task;
  3. does the same from an ONNX file torch exported (`tutorials/models/esmm.onnx`, outputs `ctr`
     and `ctcvr`): `from_onnx(path, losses={"ctr": ("bce", "click"), "ctcvr": ("bce", "buy")})`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from runtime import evaluate, export, predict, train
from runtime.data import SyntheticMultiTask
from transpiler import TranspileConfig, from_onnx, transpile
from transpiler import builder as nn
from transpiler.models import esmm

MODELS = Path(__file__).resolve().parent / "models"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="ESMM: multi-task training with an AUC per task")
    ap.add_argument("--steps", type=int, default=400, help="training steps (one global batch each)")
    ap.add_argument("--batch", type=int, default=256, help="examples per global batch")
    ap.add_argument("--ctcvr-weight", type=float, default=1.0, help="weight of the ctcvr loss")
    ap.add_argument("--out", default=None, help="checkpoint and export directory (default: a temp dir)")
    return ap.parse_args(argv)


def _auc_line(aucs: dict[str, float]) -> str:
    return ", ".join(f"{task} {a:.3f}" for task, a in aucs.items())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hetps-esmm-"))

    # 1. Build and train. The data has click and buy labels (buy only on clicked impressions).
    model = esmm(vocab=1000, weights={"ctcvr": args.ctcvr_weight}, optimizer=nn.Adam(lr=0.003))
    plan = transpile(model.main)
    print(f"tasks {plan.tasks}; feeds {model.feeds}")
    print(plan.summary())
    data = SyntheticMultiTask(vocab=1000, seed=3)
    hist = train(
        plan,
        data,
        steps=args.steps,
        batch_size=args.batch,
        trainers={"cpu": 2, "gpu": 1},
        mode="sync",
        allow_emulation=True,
        checkpoint=str(out / "ckpt"),
        checkpoint_every=args.steps,
        metrics=str(out / "run.jsonl"),
    )
    window = max(1, min(20, args.steps // 4))
    first, last = float(np.mean(hist.loss[:window])), float(np.mean(hist.loss[-window:]))
    recent = {t: float(np.nanmean(v[-window:])) for t, v in hist.task_auc.items()}
    print(f"{hist.steps} steps; loss {first:.4f} -> {last:.4f}")
    print(f"AUC per task over the last {window} steps: {_auc_line(recent)}")

    # 2. Held-out scores from the checkpoint: per-task AUC, a prediction column per task, the export.
    held = list(data.batches(1024, 4, start=10**6))
    scores = evaluate(plan, held, checkpoint=out / "ckpt")
    held_auc = {t: scores[f"auc_{t}"] for t in plan.tasks}
    print(f"held-out: loss {scores['loss']:.4f}; AUC {_auc_line(held_auc)}")
    preds = predict(plan, held, checkpoint=out / "ckpt")
    below = bool((preds[:, 1] <= preds[:, 0] + 1e-6).all())
    print(f"predict: {preds.shape}, a column per task {plan.tasks}; pCTCVR <= pCTR everywhere: {below}")
    served = export(plan, out / "esmm_servable.onnx", checkpoint=out / "ckpt")
    import onnx

    outputs = [o.name for o in onnx.load(str(served)).graph.output]
    print(f"servable export {served.name}: outputs {outputs}")

    # 3. The same model family from ONNX: a loss per graph output, against its own label input.
    program = from_onnx(MODELS / "esmm.onnx", losses={"ctr": ("bce", "click"), "ctcvr": ("bce", "buy")})
    onnx_plan = transpile(program, TranspileConfig(optimizer={"type": "adam", "lr": 0.01}))
    small = SyntheticMultiTask(vocab=40, num_slots=3, num_dense=4, seed=4)  # the exported model's sizes
    onnx_hist = train(
        onnx_plan,
        small,
        steps=args.steps,
        batch_size=args.batch,
        trainers={"cpu": 1, "gpu": 1},
        allow_emulation=True,
        progress=False,
    )
    onnx_auc = {t: float(np.nanmean(v[-window:])) for t, v in onnx_hist.task_auc.items()}
    print(f"esmm.onnx: {onnx_hist.steps} steps; AUC over the last {window} steps: {_auc_line(onnx_auc)}")
    return {
        "loss_first": first,
        "loss_last": last,
        "train_auc": recent,
        "held_out_auc": held_auc,
        "predict_shape": preds.shape,
        "servable_outputs": outputs,
        "onnx_auc": onnx_auc,
    }


if __name__ == "__main__":  # trainers are spawned processes: a script needs this guard
    main()
