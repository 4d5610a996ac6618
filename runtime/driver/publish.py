"""Publishing a model that is trained online: a full servable ONNX model every `full_every`
publishes and, between them, deltas (the rows changed since the last publish), in a directory a
serving process reads with `ServedModel`.

Layout of a publish directory (format 1; every version directory is written under a temporary
name and renamed into place, then `LATEST` is replaced atomically, so a reader that reads `LATEST`
and then the directories it names never sees half an update):

- `LATEST`: JSON {"format": 1, "version": N, "chain": ["v00000003-full", "v00000004-delta", ...],
  "pass": the pass id, "published_at": unix time}: the full model and the deltas to apply in order.
- `vNNNNNNNN-full/`: `model.onnx` (+ `model.onnx.data` for big tables), `ids.npz` (rows="existing":
  {id feed: the sorted raw ids whose rows the tables hold}) and `manifest.json` {"kind": "full",
  "version", "pass", "rows": "all" | "existing", "tables": {table: {"kind": "dense" | "sparse",
  "initializers": [ONNX initializer names], "feed": the raw id feed (sparse, rows="existing")}}}.
- `vNNNNNNNN-delta/`: `delta.npz` and `manifest.json` {"kind": "delta", "version", "base" (the full
  version), "previous" (the version it applies on), "pass", "tables": {table: {"kind", "key",
  "rows": changed rows}}}. In `delta.npz`, a sparse table's changes are `<key>.ids` (raw ids, int64)
  and `<key>.rows` (their new rows, [n, dim]), keyed by raw id in both row modes; `<key>.removed`
  lists raw ids no longer held (rows="existing", after a shrink); a dense table that changed is
  `<key>.value`, whole.

`apply_delta(tables, delta)` applies one delta to tables held as {table: array (dense) or (ids,
rows) (sparse)}; `ServedModel.load(dir)` loads `LATEST`'s full model and applies its deltas, and
`ServedModel.session()` / `.predict(feed)` score with onnxruntime (rows="existing": raw ids are
remapped to the positions of the current ids, an id not held scores with a zero row).

`Publisher` (the training side) pulls the tables of a checkpoint, compares them with the last
published copy (kept in memory; rebuilt from the directory with the same `apply_delta` after a
restart) and writes the delta, or a full model when it is due.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ops_registry.errors import HetpsError
from transpiler.plan import Plan

FORMAT = 1
LATEST = "LATEST"
Tables = dict[str, Any]  # {table: dense array, or (ids int64 [n], rows [n, dim]) for a sparse table}


class PublishError(HetpsError):
    """A publish directory that cannot be read or written as documented (the message says which)."""


# -- reading: the serving side ---------------------------------------------------------------------
def read_latest(root: str | Path) -> dict | None:
    """The `LATEST` record of publish directory `root` (None: nothing published yet)."""
    path = Path(root) / LATEST
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not doc.get("chain"):
        raise PublishError(f"{path} is not a format-{FORMAT} publish pointer: {str(doc)[:200]}")
    return doc


def apply_delta(tables: Tables, delta: str | Path) -> Tables:
    """`tables` (see `Tables`) with the delta directory `delta` applied: changed rows replaced, new
    ids inserted in sorted order, removed ids dropped, changed dense tables replaced."""
    delta = Path(delta)
    manifest = _manifest(delta, "delta")
    with np.load(delta / "delta.npz") as z:
        arrays = {k: z[k] for k in z.files}
    out = dict(tables)
    for name, entry in manifest["tables"].items():
        if name not in out:
            raise PublishError(f"delta {delta} changes table {name!r}, which the served model lacks")
        key = entry["key"]
        if entry["kind"] == "dense":
            out[name] = arrays[f"{key}.value"]
            continue
        ids, rows = out[name]
        removed = arrays.get(f"{key}.removed", np.zeros(0, np.int64))
        keep = ~np.isin(ids, removed)
        new_ids, new_rows = arrays[f"{key}.ids"], arrays[f"{key}.rows"]
        stay = keep & ~np.isin(ids, new_ids)
        merged = np.concatenate([ids[stay], new_ids])
        order = np.argsort(merged, kind="stable")
        out[name] = (merged[order], np.concatenate([rows[stay], new_rows.astype(rows.dtype)])[order])
    return out


@dataclass
class ServedModel:
    """A published model as a server holds it: the full model's ONNX graph, its manifest and the
    current tables (after the deltas of `LATEST`'s chain)."""

    root: Path
    version: int
    manifest: dict
    tables: Tables
    model: Any = None  # onnx.ModelProto of the full version
    _session: Any = field(default=None, repr=False)

    @classmethod
    def load(cls, root: str | Path) -> ServedModel:
        """The model `LATEST` names in publish directory `root`, deltas applied."""
        root = Path(root)
        latest = read_latest(root)
        if latest is None:
            raise PublishError(f"nothing is published in {root} yet (no {LATEST} file)")
        full, *deltas = latest["chain"]
        model, manifest, tables = _read_full(root / full)
        for d in deltas:
            tables = apply_delta(tables, root / d)
        return cls(root, int(latest["version"]), manifest, tables, model)

    def apply(self, delta: str | Path) -> None:
        """Apply one more delta directory (the next version's) to the served tables."""
        m = _manifest(Path(delta), "delta")
        if m["previous"] != self.version:
            raise PublishError(
                f"delta {delta} applies on version {m['previous']}; the served model is "
                f"version {self.version}"
            )
        self.tables, self.version, self._session = apply_delta(self.tables, delta), int(m["version"]), None

    def ids(self) -> dict[str, np.ndarray]:
        """rows="existing": {id feed: the sorted raw ids the served tables hold} (else empty)."""
        if self.manifest["rows"] != "existing":
            return {}
        out = {}
        for name, entry in self.manifest["tables"].items():
            if entry["kind"] == "sparse":
                out.setdefault(entry["feed"], self.tables[name][0])
        return out

    def session(self) -> Any:
        """An onnxruntime session of the full model with the current tables as its initializers."""
        if self._session is None:
            import onnxruntime as ort
            from onnx import numpy_helper

            model = type(self.model)()
            model.CopyFrom(self.model)
            values = _onnx_values(self.manifest, self.tables)
            for init in model.graph.initializer:
                if init.name in values:
                    init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
            self._session = ort.InferenceSession(
                model.SerializeToString(), providers=["CPUExecutionProvider"]
            )
        return self._session

    def predict(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        """The model's output on one feed dict of raw ids and dense features."""
        from runtime.evaluation.evaluate import remap_ids

        sess = self.session()
        names = [i.name for i in sess.get_inputs()]
        feed = remap_ids(self.ids(), feed) if self.manifest["rows"] == "existing" else feed
        return sess.run(None, {n: np.asarray(feed[n]) for n in names})[0]


def _manifest(path: Path, kind: str) -> dict:
    try:
        m = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise PublishError(f"{path} has no readable manifest.json: {e}") from None
    if m.get("format") != FORMAT or m.get("kind") != kind:
        raise PublishError(f"{path}/manifest.json is not a format-{FORMAT} {kind}: {str(m)[:200]}")
    return m


def _read_full(path: Path) -> tuple[Any, dict, Tables]:
    import onnx
    from onnx import numpy_helper

    manifest = _manifest(path, "full")
    model = onnx.load(str(path / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    ids = dict(np.load(path / "ids.npz")) if manifest["rows"] == "existing" else {}
    tables: Tables = {}
    for name, entry in manifest["tables"].items():
        value = inits[entry["initializers"][0]]
        if entry["kind"] == "dense":
            tables[name] = value
        elif manifest["rows"] == "existing":
            tables[name] = (ids[entry["feed"]], value[:-1])  # the last row: zeros for unseen ids
        else:
            tables[name] = (np.arange(len(value), dtype=np.int64), value)
    return model, manifest, tables


def _onnx_values(manifest: dict, tables: Tables) -> dict[str, np.ndarray]:
    """{initializer name: value} of `tables` as the full model's graph takes them."""
    out = {}
    for name, entry in manifest["tables"].items():
        value = tables[name]
        if entry["kind"] == "sparse":
            rows = value[1]
            if manifest["rows"] == "existing":
                rows = np.concatenate([rows, np.zeros((1, rows.shape[1]), rows.dtype)])
            value = rows
        for init in entry["initializers"]:
            out[init] = np.ascontiguousarray(value)
    return out


# -- writing: the training side --------------------------------------------------------------------
@dataclass(frozen=True)
class Update:
    """What a publish of checkpoint `checkpoint` would write: the pulled `tables`, the delta against
    the last publish (`changed`: {table: rows}), and the tables whose changed values are not finite."""

    checkpoint: Path
    tables: Tables
    onnx_tables: dict[str, np.ndarray]
    ids: dict[str, np.ndarray]
    delta: dict[str, dict[str, np.ndarray]]
    changed: dict[str, int]
    not_finite: list[str]


class Publisher:
    """Publishes checkpoints of `plan` into `root` (see the module docstring): a full model every
    `full_every` publishes (the first one full), deltas between; `rows`: "all" | "existing"."""

    def __init__(self, plan: Plan, root: str | Path, full_every: int = 4, rows: str = "all") -> None:
        from runtime.evaluation.evaluate import id_feeds

        if rows not in ("all", "existing"):
            raise ValueError(f"rows={rows!r}: expected 'all' or 'existing'")
        self.plan, self.root, self.full_every, self.rows = plan, Path(root), full_every, rows
        self.root.mkdir(parents=True, exist_ok=True)
        self.feed_of = id_feeds(plan) if rows == "existing" else {}
        self.inits = _initializer_names(plan)
        latest = read_latest(self.root)
        self.version = 0 if latest is None else int(latest["version"])
        self.chain: list[str] = [] if latest is None else list(latest["chain"])
        self.last: Tables | None = None
        if latest is not None:
            served = ServedModel.load(self.root)
            if served.manifest["rows"] != rows:
                raise PublishError(f"{self.root} holds rows={served.manifest['rows']!r} models, not {rows!r}")
            self.last = served.tables
        for stale in self.root.glob(".tmp-*"):  # a publish killed before its rename
            shutil.rmtree(stale, ignore_errors=True)

    def prepare(self, checkpoint: str | Path) -> Update:
        """Pull the tables of `checkpoint` and compute the delta against the last publish."""
        from runtime.evaluation.evaluate import existing_tables, full_tables

        if self.rows == "all":
            return self.prepare_tables(full_tables(self.plan, checkpoint), {}, checkpoint)
        return self.prepare_tables(*existing_tables(self.plan, checkpoint), checkpoint)

    def prepare_tables(
        self, onnx_tables: dict[str, np.ndarray], ids: dict | None = None, checkpoint: str | Path = ""
    ) -> Update:
        """The same from table values as the servable export takes them (`full_tables` /
        `existing_tables`, with their `ids` for rows="existing")."""
        ids = ids or {}
        tables: Tables = {}
        for t in self.plan.tables:
            if t.name not in onnx_tables or not self.inits.get(t.name):
                continue  # a table the servable model does not read
            v = onnx_tables[t.name]
            if t.kind == "dense":
                tables[t.name] = v
            elif self.rows == "all":
                tables[t.name] = (np.arange(len(v), dtype=np.int64), v)
            else:
                tables[t.name] = (ids[self.feed_of[t.name]], v[:-1])
        delta, changed, bad = _diff(self.last, tables)
        return Update(Path(checkpoint), tables, onnx_tables, ids, delta, changed, bad)

    def due_full(self) -> bool:
        return self.last is None or self.version % self.full_every == 0

    def publish(self, update: Update, pass_id: str) -> dict[str, Any]:
        """Write `update` (a full model when due, else its delta) and point `LATEST` at it; returns
        {"version", "kind", "seconds", "rows", "bytes"}."""
        t0 = time.perf_counter()
        version = self.version + 1
        full = self.due_full()
        name = f"v{version:08d}-{'full' if full else 'delta'}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            if full:
                self._write_full(tmp, update, version, pass_id)
            else:
                self._write_delta(tmp, update, version, pass_id)
            _fsync_tree(tmp)
            os.rename(tmp, self.root / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        chain = [name] if full else [*self.chain, name]
        doc = {
            "format": FORMAT,
            "version": version,
            "chain": chain,
            "pass": pass_id,
            "published_at": time.time(),
        }
        _atomic_text(self.root / LATEST, json.dumps(doc))
        old = self.chain
        self.version, self.chain, self.last = version, chain, update.tables
        if full:
            self._drop_older_than(old)
        size = sum(f.stat().st_size for f in (self.root / name).iterdir())
        rows = sum(update.changed.values()) if not full else None
        return {
            "version": version,
            "kind": "full" if full else "delta",
            "seconds": time.perf_counter() - t0,
            "rows": rows,
            "bytes": size,
            "dir": name,
        }

    def _write_full(self, tmp: Path, update: Update, version: int, pass_id: str) -> None:
        from transpiler.exporters.servable import export_inference

        export_inference(self.plan, tmp / "model.onnx", update.onnx_tables)
        if self.rows == "existing":
            np.savez(tmp / "ids.npz", **update.ids)
        tables = {}
        for name, value in update.tables.items():
            entry: dict[str, Any] = {
                "kind": "dense" if not isinstance(value, tuple) else "sparse",
                "initializers": self.inits.get(name, []),
            }
            if name in self.feed_of:
                entry["feed"] = self.feed_of[name]
            if entry["initializers"]:
                tables[name] = entry
        doc = {
            "format": FORMAT,
            "kind": "full",
            "version": version,
            "pass": pass_id,
            "rows": self.rows,
            "tables": tables,
        }
        (tmp / "manifest.json").write_text(json.dumps(doc, indent=1))

    def _write_delta(self, tmp: Path, update: Update, version: int, pass_id: str) -> None:
        arrays, tables = {}, {}
        for k, (name, parts) in enumerate(sorted(update.delta.items())):
            key = f"t{k}"
            arrays.update({f"{key}.{part}": v for part, v in parts.items()})
            kind = "dense" if "value" in parts else "sparse"
            tables[name] = {"kind": kind, "key": key, "rows": update.changed[name]}
        np.savez(tmp / "delta.npz", **arrays)
        base = int(self.chain[0][1:9])
        doc = {
            "format": FORMAT,
            "kind": "delta",
            "version": version,
            "base": base,
            "previous": self.version,
            "pass": pass_id,
            "tables": tables,
        }
        (tmp / "manifest.json").write_text(json.dumps(doc, indent=1))

    def _drop_older_than(self, previous_chain: list[str]) -> None:
        """After a full publish keep the new chain and the previous one (readers holding the old
        `LATEST`); remove older versions."""
        keep = set(self.chain) | set(previous_chain)
        for d in self.root.iterdir():
            if d.is_dir() and d.name.startswith("v") and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)


def _diff(last: Tables | None, now: Tables) -> tuple[dict, dict[str, int], list[str]]:
    """(delta arrays per table, changed rows per table, tables with non-finite changed values)."""
    delta, changed, bad = {}, {}, []
    for name, value in now.items():
        if not isinstance(value, tuple):
            if last is None or not np.array_equal(last[name], value):
                delta[name] = {"value": value}
                changed[name] = int(np.prod(np.shape(value)[:1] or (1,)))
                if not np.all(np.isfinite(value)):
                    bad.append(name)
            continue
        ids, rows = value
        removed = np.zeros(0, np.int64)
        if last is None:
            fresh = np.ones(len(ids), bool)
        elif np.array_equal(last[name][0], ids):  # the same ids (rows="all", no new id): rows only
            fresh = np.any(last[name][1] != rows, axis=1)
        else:
            old_ids, old_rows = last[name]
            pos = np.minimum(np.searchsorted(old_ids, ids), max(len(old_ids) - 1, 0))
            found = (old_ids[pos] == ids) if len(old_ids) else np.zeros(len(ids), bool)
            same = np.zeros(len(ids), bool)
            same[found] = np.all(old_rows[pos[found]] == rows[found], axis=1)
            fresh = ~same
            removed = old_ids[~np.isin(old_ids, ids)]
        if fresh.any() or len(removed):
            delta[name] = {"ids": ids[fresh].astype(np.int64), "rows": rows[fresh]}
            if len(removed):
                delta[name]["removed"] = removed.astype(np.int64)
            changed[name] = int(fresh.sum())
            if not np.all(np.isfinite(rows[fresh])):
                bad.append(name)
    return delta, changed, bad


def _initializer_names(plan: Plan) -> dict[str, list[str]]:
    """{table: the initializer names its values take in the servable ONNX model}: a dense table
    is named by its pull's output, a sparse one by itself."""
    from transpiler.exporters.servable import forward_graph

    out: dict[str, list[str]] = {}
    for op in forward_graph(plan).program.ops:
        if op.type == "pull_dense":
            out.setdefault(op.attrs["table"], []).append(op.outputs["Out"][0])
        elif op.type == "pull_sparse":
            out[op.attrs["table"]] = [op.attrs["table"]]
    return out


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
