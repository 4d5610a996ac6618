"""Reference CTR models written with the builder (used by tutorials, tests and benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass

from . import builder as nn
from .ir import Program, Var


@dataclass
class Model:
    """A built model: its programs and the vars a user feeds and fetches."""

    main: Program
    startup: Program
    feeds: list[str]
    loss: Var
    pred: Var


def wide_deep(num_slots: int = 26, vocab: int = 1000, dim: int = 8, num_dense: int = 13,
              hidden: tuple[int, ...] = (64, 32), optimizer: nn.Optimizer | None = None,
              seed: int = 0, dtype: str = "float32") -> Model:
    """Wide&Deep: wide = sum of per-id scalar weights; deep = MLP over [embeddings, dense];
    logit = wide + deep; loss = mean log loss. `optimizer=None` leaves it forward-only."""
    main, startup = Program(), Program()
    main.attrs["random_seed"] = seed
    with nn.program_guard(main, startup):
        ids = nn.data("sparse", [-1, num_slots], "int64")
        dense = nn.data("dense", [-1, num_dense], dtype)
        label = nn.data("label", [-1, 1], dtype)
        small = {"type": "uniform", "low": -0.01, "high": 0.01}
        wide = nn.reduce_sum(nn.embedding(ids, vocab, 1, name="wide_emb", initializer=small,
                                          dtype=dtype), axes=[1])
        emb = nn.embedding(ids, vocab, dim, name="deep_emb", dtype=dtype)
        h = nn.concat([nn.reshape(emb, [-1, num_slots * dim]), dense], axis=1)
        for size in hidden:
            h = nn.fc(h, size, act="relu")
        logit = nn.add(nn.fc(h, 1), wide)
        loss = nn.reduce_mean(nn.sigmoid_cross_entropy_with_logits(logit, label))
        pred = nn.sigmoid(logit)
        if optimizer is not None:
            optimizer.minimize(loss)
    return Model(main, startup, ["sparse", "dense", "label"], loss, pred)
