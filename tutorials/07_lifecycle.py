"""Tutorial 07: a model's life after `train` — checkpoints, an interruption, resume, export, serving.

    python tutorials/07_lifecycle.py                     # 200 steps, checkpoints every 40
    python tutorials/07_lifecycle.py --steps 40 --every 10   # small (what the tests run)

What it does:
  1. builds Wide&Deep, transpiles it and saves the plan directory;
  2. starts training on the command line, as you would in a shell:
        hetps train PLAN --data synthetic --steps 200 --checkpoint ckpt --checkpoint-every 40 \\
                    --eval-data synthetic:seed=0 --eval-every 40
     and presses Ctrl-C (SIGINT) once the first checkpoint is written: the run stops, its
     processes end, the checkpoint stays (ckpt/step-00000040: every table with Adam's moments and
     bias-correction powers, the step, the plan's hash);
  3. resumes with the Python API, `train(plan, data, steps=200, resume="ckpt", eval_data=held_out)`:
     steps count the whole run, so it trains the remaining steps on the batches the interrupted
     run would have seen, evaluating the held-out set every 40 steps and at the end;
  4. `runtime.evaluate` / `runtime.predict` score the held-out set from the final checkpoint;
  5. `runtime.export` writes one standard ONNX model (inputs: sparse ids and dense features; output:
     the click probability; the trained tables as initializers), which onnxruntime — a serving
     runtime that knows nothing of hetps — scores: its predictions equal `runtime.predict`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import evaluate, export, predict, train  # noqa: E402
from runtime.data import SyntheticCTR  # noqa: E402
from runtime.driver.checkpoints import checkpoints, latest  # noqa: E402
from runtime.evaluation.metrics import auc  # noqa: E402
from transpiler import builder as nn  # noqa: E402
from transpiler import transpile  # noqa: E402
from transpiler.models import wide_deep  # noqa: E402

VOCAB, SLOTS, BATCH = 2000, 8, 256


@contextlib.contextmanager
def ctrl_c_enabled():
    """Let the processes started inside take Ctrl-C (SIGINT), as a run started from a terminal does.
    A program that a shell started in the background (`python ... &`, some CI runners) ignores SIGINT,
    and so would every process it starts; a handler, unlike "ignore", is reset to the default in the
    started process."""
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before == signal.SIG_IGN:
            signal.signal(signal.SIGINT, before)


def interrupted_run(plan_dir: Path, ckpt: Path, steps: int, every: int, log: Path) -> int:
    """`hetps train ...` in a shell, stopped with Ctrl-C once its first checkpoint exists; the step
    of the checkpoint it left."""
    cmd = [
        sys.executable,
        "-m",
        "runtime.cli",
        "train",
        str(plan_dir),
        "--data",
        "synthetic",
        "--batch-size",
        str(BATCH),
        "--steps",
        str(steps),
        "--checkpoint",
        str(ckpt),
        "--checkpoint-every",
        str(every),
        "--eval-data",
        "synthetic:seed=0",
        "--eval-every",
        str(every),
        "--allow-emulation",
        "--no-progress",
    ]
    print("$ hetps " + " ".join(cmd[3:]))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out, ctrl_c_enabled():
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not checkpoints(ckpt) or not (checkpoints(ckpt)[0] / "manifest.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the run ended before its first checkpoint:\n{log.read_text()}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        rc = proc.wait(120)
    if rc == 0:
        raise RuntimeError(f"the run finished before Ctrl-C stopped it; try more --steps:\n{log.read_text()}")
    print(f"^C  (hetps exited with {rc}: {log.read_text().strip().splitlines()[-1]})")
    step = int(latest(ckpt).name.split("-")[1])
    print(f"left checkpoint {latest(ckpt)} (step {step})")
    return step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=40, help="steps between checkpoints and evaluations")
    p.add_argument("--held-out", type=int, default=8, help="held-out batches of 256 examples")
    p.add_argument("--out", help="directory for the plan, checkpoints and model (default: a temp dir)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="hetps-tutorial07-"))

    # 1. the model and its plan
    model = wide_deep(num_slots=SLOTS, vocab=VOCAB, dim=8, hidden=(64, 32), optimizer=nn.Adam(lr=0.01))
    plan = transpile(model.main)
    plan.save(out / "plan")
    data = SyntheticCTR(vocab=VOCAB, num_slots=SLOTS)
    held_out = [data.batch(10**6 + i, BATCH) for i in range(args.held_out)]  # never trained on

    # 2. a run on the command line, interrupted
    ckpt = out / "ckpt"
    stopped_at = interrupted_run(out / "plan", ckpt, args.steps, args.every, out / "first-run.log")

    # 3. resume: the remaining steps, with held-out evaluation
    hist = train(
        plan,
        data,
        steps=args.steps,
        batch_size=BATCH,
        resume=str(ckpt),
        checkpoint=str(ckpt),
        checkpoint_every=args.every,
        eval_data=held_out,
        eval_every=args.every,
        trainers={"cpu": 2, "gpu": 1},
        allow_emulation=True,
    )
    last = hist.first_step + hist.steps - 1
    print(f"resumed at step {hist.first_step}: trained steps {hist.first_step}-{last}")
    for e in hist.eval:
        print(f"  held-out at step {e['step']:>4}: loss {e['loss']:.4f}  AUC {e['auc']:.4f}")

    # 4. evaluate and predict from the final checkpoint
    final = latest(ckpt)
    scores = evaluate(plan, held_out, checkpoint=str(final))
    pred = predict(plan, held_out, checkpoint=str(final))
    print(
        f"runtime.evaluate({final.name}): loss {scores['loss']:.4f}, AUC {scores['auc']:.4f} "
        f"on {scores['examples']} held-out examples"
    )

    # 5. a servable export, scored by onnxruntime
    import onnxruntime as ort

    path = export(plan, out / "model.onnx", checkpoint=str(final))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    print(
        f"exported {path} ({path.stat().st_size / 1e6:.1f} MB): inputs "
        f"{[(i.name, i.shape) for i in sess.get_inputs()]}, output {sess.get_outputs()[0].name}"
    )
    served = np.concatenate(
        [sess.run(None, {"sparse": b["sparse"], "dense": b["dense"]})[0] for b in held_out]
    )
    labels = np.concatenate([b["label"] for b in held_out]).ravel()
    served_auc = auc(labels, served.ravel())
    diff = float(np.max(np.abs(served - pred)))
    print(f"onnxruntime: held-out AUC {served_auc:.4f}; max |onnxruntime - runtime.predict| = {diff:.2e}")
    return {
        "stopped_at": stopped_at,
        "first_step": hist.first_step,
        "steps": hist.steps,
        "eval": hist.eval,
        "auc": scores["auc"],
        "served_auc": served_auc,
        "max_diff": diff,
        "out": out,
    }


if __name__ == "__main__":
    main()
