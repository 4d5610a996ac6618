"""Export the exporter matrix's PyTorch models to ONNX (issue 14 item 4): run by hand, the .onnx
files beside this script are committed, so the tests need neither torch nor onnxscript.

    python tests/models/exporters/export_torch.py        # needs torch (CPU wheel) and onnxscript
    python tests/models/exporters/export_torch.py ccpm dien   # only the models named
    python tests/models/exporters/export_torch.py --steps ccpm   # only ccpm_torch_steps.npz

Models (small: vocab 40, dim 4; float32; batch dynamic): DLRM (nn.EmbeddingBag per slot, dot
interaction), DeepFM (FM + MLP), DCN-v2 (cross layers), DIN (attention over a behaviour sequence
with a mask), xDeepFM (CIN written with einsum, + MLP), xDeepFM with the CIN as nn.Conv1d(kernel_size=1)
("xdeepfm_conv"), CCPM (k x 1 Conv2d with padding, k-max pooling by topk), DIEN (nn.GRU over the
behaviour sequence, attention, a second nn.GRU over the attention-weighted states). Each outputs the
click probability `prob` [batch, 1], except the multi-task ESMM (outputs `ctr`, `ctcvr`) and MMOE
(`ctr`, `cvr`). For those two and one model per remaining family (xdeepfm_conv, ccpm, dien), torch's own
SGD steps on one batch are saved as `<name>_torch_steps.npz` (`python export_torch.py --steps NAME...`
writes only those, from the weights of the committed .onnx files).
Exporters: "ts" (TorchScript, torch.onnx.export(dynamo=False))
and "dynamo" (torch.onnx.export(dynamo=True)). A model an exporter cannot export is skipped with its reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
VOCAB, DIM, SLOTS, DENSE, SEQ = 40, 4, 3, 4, 5
OPSET = 18


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    """Bottom MLP on dense features, one EmbeddingBag (sum) per slot over a bag of 2 ids, pairwise
    dot products of the vectors (upper triangle), top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(VOCAB, DIM, mode="sum") for _ in range(SLOTS))
        self.bottom = mlp([DENSE, 8, DIM])
        n = SLOTS + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, 1))
        self.top = mlp([DIM + n * (n - 1) // 2, 8, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vecs = [x] + [bag(sparse[:, 2 * i : 2 * i + 2]) for i, bag in enumerate(self.bags)]
        v = torch.stack(vecs, dim=1)
        dots = torch.bmm(v, v.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return torch.sigmoid(self.top(torch.cat([x, dots], dim=1)))


class DeepFM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.first = nn.Embedding(VOCAB, 1)
        self.deep = mlp([SLOTS * DIM + DENSE, 8, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(sparse)  # [B, S, D]
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1, keepdim=True)
        first = self.first(sparse).sum(1)
        deep = self.deep(torch.cat([e.flatten(1), dense], dim=1))
        return torch.sigmoid(first + fm + deep)


class DCNv2(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        width = SLOTS * DIM + DENSE
        self.cross = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.deep = mlp([width, 8, 8])
        self.out = nn.Linear(width + 8, 1)

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([self.emb(sparse).flatten(1), dense], dim=1)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return torch.sigmoid(self.out(torch.cat([x, torch.relu(self.deep(x0))], dim=1)))


class DIN(nn.Module):
    """Attention of the target item over the user's behaviour sequence; padded steps masked out."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(VOCAB, DIM)
        self.att = mlp([4 * DIM, 8, 1])
        self.deep = mlp([2 * DIM + DENSE, 8, 1])

    def forward(
        self, hist: torch.Tensor, mask: torch.Tensor, target: torch.Tensor, dense: torch.Tensor
    ) -> torch.Tensor:
        h = self.item(hist)  # [B, L, D]
        t = self.item(target).unsqueeze(1).expand_as(h)
        scores = self.att(torch.cat([h, t, h - t, h * t], dim=-1)).squeeze(-1)  # [B, L]
        scores = scores.masked_fill(mask == 0, -1e9)
        w = torch.softmax(scores, dim=1).unsqueeze(-1)
        interest = (w * h).sum(1)
        return torch.sigmoid(self.deep(torch.cat([interest, t[:, 0], dense], dim=1)))


class DIEN(nn.Module):
    """Interest extraction: an nn.GRU over the behaviour sequence; attention of the target over its
    states (padded steps masked out); interest evolution: a second nn.GRU over the
    attention-weighted states (AIGRU), its last state; an MLP over it, the target and the dense
    features."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(VOCAB, DIM)
        self.extract = nn.GRU(DIM, DIM, batch_first=True)
        self.query = nn.Linear(DIM, DIM, bias=False)
        self.evolve = nn.GRU(DIM, DIM, batch_first=True)
        self.deep = mlp([2 * DIM + DENSE, 8, 1])

    def forward(
        self, hist: torch.Tensor, mask: torch.Tensor, target: torch.Tensor, dense: torch.Tensor
    ) -> torch.Tensor:
        states, _ = self.extract(self.item(hist))  # [B, L, D]
        t = self.item(target)
        scores = (states * self.query(t).unsqueeze(1)).sum(-1).masked_fill(mask == 0, -1e9)
        w = torch.softmax(scores, dim=1).unsqueeze(-1)
        _, last = self.evolve(states * w)  # [1, B, D]
        return torch.sigmoid(self.deep(torch.cat([last[0], t, dense], dim=1)))


class XDeepFM(nn.Module):
    """CIN: X^k[h] = sum_{i,j} W^k[h, i, j] X^{k-1}[i] * X^0[j] (elementwise over D), sum-pooled."""

    def __init__(self, sizes: tuple[int, ...] = (4, 4)) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        prev, ws = SLOTS, []
        for h in sizes:
            ws.append(nn.Parameter(torch.randn(h, prev, SLOTS) * 0.3))
            prev = h
        self.cin = nn.ParameterList(ws)
        self.cin_out = nn.Linear(sum(sizes), 1)
        self.deep = mlp([SLOTS * DIM + DENSE, 8, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x0 = self.emb(sparse)  # [B, m, D]
        x, pooled = x0, []
        for w in self.cin:
            x = torch.einsum("bid,bjd,hij->bhd", x, x0, w)
            pooled.append(x.sum(2))
        cin = self.cin_out(torch.cat(pooled, dim=1))
        return torch.sigmoid(cin + self.deep(torch.cat([x0.flatten(1), dense], dim=1)))


class XDeepFMConv(nn.Module):
    """xDeepFM with the CIN written as model libraries write it: the outer products of X^{k-1} and
    X^0 (broadcast Mul), flattened to H_{k-1} * m channels, then nn.Conv1d(kernel_size=1) to H_k
    feature maps, sum-pooled over D."""

    def __init__(self, sizes: tuple[int, ...] = (4, 4)) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        prev, convs = SLOTS, []
        for h in sizes:
            convs.append(nn.Conv1d(prev * SLOTS, h, kernel_size=1))
            prev = h
        self.cin = nn.ModuleList(convs)
        self.cin_out = nn.Linear(sum(sizes), 1)
        self.deep = mlp([SLOTS * DIM + DENSE, 8, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x0 = self.emb(sparse)  # [B, m, D]
        x, pooled = x0, []
        for conv in self.cin:
            z = (x.unsqueeze(2) * x0.unsqueeze(1)).reshape(x0.shape[0], -1, DIM)  # [B, H * m, D]
            x = torch.relu(conv(z))
            pooled.append(x.sum(2))
        cin = self.cin_out(torch.cat(pooled, dim=1))
        return torch.sigmoid(cin + self.deep(torch.cat([x0.flatten(1), dense], dim=1)))


class CCPM(nn.Module):
    """CCPM: the field embeddings as a 1-channel [m, D] image; two k x 1 convolutions over the
    fields, each followed by tanh and k-max pooling over the fields (torch.topk). The first pads
    with F.pad ("same" padding, as deepctr's Conv2dSame does) and keeps the top values sorted; the
    second pads inside nn.Conv2d and keeps the top values in field order (topk indices sorted, then
    gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.conv1 = nn.Conv2d(1, 3, kernel_size=(3, 1))
        self.conv2 = nn.Conv2d(3, 2, kernel_size=(2, 1), padding=(1, 0))
        self.out = nn.Linear(2 * 2 * DIM, 1)
        self.deep = mlp([SLOTS * DIM + DENSE, 8, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.emb(sparse)  # [B, m, D]
        x = torch.tanh(self.conv1(torch.nn.functional.pad(e.unsqueeze(1), [0, 0, 1, 1])))  # [B, 3, m, D]
        x = x.topk(2, dim=2).values  # [B, 3, 2, D]
        x = torch.tanh(self.conv2(x))  # [B, 2, 3, D]
        keep = x.topk(2, dim=2).indices.sort(dim=2).values
        x = x.gather(2, keep)  # [B, 2, 2, D], in field order
        return torch.sigmoid(self.out(x.flatten(1)) + self.deep(torch.cat([e.flatten(1), dense], dim=1)))


class ESMM(nn.Module):
    """ESMM (Ma et al., 2018): shared embeddings; a CTR tower and a CVR tower over them; outputs
    pCTR (`ctr`) and pCTCVR = pCTR x pCVR (`ctcvr`), both trained over all impressions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        width = SLOTS * DIM + DENSE
        self.ctr, self.cvr = mlp([width, 8, 1]), mlp([width, 8, 1])

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.emb(sparse).flatten(1), dense], dim=1)
        p_ctr = torch.sigmoid(self.ctr(x))
        return p_ctr, p_ctr * torch.sigmoid(self.cvr(x))


class MMOE(nn.Module):
    """MMOE (Ma et al., 2018): shared embeddings, 3 expert MLPs, per task a softmax gate over the
    experts and a tower; outputs the two tasks' probabilities `ctr` and `cvr`."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        width = SLOTS * DIM + DENSE
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 8), nn.ReLU()) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(width, experts) for _ in range(2))
        self.towers = nn.ModuleList(mlp([8, 4, 1]) for _ in range(2))

    def forward(self, sparse: torch.Tensor, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.emb(sparse).flatten(1), dense], dim=1)
        e = torch.stack([f(x) for f in self.experts], dim=1)  # [B, E, 8]
        outs = []
        for gate, tower in zip(self.gates, self.towers, strict=True):
            w = torch.softmax(gate(x), dim=1).unsqueeze(2)  # [B, E, 1]
            outs.append(torch.sigmoid(tower((w * e).sum(1))))
        return outs[0], outs[1]


# Multi-task models: their outputs, and per output the label it trains against (a bce loss each).
OUTPUTS = {"esmm": {"ctr": "click", "ctcvr": "buy"}, "mmoe": {"ctr": "click", "cvr": "like"}}


def example(name: str, batch: int = 4) -> tuple[tuple[torch.Tensor, ...], list[str]]:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(batch, DENSE, generator=g)
    if name in ("din", "dien"):
        hist = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        lengths = torch.tensor([5, 3, 1, 4][:batch]).unsqueeze(1)
        mask = (torch.arange(SEQ).expand(batch, SEQ) < lengths).float()  # steps past a length: padding
        target = torch.randint(0, VOCAB, (batch,), generator=g)
        return (hist, mask, target, dense), ["hist", "mask", "target", "dense"]
    slots = 2 * SLOTS if name == "dlrm" else SLOTS
    return (torch.randint(0, VOCAB, (batch, slots), generator=g), dense), ["sparse", "dense"]


MODELS = {
    "dlrm": DLRM,
    "deepfm": DeepFM,
    "dcnv2": DCNv2,
    "din": DIN,
    "xdeepfm": XDeepFM,
    "xdeepfm_conv": XDeepFMConv,
    "ccpm": CCPM,
    "dien": DIEN,
    "esmm": ESMM,
    "mmoe": MMOE,
}


def export(name: str, exporter: str) -> Path:
    torch.manual_seed(14)
    model = MODELS[name]().eval()
    args, names = example(name)
    path = HERE / f"{name}_{exporter}.onnx"
    outputs = list(OUTPUTS.get(name, {"prob": None}))
    if exporter == "ts":
        torch.onnx.export(
            model,
            args,
            str(path),
            input_names=names,
            output_names=outputs,
            opset_version=OPSET,
            dynamic_axes={n: {0: "batch"} for n in [*names, *outputs]},
            dynamo=False,
        )
    else:
        batch = torch.export.Dim("batch", min=1, max=4096)
        program = torch.onnx.export(
            model,
            args,
            input_names=names,
            output_names=outputs,
            opset_version=OPSET,
            dynamic_shapes=tuple({0: batch} for _ in names),
            dynamo=True,
            external_data=False,
        )
        program.save(str(path), external_data=False)
    _strip_metadata(path)
    return path


# Single-output models whose training torch also runs (one per family): a bce loss on `label`.
STEPS = ("xdeepfm_conv", "ccpm", "dien")


def _train_batch(name: str, batch: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A training batch for `name`, its inputs in forward's order."""
    if name in ("din", "dien"):
        hist = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        lengths = torch.randint(1, SEQ + 1, (batch, 1), generator=g)
        mask = (torch.arange(SEQ).expand(batch, SEQ) < lengths).float()
        target = torch.randint(0, VOCAB, (batch,), generator=g)
        return {"hist": hist, "mask": mask, "target": target, "dense": torch.randn(batch, DENSE, generator=g)}
    slots = 2 * SLOTS if name == "dlrm" else SLOTS
    return {
        "sparse": torch.randint(0, VOCAB, (batch, slots), generator=g),
        "dense": torch.randn(batch, DENSE, generator=g),
    }


def _check_exported_weights(name: str, model: nn.Module, feed: dict[str, torch.Tensor]) -> None:
    """The module's forward equals onnxruntime's on the committed `<name>_ts.onnx`: the same weights."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(HERE / f"{name}_ts.onnx"), providers=["CPUExecutionProvider"])
    want = sess.run(None, {k: v.numpy() for k, v in feed.items()})
    with torch.no_grad():
        got = model(*feed.values())
    for g, w in zip(got if isinstance(got, tuple) else (got,), want, strict=True):
        np.testing.assert_allclose(
            g.numpy(), w, rtol=1e-5, atol=1e-6, err_msg=f"{name}: not the file's weights"
        )


def torch_steps(name: str, steps: int = 8, batch: int = 16, lr: float = 0.2) -> Path:
    """Torch's own training of `name` (as exported: the same seed, so the same initial weights,
    checked against the committed `<name>_ts.onnx`) on one batch, plain SGD on the sum of the
    outputs' BCE losses: the batch, labels and the loss (and per-task losses of a multi-task model)
    before each step, saved beside the models as `<name>_torch_steps.npz`."""
    torch.manual_seed(14)
    model = MODELS[name]()
    outputs = OUTPUTS.get(name, {"prob": "label"})
    g = torch.Generator().manual_seed(21)
    feed = _train_batch(name, batch, g)
    labels = {lab: torch.randint(0, 2, (batch, 1), generator=g).float() for lab in outputs.values()}
    if name == "esmm":  # a buy needs a click: the ctcvr label is click & conversion
        labels["buy"] = labels["buy"] * labels["click"]
    _check_exported_weights(name, model, feed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tasks = list(OUTPUTS.get(name, {}))
    got: dict[str, list[float]] = {"loss": [], **{f"loss_{o}": [] for o in tasks}}
    for _ in range(steps):
        outs = model(*feed.values())
        outs = outs if isinstance(outs, tuple) else (outs,)
        parts = [
            nn.functional.binary_cross_entropy(p, labels[lab])
            for p, lab in zip(outs, outputs.values(), strict=True)
        ]
        loss = sum(parts)
        got["loss"].append(loss.item())
        for o, part in zip(tasks, parts if tasks else [], strict=True):  # a single output: no task losses
            got[f"loss_{o}"].append(part.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = HERE / f"{name}_torch_steps.npz"
    arrays = {k: v.numpy() for k, v in {**feed, **labels}.items()}
    np.savez(path, **arrays, **{k: np.array(v) for k, v in got.items()})
    return path


def _strip_metadata(path: Path) -> None:
    """Drop the nodes' metadata (the dynamo exporter records stack traces with local paths)."""
    import onnx

    model = onnx.load(str(path))
    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        for n in g.node:
            del n.metadata_props[:]
            graphs += [a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
        for vi in [*g.input, *g.output, *g.value_info]:
            del vi.metadata_props[:]
    del model.metadata_props[:]
    onnx.save(model, str(path))


def main(names: list[str]) -> int:
    """Export the models named (all when none); with `--steps` first, write only their torch steps."""
    if names[:1] == ["--steps"]:
        for name in names[1:] or [*OUTPUTS, *STEPS]:
            print("wrote", torch_steps(name).name)
        return 0
    failed = 0
    for name in names or MODELS:
        for exporter in ("ts", "dynamo"):
            try:
                print("wrote", export(name, exporter).name)
            except Exception as e:  # noqa: BLE001 - report and go on with the others
                failed += 1
                print(f"{name} / {exporter}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if name in OUTPUTS or name in STEPS:
            print("wrote", torch_steps(name).name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
