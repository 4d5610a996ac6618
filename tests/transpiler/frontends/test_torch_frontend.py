"""`from_torch`: a module's forward pass as hetps runs it equals torch's own (an independent
reference), and exporter failures come back as ModelImportError naming the module and the cause.
Skipped without torch (the optional extra `hetps[torch]`)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import Executor
from transpiler import from_torch
from transpiler.errors import ModelImportError

torch = pytest.importorskip("torch")


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(30, 4)
        self.fc = torch.nn.Linear(3 * 4 + 2, 1)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, ids, dense):
        return torch.sigmoid(self.fc(self.drop(torch.cat([self.emb(ids).flatten(1), dense], 1))))


def test_forward_matches_torch_and_loss_is_attached():
    torch.manual_seed(0)
    m = Tower()
    example = {"sparse": torch.zeros(2, 3, dtype=torch.long), "dense": torch.zeros(2, 2)}
    prog = from_torch(m, example, loss="bce", label="click")
    assert m.training  # put back in training mode after the export
    rng = np.random.default_rng(0)
    feed = {"sparse": rng.integers(0, 30, (7, 3)), "dense": rng.normal(size=(7, 2)).astype(np.float32)}
    m.eval()
    with torch.no_grad():
        ref = m(torch.from_numpy(feed["sparse"]), torch.from_numpy(feed["dense"])).numpy()
    feed["click"] = (rng.random((7, 1)) < 0.5).astype(np.float32)
    got, loss = Executor().run(prog, feed=feed, fetch_list=[prog.fetch_names[0], prog.attrs["loss_name"]])
    np.testing.assert_allclose(np.asarray(got).reshape(ref.shape), ref, rtol=1e-5, atol=1e-6)
    y = feed["click"]
    bce = -np.mean(y * np.log(ref) + (1 - y) * np.log(1 - ref))
    assert float(np.asarray(loss)) == pytest.approx(bce, rel=1e-4)


def test_export_failures_are_explained():
    with pytest.raises(ModelImportError, match="example_inputs must be tensors"):
        from_torch(Tower(), ([1, 2, 3], torch.zeros(1, 2)))
    with pytest.raises(ModelImportError, match=r"could not export Tower: RuntimeError"):
        from_torch(Tower(), (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 2)))  # 5 slots, fc takes 3
    with pytest.raises(ModelImportError, match="takes a torch.nn.Module"):
        from_torch(lambda x: x, torch.zeros(1))
