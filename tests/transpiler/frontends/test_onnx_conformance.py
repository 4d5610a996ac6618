"""ONNX's own conformance cases through from_onnx + Executor.

1. Node cases, regenerated from the installed onnx (`collect_testcases()`: each a model plus input
   and expected output arrays). Every case whose ops are all ones hetps imports runs, one test per
   case, and must match (rtol 1e-3 float16/float32, 1e-6 float64; ints and bools exactly). Cases
   whose tensors use dtypes outside DTYPES (bfloat16, float8, int4, strings, ...), or
   sequence/optional values, are skipped with that reason. Training-mode Dropout with ratio > 0
   draws a random mask (the expected arrays hold numpy's draw, which no backend reproduces): those
   cases are checked on everything that is determined (the kept elements scaled by 1 / (1 - ratio),
   the keep rate, the mask).
2. The pytorch-converted and pytorch-operator models shipped in the onnx wheel (opsets 6 and 9,
   upgraded by onnx's version converter), those whose ops are covered, on their stored data sets.
3. Export: for all of these, to_onnx(from_onnx(m)) passes onnx.checker and onnxruntime runs it to
   the expected outputs (skipped only where onnxruntime cannot run m itself).

`test_summary` prints the counts (run `pytest -s` or read the captured output).
"""

from __future__ import annotations

import glob
import os
import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from runtime import Executor
from transpiler import from_onnx, to_onnx
from transpiler.frontends.onnx.importer import supported_onnx_ops

DTYPES = {
    np.dtype(t)
    for t in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
    )
}
COVERED = set(supported_onnx_ops())
WHEEL_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
RESULTS: dict[str, list[str]] = {"node": [], "model": [], "node_round_trip": [], "model_round_trip": []}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # log(0) = -inf is ONNX semantics


def _covered(model: onnx.ModelProto) -> bool:
    return all(n.domain in ("", "ai.onnx") and n.op_type in COVERED for n in model.graph.node)


def _arrays(values) -> list:
    out = []
    for v in values:
        if isinstance(v, onnx.TensorProto):
            v = numpy_helper.to_array(v)
        out.append(np.asarray(v) if isinstance(v, np.generic) else v)
    return out


def _skip_reason(arrays: list) -> str | None:
    if any(not isinstance(a, np.ndarray) for a in arrays):
        return "sequence / optional values (hetps imports tensors only)"
    odd = sorted({str(a.dtype) for a in arrays if a.dtype not in DTYPES})
    return f"dtype {', '.join(odd)} outside {', '.join(sorted(map(str, DTYPES)))}" if odd else None


def _node_cases():
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    return cases


ALL_NODE_CASES = _node_cases()
NODE_CASES = [c for c in ALL_NODE_CASES if _covered(c.model)]
MODEL_DIRS = sorted(
    d
    for kind in ("pytorch-converted", "pytorch-operator")
    for d in glob.glob(os.path.join(WHEEL_DATA, kind, "test_*"))
    if _covered(onnx.load(os.path.join(d, "model.onnx")))
)


def _feed(model: onnx.ModelProto, inputs: list) -> dict:
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    return dict(zip(names, inputs, strict=True))


def _run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    program = from_onnx(model)
    return Executor().run(program, feed=feed, fetch_list=[o.name for o in model.graph.output])


def _compare(model: onnx.ModelProto, got: list, expected: list, atol: float = 1e-7) -> None:
    for out, g, e in zip(model.graph.output, got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, (
            f"output {out.name}: got {g.dtype}{list(g.shape)}, expected {e.dtype}{list(e.shape)}"
        )
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(
                g,
                e,
                rtol=1e-6 if e.dtype == np.float64 else 1e-3,
                atol=atol,
                equal_nan=True,
                err_msg=f"output {out.name}",
            )
        else:
            np.testing.assert_array_equal(g, e, err_msg=f"output {out.name}")


def _random_dropout(model: onnx.ModelProto, feed: dict) -> tuple[float, str] | None:
    """(ratio, data input) of a training-mode Dropout with ratio > 0, else None."""
    for n in model.graph.node:
        if n.op_type == "Dropout" and len(n.input) > 2 and n.input[2] and bool(feed[n.input[2]]):
            ratio = float(feed[n.input[1]]) if n.input[1] else 0.5
            if ratio > 0:
                return ratio, n.input[0]
    return None


def _check_random_dropout(model, feed, got, expected, ratio, x_name) -> None:
    """Same scaling of kept elements as ONNX's expected output; a keep rate within 4 sigma of
    1 - ratio; our mask output (when asked) marks exactly the kept elements."""
    x = feed[x_name]
    y, e = got[0], expected[0]
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / (1 - ratio), rtol=1e-6)
    np.testing.assert_allclose(e[e != 0], x[e != 0] / (1 - ratio), rtol=1e-6)  # ONNX's rule, too
    n, p = x.size, 1 - ratio
    assert abs(kept.sum() - n * p) <= 4 * np.sqrt(n * p * (1 - p)) + 1
    if len(got) > 1:
        np.testing.assert_array_equal(got[1], kept)


@pytest.mark.parametrize("case", NODE_CASES, ids=[c.name for c in NODE_CASES])
def test_node_case(case) -> None:
    inputs, expected = (_arrays(v) for v in case.data_sets[0])
    reason = _skip_reason(inputs + expected)
    if reason:
        pytest.skip(reason)
    feed = _feed(case.model, inputs)
    got = _run(case.model, feed)
    dropout = _random_dropout(case.model, feed)
    if dropout:
        _check_random_dropout(case.model, feed, got, expected, *dropout)
    else:
        _compare(case.model, got, expected)
    RESULTS["node"].append(case.name)


def _data_set(path: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return tuple(
        [numpy_helper.to_array(onnx.load_tensor(f)) for f in sorted(glob.glob(f"{path}/{k}_*.pb"))]
        for k in ("input", "output")
    )


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=[os.path.basename(d) for d in MODEL_DIRS])
def test_pytorch_model(model_dir: str) -> None:
    model = onnx.load(os.path.join(model_dir, "model.onnx"))
    program = from_onnx(os.path.join(model_dir, "model.onnx"))
    sets = sorted(glob.glob(os.path.join(model_dir, "test_data_set_*")))
    assert sets
    for ds in sets:
        inputs, expected = _data_set(ds)
        got = Executor().run(
            program, feed=_feed(model, inputs), fetch_list=[o.name for o in model.graph.output]
        )
        _compare(model, got, expected)
    RESULTS["model"].append(os.path.basename(model_dir))


def _ort_outputs(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # no warnings about old opsets
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run([o.name for o in model.graph.output], feed)


def _assert_round_trip(model: onnx.ModelProto, feed: dict, expected: list) -> None:
    """to_onnx(from_onnx(model)) passes the checker and onnxruntime runs it to the expected outputs
    (skipped only where onnxruntime cannot run the original either)."""
    exported = to_onnx(from_onnx(model))
    onnx.checker.check_model(exported, full_check=True)
    try:
        got = _ort_outputs(exported, feed)
    except Exception as e:  # noqa: BLE001 - any onnxruntime refusal
        try:
            _ort_outputs(model, feed)
        except Exception as original:  # noqa: BLE001
            pytest.skip(f"onnxruntime cannot run the original model: {str(original).splitlines()[0][:200]}")
        raise AssertionError(f"onnxruntime runs the original but not the export: {e}") from e
    _compare(model, got, expected, atol=1e-5)  # onnxruntime's float kernels approximate a bit more


@pytest.mark.parametrize("case", NODE_CASES, ids=[c.name for c in NODE_CASES])
def test_node_case_round_trip(case) -> None:
    inputs, expected = (_arrays(v) for v in case.data_sets[0])
    reason = _skip_reason(inputs + expected)
    if reason:
        pytest.skip(reason)
    feed = _feed(case.model, inputs)
    if _random_dropout(case.model, feed):
        pytest.skip("training-mode Dropout: a random mask")
    _assert_round_trip(case.model, feed, expected)
    RESULTS["node_round_trip"].append(case.name)


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=[os.path.basename(d) for d in MODEL_DIRS])
def test_pytorch_model_round_trip(model_dir: str) -> None:
    model = onnx.load(os.path.join(model_dir, "model.onnx"))
    inputs, expected = _data_set(os.path.join(model_dir, "test_data_set_0"))
    _assert_round_trip(model, _feed(model, inputs), expected)
    RESULTS["model_round_trip"].append(os.path.basename(model_dir))


def test_summary(capsys) -> None:
    """The counts (the per-case tests above are the checks); fails if a case was silently lost."""
    skipped, dtypes = Counter(), set()
    for c in NODE_CASES:
        arrays = _arrays(c.data_sets[0][0]) + _arrays(c.data_sets[0][1])
        reason = _skip_reason(arrays)
        if reason:
            skipped["other dtypes" if reason.startswith("dtype") else "sequence/optional values"] += 1
            dtypes |= {str(a.dtype) for a in arrays if isinstance(a, np.ndarray) and a.dtype not in DTYPES}
    runnable = len(NODE_CASES) - sum(skipped.values())
    assert runnable > 800 and len(MODEL_DIRS) >= 60  # the selection itself did not collapse
    with capsys.disabled():
        print(
            f"\nONNX node cases: {len(ALL_NODE_CASES)} in onnx {onnx.__version__}, "
            f"{len(NODE_CASES)} use only covered ops; {len(RESULTS['node'])}/{runnable} passed in "
            f"this run; skipped: {dict(skipped)} (dtypes: {', '.join(sorted(dtypes))})"
        )
        print(
            f"pytorch-converted/-operator models with covered ops: {len(RESULTS['model'])}/"
            f"{len(MODEL_DIRS)} passed in this run"
        )
        print(
            f"to_onnx(from_onnx(m)) in onnxruntime matched the expected outputs: "
            f"{len(RESULTS['node_round_trip'])} node cases, "
            f"{len(RESULTS['model_round_trip'])} pytorch models"
        )
