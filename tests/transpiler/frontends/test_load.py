"""`transpiler.frontends.load.load_model`: a model file (or save prefix) of any kind hetps reads -> Program,
and clear errors for paths that hold none."""

from __future__ import annotations

from pathlib import Path

import pytest

from transpiler import builder as nn
from transpiler import transpile
from transpiler.frontends.load import ModelFileError, load_model, model_kind
from transpiler.models import wide_deep

ONNX = Path(__file__).parents[2] / "models" / "p2o_scalar_loss.onnx"


def test_saved_program_loads_as_saved(tmp_path):
    prog = wide_deep(vocab=50, optimizer=nn.SGD(0.1)).main
    prog.save(tmp_path / "wd")
    for given in (tmp_path / "wd", tmp_path / "wd.json"):  # prefix or file
        assert model_kind(given) == ("hetps", tmp_path / "wd.json")
        assert load_model(given).to_dict() == prog.to_dict()


def test_onnx_model_is_imported():
    assert model_kind(ONNX) == ("onnx", ONNX)
    prog = load_model(ONNX)
    assert prog.attrs.get("loss_name") and any(op.type == "data" for op in prog.ops)


def test_onnx_options_are_refused_for_other_models(tmp_path):
    wide_deep(vocab=50).main.save(tmp_path / "wd")
    with pytest.raises(ModelFileError, match="loss apply to ONNX models only"):
        load_model(tmp_path / "wd", loss="bce")


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda d: d / "missing", "no model at"),
        (lambda d: (d / "x.json").write_text('{"a": 1}') and d / "x.json", "neither a saved hetps program"),
        (lambda d: transpile(wide_deep(vocab=50).main).save(d / "plan"), "already a plan directory"),
    ],
)
def test_paths_without_a_model_are_named(tmp_path, make, fragment):
    with pytest.raises(ModelFileError, match=fragment):
        load_model(make(tmp_path))
