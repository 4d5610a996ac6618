"""Synthetic Criteo-shaped CTR data drawn from a hidden teacher model.

26 categorical slots hashed into one vocabulary, 13 dense floats, a binary label. Ids follow a
Zipf-like law per slot (a few ids are frequent, as in real click logs); the label is Bernoulli of a
teacher logit made of per-id weights, a dense linear term and a pairwise interaction, so a model that
learns reaches a clearly better-than-chance AUC (the teacher's own AUC is printed by `teacher_auc`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.evaluation.metrics import auc


class SyntheticCTR:
    """`batch(i, n)` is deterministic in (seed, i): every trainer can draw its own shard."""

    def __init__(
        self,
        vocab: int = 1000,
        num_slots: int = 26,
        num_dense: int = 13,
        seed: int = 0,
        sparse_name: str = "sparse",
        dense_name: str = "dense",
        label_name: str = "label",
        zipf: float = 1.2,
    ) -> None:
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
        return (
            self.w_id[ids].sum(1) / np.sqrt(self.num_slots) + dense @ self.w_dense + 0.15 * pair + self.bias
        )

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


class SyntheticMultiTask(SyntheticCTR):
    """Two binary labels per impression, for multi-task models: `click` ~ Bernoulli(sigmoid(the
    click teacher)) and a second event ~ Bernoulli(sigmoid(its own teacher)); with `chained`
    (ESMM's setting: a purchase follows a click) the second label is click AND that event, so
    it is 1 only on clicked impressions. `batch(i, n)` is deterministic in (seed, i)."""

    def __init__(
        self, *args: Any, labels: tuple[str, str] = ("click", "buy"), chained: bool = True, **kw: Any
    ):
        super().__init__(*args, **kw)
        rng = np.random.default_rng((self.seed, 2))
        self.labels, self.chained = labels, chained
        self.w2_id, self.w2_dense = rng.normal(0, 0.7, self.vocab), rng.normal(0, 0.5, self.num_dense)

    def batch(self, i: int, n: int) -> dict[str, np.ndarray]:
        out = super().batch(i, n)
        s, d, y = self.names
        click = out.pop(y)
        logit2 = self.w2_id[out[s]].sum(1) / np.sqrt(self.num_slots) + out[d] @ self.w2_dense - 0.5
        rng = np.random.default_rng((self.seed, 104729, i))
        event = (rng.random(n) < 1 / (1 + np.exp(-logit2))).astype(np.float32).reshape(n, 1)
        return {**out, self.labels[0]: click, self.labels[1]: event * click if self.chained else event}


class CriteoReader:
    """Batches from Criteo-format text files (label, 13 integer features, 26 hashed categorical
    features, tab-separated: the format PaddleRec and DLRM read).

    Categorical strings are hashed with (slot, value) into `vocab` (crc32: stable across processes
    and runs); empty fields map to id 0 of their slot's hash. Integer features become log(1 + max(x, 0))
    as in DLRM; empty ones are 0. `shard=(i, n)` keeps every n-th line starting at i, for readers of
    your own; `train` instead slices each global batch among its readers (runtime/data/sources.py).
    """

    def __init__(
        self,
        paths,
        vocab: int,
        batch_size: int,
        shard: tuple[int, int] = (0, 1),
        names: tuple[str, str, str] = ("sparse", "dense", "label"),
    ) -> None:
        single = isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__")
        self.paths = [paths] if single else list(paths)
        self.vocab, self.batch_size, self.shard, self.names = vocab, batch_size, shard, names

    def _lines(self):
        i, n = self.shard
        k = 0
        for path in self.paths:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if k % n == i:
                        yield line
                    k += 1

    def _parse(self, lines: list[str]) -> dict[str, np.ndarray]:
        import zlib

        m = len(lines)
        label = np.zeros((m, 1), np.float32)
        dense = np.zeros((m, 13), np.float32)
        ids = np.zeros((m, 26), np.int64)
        for r, line in enumerate(lines):
            f = line.rstrip("\n").split("\t")
            if len(f) != 40:
                raise ValueError(f"Criteo line {r} has {len(f)} tab-separated fields, expected 40")
            label[r, 0] = float(f[0])
            dense[r] = [float(x) if x else 0.0 for x in f[1:14]]
            ids[r] = [zlib.crc32(f"{s}:{x}".encode()) for s, x in enumerate(f[14:40])]
        s, d, y = self.names
        return {s: ids % self.vocab, d: np.log1p(np.maximum(dense, 0)), y: label}

    def __iter__(self):
        buf: list[str] = []
        for line in self._lines():
            buf.append(line)
            if len(buf) == self.batch_size:
                yield self._parse(buf)
                buf = []
        if buf:
            yield self._parse(buf)


class ArrayReader:
    """Batches from in-memory arrays {name: array with a leading example axis}, optionally sharded."""

    def __init__(
        self, arrays: dict[str, np.ndarray], batch_size: int, shard: tuple[int, int] = (0, 1)
    ) -> None:
        lens = {len(v) for v in arrays.values()}
        if len(lens) != 1:
            raise ValueError(f"arrays have different lengths: { {k: len(v) for k, v in arrays.items()} }")
        self.arrays, self.batch_size, self.shard = arrays, batch_size, shard

    def __iter__(self):
        i, n = self.shard
        total = len(next(iter(self.arrays.values())))
        starts = range(0, total, self.batch_size)
        for k, s in enumerate(starts):
            if k % n == i:
                yield {name: a[s : s + self.batch_size] for name, a in self.arrays.items()}
