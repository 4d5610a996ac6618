"""The reference cases whose transpiled plans tests/data/pipeline_04bed3d.json holds as commit
04bed3d made them (before transpile was a pipeline of passes): program and config per case."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transpiler import Program, TranspileConfig, from_onnx, models
from transpiler import builder as nn

DATA = Path(__file__).parents[1] / "data"


def _wide_deep() -> tuple[Program, TranspileConfig]:
    return models.wide_deep(vocab=100, dim=4, optimizer=nn.SGD(lr=0.1)).main, TranspileConfig()


def _wide_deep_three_stage() -> tuple[Program, TranspileConfig]:
    m = models.wide_deep(num_slots=5, vocab=40, dim=4, num_dense=6, hidden=(16, 8), optimizer=nn.Adam(0.01))
    return m.main, TranspileConfig(op_type_devices={"sigmoid_cross_entropy_with_logits": "cpu"})


def _dlrm() -> tuple[Program, TranspileConfig]:
    m = models.dlrm(num_slots=4, vocab=50, dim=4, optimizer=nn.Adagrad(0.1, initial_accumulator_value=0.1))
    return m.main, TranspileConfig(num_servers=2, sparse_entry={"type": "count", "threshold": 2})


def _onnx_import() -> tuple[Program, TranspileConfig]:
    """No backward ops: transpile appends them, and config.optimizer trains every table."""
    program = from_onnx(DATA / "wide_deep.onnx", loss="bce")
    return program, TranspileConfig(optimizer={"type": "adam", "lr": 0.01}, num_servers=3)


CASES: dict[str, Callable[[], tuple[Program, TranspileConfig]]] = {
    "wide_deep": _wide_deep,
    "wide_deep_three_stage": _wide_deep_three_stage,
    "dlrm": _dlrm,
    "onnx_import": _onnx_import,
}
