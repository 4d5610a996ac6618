"""The exporter matrix (issue 14 item 4): recommendation models that no one here hand-wrote as ONNX,
written in PyTorch and in Paddle and exported by torch's own exporters (TorchScript "ts", "dynamo")
and by paddle2onnx ("p2o"), and one Keras model by tf2onnx (tests/models/exporters/export_torch.py,
export_paddle.py, export_keras.py; the .onnx files are committed, so this needs neither torch,
onnxscript, paddle2onnx nor tensorflow). The convolutional
models (xDeepFM's CIN as Conv1d, CCPM) and the multi-task ones (ESMM, MMOE: two outputs, a bce
loss each, `from_onnx(losses=...)`) are torch-only rows.

For each model x exporter: it imports; its forward equals onnxruntime's on the same file (1e-5);
its gradients (the graph in float64, a bce loss attached) agree with central differences; and it
trains heterogeneously (transpiled: tables on parameter servers, lookups on cpu, the MLP on gpu;
simulated) with the loss dropping. docs/onnx.md shows the same table. DIEN (two nn.GRU) is written
in PyTorch only. One model per family (xdeepfm_conv, CCPM, DIEN; the multi-task ones in
test_multi_task.py, the tf2onnx cell against TensorFlow) follows its framework's own SGD steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from test_onnx_gradients import _assert_gradients_match
from test_onnx_models import _to_float64

from runtime import Executor
from runtime.exec.simulate import simulate
from transpiler import TranspileConfig, from_onnx, transpile

DIR = Path(__file__).resolve().parents[2] / "models" / "exporters"
VOCAB, SLOTS, DENSE, SEQ = 40, 3, 4, 5  # as in export_torch.py
MODELS = ("dlrm", "deepfm", "dcnv2", "din", "xdeepfm", "dien")
EXPORTERS = ("ts", "dynamo", "p2o")
# Convolutional models exported from torch only: xDeepFM's CIN as Conv1d(kernel_size=1), CCPM.
TORCH_ONLY = ("xdeepfm_conv", "ccpm")
# Cells whose exporter fixed the batch (the dynamo exporter specialised it while tracing einsum).
FIXED_BATCH = {("xdeepfm", "dynamo"): 4}
NOT_EXPORTED = {("dien", "p2o")}  # DIEN is written in PyTorch only (export_torch.py)
CELLS = [(m, e) for m in MODELS for e in EXPORTERS if (m, e) not in NOT_EXPORTED] + [
    (m, e) for m in TORCH_ONLY for e in ("ts", "dynamo")
]
# Keras (TF 2.21) exported by tf2onnx 1.17 (export_keras.py): xDeepFM's CIN as 1x1 Conv2D layers.
CELLS.append(("xdeepfm_conv", "tf2onnx"))
# Multi-task models (torch only): per output the label of its bce loss, as in export_torch.OUTPUTS.
MULTI_TASK = {"esmm": {"ctr": "click", "ctcvr": "buy"}, "mmoe": {"ctr": "click", "cvr": "like"}}
MT_CELLS = [(m, e) for m in MULTI_TASK for e in ("ts", "dynamo")]
# onnxruntime has no float64 Conv kernel on CPU: there ONNX's reference evaluator runs the float64 graph
NO_ORT_FLOAT64 = set(TORCH_ONLY)
ORT_FLOAT32_ONLY = {"dien"}  # onnxruntime's GRU has no double kernel


def _path(model: str, exporter: str) -> Path:
    return DIR / f"{model}_{exporter}.onnx"


def _feed(model: str, batch: int, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(batch, DENSE)).astype(dtype)
    if model in ("din", "dien"):
        lengths = rng.integers(1, SEQ + 1, (batch, 1))
        return {
            "hist": rng.integers(0, VOCAB, (batch, SEQ)),
            "mask": (np.arange(SEQ) < lengths).astype(dtype),
            "target": rng.integers(0, VOCAB, batch),
            "dense": dense,
        }
    slots = 2 * SLOTS if model == "dlrm" else SLOTS
    return {"sparse": rng.integers(0, VOCAB, (batch, slots)), "dense": dense}


def _ort(model: onnx.ModelProto | Path, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feed)


def test_every_cell_has_its_file() -> None:
    want = sorted(_path(m, e).name for m, e in CELLS + MT_CELLS)
    assert sorted(p.name for p in DIR.glob("*.onnx")) == want


@pytest.mark.parametrize("model,exporter", CELLS)
def test_forward_equals_onnxruntime(model: str, exporter: str) -> None:
    program = from_onnx(_path(model, exporter))
    batch = FIXED_BATCH.get((model, exporter), 8)  # not the batch of 4 the models were traced with
    feed = _feed(model, batch, seed=1)
    (got,) = Executor().run(program, feed=feed, fetch_list=program.fetch_names)
    (want,) = _ort(_path(model, exporter), feed)
    assert got.shape == want.shape == (batch, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model,exporter", CELLS)
def test_gradients_match_finite_differences(model: str, exporter: str) -> None:
    m64 = _to_float64(onnx.load(_path(model, exporter)))
    batch = FIXED_BATCH.get((model, exporter), 6)
    feed = _feed(model, batch, seed=2, dtype=np.float64)
    feed["label"] = np.random.default_rng(3).integers(0, 2, (batch, 1)).astype(np.float64)
    program = from_onnx(m64, loss="bce")
    ins = {k: v for k, v in feed.items() if k != "label"}
    rtol, atol = 1e-10, 0.0
    if model in NO_ORT_FLOAT64:
        from onnx.reference import ReferenceEvaluator

        want = ReferenceEvaluator(m64).run(None, ins)[0]
    elif model in ORT_FLOAT32_ONLY:  # the float64 graph is the same model (to float32 precision)
        as32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in ins.items()}
        want = _ort(_path(model, exporter), as32)[0]
        rtol, atol = 1e-5, 1e-6
    else:  # the float64 graph is the same model (onnxruntime's double run)
        want = _ort(m64, ins)[0]
    np.testing.assert_allclose(
        Executor().run(program, feed=feed, fetch_list=program.fetch_names)[0], want, rtol=rtol, atol=atol
    )
    trainable = [v.name for v in program.parameters() if v.trainable]
    assert trainable
    _assert_gradients_match(lambda: from_onnx(m64, loss="bce"), feed, trainable, sample=8)


@pytest.mark.parametrize("model,exporter", CELLS)
def test_trains_heterogeneously(model: str, exporter: str) -> None:
    program = from_onnx(_path(model, exporter), loss="bce")
    plan = transpile(program, TranspileConfig(optimizer={"type": "sgd", "lr": 0.2}))
    assert {"cpu", "gpu"} <= set(plan.programs)  # lookups on cpu, the MLP on gpu
    sparse = [t.name for t in plan.tables if t.kind == "sparse"]
    assert sparse, "no embedding table became a sparse parameter-server table"
    ints = [t.name for t in plan.tables if np.dtype(t.dtype).kind != "f"]
    assert not ints, f"parameter servers hold float tables only; integer constants became tables: {ints}"
    batch = FIXED_BATCH.get((model, exporter), 16)
    feed = _feed(model, batch, seed=4)
    feed["label"] = np.random.default_rng(5).integers(0, 2, (batch, 1)).astype(np.float32)
    losses = [float(x[0]) for x in simulate(plan, [feed] * 12)]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


def _losses(model: str) -> dict[str, tuple[str, str]]:
    return {out: ("bce", label) for out, label in MULTI_TASK[model].items()}


def _labels(model: str, batch: int, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {label: rng.integers(0, 2, (batch, 1)).astype(dtype) for label in MULTI_TASK[model].values()}


@pytest.mark.parametrize("model,exporter", MT_CELLS)
def test_multi_task_forward_equals_onnxruntime(model: str, exporter: str) -> None:
    program = from_onnx(_path(model, exporter))
    feed = _feed(model, 8, seed=1)
    got = Executor().run(program, feed=feed, fetch_list=program.fetch_names)
    want = _ort(_path(model, exporter), feed)
    assert program.fetch_names == list(MULTI_TASK[model]) and len(got) == len(want) == 2
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (8, 1)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model,exporter", MT_CELLS)
def test_multi_task_gradients_match_finite_differences(model: str, exporter: str) -> None:
    """The gradients of the summed task losses (float64 graph) against central differences."""
    m64 = _to_float64(onnx.load(_path(model, exporter)))
    feed = {**_feed(model, 6, seed=2, dtype=np.float64), **_labels(model, 6, 3, np.float64)}
    program = from_onnx(m64, losses=_losses(model))
    trainable = [v.name for v in program.parameters() if v.trainable]
    _assert_gradients_match(lambda: from_onnx(m64, losses=_losses(model)), feed, trainable, sample=8)


@pytest.mark.parametrize("model,exporter", MT_CELLS)
def test_multi_task_trains_heterogeneously(model: str, exporter: str) -> None:
    plan = transpile(
        from_onnx(_path(model, exporter), losses=_losses(model)),
        TranspileConfig(optimizer={"type": "adam", "lr": 0.05}),
    )
    assert plan.tasks == list(MULTI_TASK[model])
    kinds = {t.name: t.kind for t in plan.tables}
    assert kinds.pop("emb.weight") == "sparse" and set(kinds.values()) == {"dense"}  # experts, towers, gates
    lookups = {t for t, p in plan.programs.items() for op in p.ops if op.type == "embedding"}
    gemms = {t for t, p in plan.programs.items() for op in p.ops if op.type == "gemm"}
    assert lookups == {"cpu"} and gemms == {"gpu"}
    feed = {**_feed(model, 16, seed=4), **_labels(model, 16, 5)}
    losses = [float(x[0]) for x in simulate(plan, [feed] * 12)]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses


# One model per remaining family whose training torch also ran (export_torch.py `--steps`, from the
# committed files' weights): CIN as Conv1d, CCPM (Conv2d + topk), DIEN (two nn.GRU).
TORCH_STEPS = ("xdeepfm_conv", "ccpm", "dien")


@pytest.mark.parametrize("model", TORCH_STEPS)
def test_trains_like_torch_own_steps(model: str) -> None:
    """The ts cell trained (transpiled, SGD on the bce loss) follows torch's own SGD steps on the same
    batch from the same weights: the loss before every step (`<model>_torch_steps.npz`)."""
    ref = np.load(DIR / f"{model}_torch_steps.npz")
    plan = transpile(
        from_onnx(_path(model, "ts"), loss="bce"), TranspileConfig(optimizer={"type": "sgd", "lr": 0.2})
    )
    feed = {k: ref[k] for k in ref.files if k != "loss"}
    assert set(feed) == {*_feed(model, 1, seed=0), "label"}
    got = [float(x[0]) for x in simulate(plan, [feed] * len(ref["loss"]))]
    np.testing.assert_allclose(got, ref["loss"], rtol=2e-5)


def test_keras_cell_follows_tensorflow_own_steps() -> None:
    """The tf2onnx cell trained (transpiled, SGD on the bce loss) follows TensorFlow's own SGD steps on
    the same batch from the same weights (export_keras.py saved them)."""
    ref = np.load(DIR / "xdeepfm_conv_tf2onnx_tf_steps.npz")
    program = from_onnx(_path("xdeepfm_conv", "tf2onnx"), loss="bce")
    plan = transpile(program, TranspileConfig(optimizer={"type": "sgd", "lr": 0.2}))
    feed = {k: ref[k] for k in ("sparse", "dense", "label")}
    got = [float(x[0]) for x in simulate(plan, [feed] * len(ref["loss"]))]
    np.testing.assert_allclose(got, ref["loss"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,exporter",
    [("dlrm", "ts"), ("dlrm", "dynamo"), ("din", "dynamo"), ("deepfm", "p2o"), ("dien", "ts")],
)
def test_trains_on_the_real_runtime_like_simulate(model: str, exporter: str) -> None:
    """Trainer and server processes (gpu emulated on CPU): the same losses as simulate."""
    from runtime.driver.train import train

    plan = transpile(
        from_onnx(_path(model, exporter), loss="bce"), TranspileConfig(optimizer={"type": "sgd", "lr": 0.2})
    )
    feed = _feed(model, 16, seed=6)
    feed["label"] = np.random.default_rng(7).integers(0, 2, (16, 1)).astype(np.float32)
    hist = train(
        plan, [feed] * 6, epochs=1, trainers={"cpu": 1, "gpu": 1}, allow_emulation=True, progress=False
    )
    want = [float(x[0]) for x in simulate(plan, [feed] * 6)]
    np.testing.assert_allclose(hist.loss, want, rtol=1e-5)
