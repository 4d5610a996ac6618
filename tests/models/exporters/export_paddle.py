"""Export the exporter matrix's Paddle models to ONNX with paddle2onnx (issue 14 item 4): run by
hand; the .onnx files beside this script are committed, so the tests need neither paddle2onnx nor
its onnx pin (paddle2onnx 2.1 wants onnx 1.17: use a virtual environment of its own).

    python -m venv --system-site-packages venv-p2o && venv-p2o/bin/pip install paddle2onnx
    venv-p2o/bin/python tests/models/exporters/export_paddle.py

The same five models as export_torch.py (same sizes, inputs and output `prob`), written with
paddle.nn, saved with paddle.jit.save (batch dynamic) and converted at opset 18. DLRM pools each
slot's bag of 2 ids with a sum (Paddle has no EmbeddingBag). A model that fails is reported and
skipped. Also tests/models/p2o_scalar_loss.onnx: a model whose output is its loss, for the lenient
shapes (test_onnx_fidelity).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import paddle
from paddle import nn
from paddle.static import InputSpec

HERE = Path(__file__).resolve().parent
VOCAB, DIM, SLOTS, DENSE, SEQ = 40, 4, 3, 4, 5
OPSET = 18


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Layer] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.embs = nn.LayerList([nn.Embedding(VOCAB, DIM) for _ in range(SLOTS)])
        self.bottom = mlp([DENSE, 8, DIM])
        n = SLOTS + 1
        self.rows, self.cols = zip(*[(i, j) for i in range(n) for j in range(i + 1, n)], strict=True)
        self.top = mlp([DIM + n * (n - 1) // 2, 8, 1])

    def forward(self, sparse, dense):
        x = self.bottom(dense)
        vecs = [x] + [emb(sparse[:, 2 * i : 2 * i + 2]).sum(axis=1) for i, emb in enumerate(self.embs)]
        v = paddle.stack(vecs, axis=1)
        inter = paddle.bmm(v, v.transpose([0, 2, 1]))
        pairs = [(self.rows[k], self.cols[k]) for k in range(len(self.rows))]  # (dy2st: no zip(strict))
        dots = paddle.stack([inter[:, i, j] for i, j in pairs], axis=1)
        return paddle.nn.functional.sigmoid(self.top(paddle.concat([x, dots], axis=1)))


class DeepFM(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.first = nn.Embedding(VOCAB, 1)
        self.deep = mlp([SLOTS * DIM + DENSE, 8, 1])

    def forward(self, sparse, dense):
        e = self.emb(sparse)
        fm = 0.5 * (e.sum(axis=1).pow(2) - e.pow(2).sum(axis=1)).sum(axis=1, keepdim=True)
        first = self.first(sparse).sum(axis=1)
        deep = self.deep(paddle.concat([e.flatten(1), dense], axis=1))
        return paddle.nn.functional.sigmoid(first + fm + deep)


class DCNv2(nn.Layer):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        width = SLOTS * DIM + DENSE
        self.cross = nn.LayerList([nn.Linear(width, width) for _ in range(layers)])
        self.deep = mlp([width, 8, 8])
        self.out = nn.Linear(width + 8, 1)

    def forward(self, sparse, dense):
        x0 = paddle.concat([self.emb(sparse).flatten(1), dense], axis=1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        deep = paddle.nn.functional.relu(self.deep(x0))
        return paddle.nn.functional.sigmoid(self.out(paddle.concat([x, deep], axis=1)))


class DIN(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(VOCAB, DIM)
        self.att = mlp([4 * DIM, 8, 1])
        self.deep = mlp([2 * DIM + DENSE, 8, 1])

    def forward(self, hist, mask, target, dense):
        h = self.item(hist)
        t = self.item(target).unsqueeze(1).tile([1, SEQ, 1])  # expand_as: paddle2onnx 2.1 writes an
        # Expand to [-1, 5, 4], which onnxruntime refuses ("invalid expand shape")
        scores = self.att(paddle.concat([h, t, h - t, h * t], axis=-1)).squeeze(-1)
        scores = paddle.where(mask == 0, paddle.full_like(scores, -1e9), scores)
        w = paddle.nn.functional.softmax(scores, axis=1).unsqueeze(-1)
        interest = (w * h).sum(axis=1)
        return paddle.nn.functional.sigmoid(self.deep(paddle.concat([interest, t[:, 0], dense], axis=1)))


class XDeepFM(nn.Layer):
    def __init__(self, sizes: tuple[int, ...] = (4, 4)) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        prev, self.cin = SLOTS, nn.ParameterList()
        for h in sizes:
            self.cin.append(self.create_parameter([h, prev, SLOTS]))
            prev = h
        self.cin_out = nn.Linear(sum(sizes), 1)
        self.deep = mlp([SLOTS * DIM + DENSE, 8, 1])

    def forward(self, sparse, dense):
        x0 = self.emb(sparse)
        x, pooled = x0, []
        for w in self.cin:
            x = paddle.einsum("bid,bjd,hij->bhd", x, x0, w)
            pooled.append(x.sum(axis=2))
        cin = self.cin_out(paddle.concat(pooled, axis=1))
        return paddle.nn.functional.sigmoid(cin + self.deep(paddle.concat([x0.flatten(1), dense], axis=1)))


class WideDeepLoss(nn.Layer):
    """A wide & deep model whose output is its mean bce loss (a 0-d tensor): paddle2onnx declares
    the output a scalar while its graph computes [1] (issue 14's held-out Wide&Deep)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc = nn.Linear(SLOTS * DIM + DENSE, 1)

    def forward(self, sparse, dense, label):
        p = paddle.nn.functional.sigmoid(self.fc(paddle.concat([self.emb(sparse).flatten(1), dense], axis=1)))
        eps = 1e-7  # (binary_cross_entropy itself: paddle2onnx 2.1 has no converter for it)
        return -(label * paddle.log(p + eps) + (1 - label) * paddle.log(1 - p + eps)).mean()


MODELS = {"dlrm": DLRM, "deepfm": DeepFM, "dcnv2": DCNv2, "din": DIN, "xdeepfm": XDeepFM}


def specs(name: str) -> list[InputSpec]:
    if name == "scalar_loss":
        return [
            InputSpec([None, SLOTS], "int64", "sparse"),
            InputSpec([None, DENSE], "float32", "dense"),
            InputSpec([None, 1], "float32", "label"),
        ]
    if name == "din":
        return [
            InputSpec([None, SEQ], "int64", "hist"),
            InputSpec([None, SEQ], "float32", "mask"),
            InputSpec([None], "int64", "target"),
            InputSpec([None, DENSE], "float32", "dense"),
        ]
    slots = 2 * SLOTS if name == "dlrm" else SLOTS
    return [InputSpec([None, slots], "int64", "sparse"), InputSpec([None, DENSE], "float32", "dense")]


def export(name: str) -> Path:
    import paddle2onnx

    paddle.seed(14)
    model = (WideDeepLoss if name == "scalar_loss" else MODELS[name])()
    model.eval()
    path = HERE.parent / "p2o_scalar_loss.onnx" if name == "scalar_loss" else HERE / f"{name}_p2o.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / name)
        paddle.jit.save(model, prefix, input_spec=specs(name))
        model_file = next(p for p in (f"{prefix}.json", f"{prefix}.pdmodel") if Path(p).exists())
        paddle2onnx.export(
            model_file, f"{prefix}.pdiparams", str(path), opset_version=OPSET, optimize_tool="onnxoptimizer"
        )  # polygraphy would pip-install more
    if name != "scalar_loss":  # that one keeps paddle2onnx's own output name (fetch_name_0)
        _rename_output(path)
    return path


def _rename_output(path: Path) -> None:
    """paddle2onnx names the output after Paddle's variable; call it `prob` as the torch files do."""
    import onnx

    model = onnx.load(str(path))
    old = model.graph.output[0].name
    for n in model.graph.node:
        n.output[:] = ["prob" if o == old else o for o in n.output]
        n.input[:] = ["prob" if i == old else i for i in n.input]
    model.graph.output[0].name = "prob"
    onnx.save(model, str(path))


def main() -> int:
    failed = 0
    for name in [*MODELS, "scalar_loss"]:
        try:
            print("wrote", export(name).name)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            failed += 1
            print(f"{name} / paddle2onnx: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
