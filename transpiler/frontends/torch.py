"""`from_torch`: a PyTorch `nn.Module` as a hetps Program, through `torch.onnx` in this process.

    program = from_torch(model, (ids, dense), input_names=["sparse", "dense"], loss="bce")

The module is exported in eval mode (dropout and batch norm as at inference; hetps's executor
applies training behaviour where the ONNX op allows it) to ONNX in memory with a dynamic batch
axis on every input, then imported by `from_onnx` (its `loss` / `label` / `pred` options). torch
is an optional dependency (`pip install hetps[torch]`). An export that fails is re-raised as a
`ModelImportError` saying what usually causes that failure and what to try.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from typing import Any

from transpiler.errors import ModelImportError
from transpiler.ir import Program

HINTS = (
    ("data-dependent", "Python control flow on tensor values (an `if` on a tensor): use torch.where"),
    ("Unsupported", "an op this torch.onnx exporter has no ONNX form for: try dynamo=True, or a newer opset"),
    ("not supported", "an op or argument the exporter cannot write: try dynamo=True, or a newer opset"),
    ("dynamic", "a shape that depends on the data: keep the batch axis the only dynamic one"),
)


def from_torch(
    module: Any,
    example_inputs: Any,
    loss: str | None = None,
    label: str | None = None,
    *,
    input_names: Sequence[str] | None = None,
    pred: str | None = None,
    opset: int = 17,
    dynamo: bool = False,
) -> Program:
    """Export `module` called on `example_inputs` (a tensor, a tuple of tensors, or a dict
    {input name: tensor}) with torch.onnx and import it as a Program (see the module docstring).

    `input_names`: the Program's feed names, one per input (default: the dict's keys, else
    input_0, input_1, ...): name them as your data's feeds (`sparse`, `dense`, ...). `loss`,
    `label`, `pred`: as for `from_onnx` (`loss="bce"` when the module returns probabilities,
    `"bce_with_logits"` for logits). `dynamo`: use the torch.export-based exporter (needs
    onnxscript) instead of the TorchScript one."""
    try:
        import torch
    except ImportError:
        raise ModelImportError(
            "from_torch needs PyTorch: pip install 'hetps[torch]' (or any torch with torch.onnx)"
        ) from None
    from transpiler.frontends.onnx.importer import from_onnx

    if not isinstance(module, torch.nn.Module):
        raise ModelImportError(f"from_torch takes a torch.nn.Module, got {type(module).__name__}")
    args, names = _inputs(example_inputs, input_names, torch)
    was_training = module.training
    module.eval()
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's notice
            torch.onnx.export(
                module,
                args,
                buf,
                input_names=names,
                output_names=["output"],
                dynamic_axes={n: {0: "batch"} for n in [*names, "output"]},
                opset_version=opset,
                dynamo=dynamo,
            )
    except Exception as e:  # the exporters raise many types; each is explained the same way
        raise ModelImportError(_explain(e, type(module).__name__)) from e
    finally:
        module.train(was_training)
    import onnx

    return from_onnx(onnx.load_from_string(buf.getvalue()), loss=loss, label=label, pred=pred)


def _inputs(example: Any, names: Sequence[str] | None, torch: Any) -> tuple[tuple, list[str]]:
    if isinstance(example, dict):
        names = list(names or example)
        example = tuple(example.values())
    elif isinstance(example, torch.Tensor):
        example = (example,)
    example = tuple(example)
    if not all(isinstance(x, torch.Tensor) for x in example):
        raise ModelImportError(
            f"from_torch: example_inputs must be tensors, got {[type(x).__name__ for x in example]}"
        )
    names = list(names or [f"input_{i}" for i in range(len(example))])
    if len(names) != len(example):
        raise ModelImportError(f"from_torch: {len(names)} input_names for {len(example)} example inputs")
    return example, names


def _explain(e: Exception, what: str) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = next((h for key, h in HINTS if key.lower() in str(e).lower()), None)
    return (
        f"torch.onnx could not export {what}: {type(e).__name__}: {text[:300]}"
        + (f"; a likely cause: {hint}" if hint else "")
        + " (the module must run on example_inputs; see torch.onnx's message above for the op)"
    )
