"""`load_model(path) -> Program`: a training program from any model file hetps reads.

A model is an ONNX file (`.onnx`), a saved PaddlePaddle training program (`paddle.static.save`
prefix: `.pdmodel` for the legacy IR, `.json` + `.pdparams` for PIR) or a saved hetps program
(`Program.save`: `.json` [+ `.npz`]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from transpiler.errors import ModelImportError
from transpiler.ir import Program


class ModelFileError(ModelImportError):
    """A path that holds no model hetps can read; the message says what was expected."""


def model_kind(path: Path) -> tuple[str, Path]:
    """("onnx" | "paddle-legacy" | "paddle-pir" | "hetps", path) of a model file or file prefix."""
    path = Path(path)
    if path.suffix == ".onnx" and path.is_file():
        return "onnx", path
    for suffix, kind in ((".pdmodel", "paddle-legacy"), (".json", None)):
        f = path if path.suffix == suffix else Path(f"{path}{suffix}")
        if not f.is_file():
            continue
        if kind:
            return kind, f
        if f.with_suffix(".pdparams").is_file():
            return "paddle-pir", f
        try:
            is_program = "blocks" in json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            is_program = False
        if is_program:
            return "hetps", f
        raise ModelFileError(
            f"{f} is neither a saved hetps program (JSON with 'blocks') nor a saved "
            "PIR Paddle program (no .pdparams beside it)"
        )
    if path.is_dir() and (path / "plan.json").is_file():
        raise ModelFileError(f"{path} is already a plan directory; use it with inspect / draw / train")
    raise ModelFileError(
        f"no model at {path}: expected an .onnx file, a paddle.static.save prefix "
        "(.pdmodel, or .json + .pdparams) or a hetps Program.save file (.json)"
    )


def load_model(path: str | Path, **onnx_options: Any) -> Program:
    """The training Program in the model file (or paddle.static.save prefix) at `path`.
    `onnx_options` go to `transpiler.from_onnx` (loss, label, dynamic_batch, pred, log_clamp) and
    are refused for other kinds of model."""
    kind, f = model_kind(Path(path))
    if kind == "onnx":
        from transpiler.frontends.onnx.importer import from_onnx

        return from_onnx(f, **onnx_options)
    given = [k for k, v in onnx_options.items() if v is not None and (k, v) != ("dynamic_batch", True)]
    if given:
        raise ModelFileError(f"{', '.join(given)} apply to ONNX models only; {f} is a {kind} program")
    if kind == "hetps":
        return Program.load(f)
    return load_paddle(kind, f)


def load_paddle(kind: str, path: Path) -> Program:
    """A saved Paddle training program (`paddle.static.save`) with its saved values, imported."""
    import paddle

    from transpiler.frontends.paddle.importer import from_paddle

    paddle.enable_static()
    prefix = str(path.with_suffix(""))
    if kind == "paddle-legacy":
        with paddle.pir_utils.OldIrGuard():
            program = paddle.static.Program.parse_from_string(path.read_bytes())
            # a parsed ProgramDesc forgets which vars were data: those read, never written, not persistable
            block = program.global_block()
            written = {n for op in block.ops for n in op.output_arg_names}
            for n in {n for op in block.ops for n in op.input_arg_names} - written:
                if not block.var(n).persistable:
                    block.var(n).is_data = True
            return from_paddle(program, scope=_paddle_scope(paddle, prefix))
    program = paddle.static.Program()
    paddle.base.core.deserialize_pir_program(str(path), program, 1)
    return from_paddle(program, scope=_paddle_scope(paddle, prefix))


def _paddle_scope(paddle: Any, prefix: str) -> Any:
    scope = paddle.static.Scope()
    for name, value in paddle.static.load_program_state(prefix).items():
        scope.var(name).get_tensor().set(np.asarray(value), paddle.CPUPlace())
    return scope
