"""Synthetic Criteo-shaped CTR data drawn from a hidden teacher model.

26 categorical slots hashed into one vocabulary, 13 dense floats, a binary label. Ids follow a
Zipf-like law per slot (a few ids are frequent, as in real click logs); the label is Bernoulli of a
teacher logit made of per-id weights, a dense linear term and a pairwise interaction, so a model that
learns reaches a clearly better-than-chance AUC (the teacher's own AUC is printed by `teacher_auc`).
"""

from __future__ import annotations

import numpy as np

from .metrics import auc


class SyntheticCTR:
    """`batch(i, n)` is deterministic in (seed, i): every trainer can draw its own shard."""

    def __init__(self, vocab: int = 1000, num_slots: int = 26, num_dense: int = 13, seed: int = 0,
                 sparse_name: str = "sparse", dense_name: str = "dense", label_name: str = "label",
                 zipf: float = 1.2) -> None:
        self.vocab, self.num_slots, self.num_dense, self.seed = vocab, num_slots, num_dense, seed
        self.names = (sparse_name, dense_name, label_name)
        self.zipf = zipf
        rng = np.random.default_rng(seed)
        self.w_id = rng.normal(0, 0.7, vocab)
        self.v_id = rng.normal(0, 0.5, (vocab, 4))
        self.w_dense = rng.normal(0, 0.5, num_dense)
        self.slot_salt = rng.integers(1, 2**31, num_slots)
        self.bias = -0.3

    def _ids(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = np.minimum(rng.zipf(self.zipf, (n, self.num_slots)), 10**9).astype(np.int64)
        return (raw * 2654435761 + self.slot_salt) % self.vocab

    def teacher_logit(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        v = self.v_id[ids]  # [n, slots, 4]
        pair = 0.5 * ((v.sum(1) ** 2).sum(1) - (v**2).sum((1, 2)))  # factorisation-machine term
        return (self.w_id[ids].sum(1) / np.sqrt(self.num_slots) + dense @ self.w_dense
                + 0.15 * pair + self.bias)

    def batch(self, i: int, n: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, 7919, i))
        ids = self._ids(rng, n)
        dense = rng.normal(0, 1, (n, self.num_dense))
        p = 1 / (1 + np.exp(-self.teacher_logit(ids, dense)))
        label = (rng.random(n) < p).astype(np.float32).reshape(n, 1)
        s, d, y = self.names
        return {s: ids, d: dense.astype(np.float32), y: label}

    def batches(self, n: int, count: int, start: int = 0):
        for i in range(start, start + count):
            yield self.batch(i, n)

    def teacher_auc(self, n: int = 20000) -> float:
        b = self.batch(10**6, n)
        s, d, y = self.names
        return auc(b[y], self.teacher_logit(b[s], b[d]))
