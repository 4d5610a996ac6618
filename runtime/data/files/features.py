"""The feature pipeline that travels with a trained model: the schema with the statistics fitted on
the training data (`Schema.to_dict`), saved as `features.json` in the plan directory, the
checkpoint directory and beside a servable export; and `encode(records, schema)`, what a serving
system calls to turn raw records into the inputs of that export.

The servable export (`runtime.export` with features) takes each dense column's raw values as its
own float64 input `[n, width]` (NaN = missing: the schema's fill value, then its transform, are
inside the ONNX graph) and the categorical features as ids, the same feeds training read
(`sparse`, one bag per multi-valued column and its `<column>_len`). ONNX has no standard hash op,
so the ids come from `encode`, which hashes exactly as training did (FNV-1a 64, the same code).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv  # noqa: F401  (pa.csv: the reader's null strings)

from ops_registry.errors import ConfigError
from runtime.data.files.schema import Schema
from runtime.data.kept_features import FEATURES, features_file


def save_features(where: str | Path, schema: Schema) -> Path:
    """Write `schema` (with its fitted stats) as `where/features.json`, or as the file `where` when
    it names a .json file, atomically."""
    path = Path(where)
    path = path if path.suffix == ".json" else path / FEATURES
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(schema.to_dict(), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def load_features(path: str | Path) -> Schema:
    """The schema of a `features.json` file, or of the one in directory `path`."""
    path = Path(path)
    path = path / FEATURES if path.is_dir() else path
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the feature pipeline {path}: {e}") from None
    return Schema.from_dict(doc, f"features {path}", path.parent)


def find_features(*places: str | Path | None) -> Schema | None:
    """The feature pipeline kept with a model: `features.json` in the first of `places` (plan
    directories, checkpoint directories, or one checkpoint: then its directory) that has one."""
    path = features_file(*places)
    return None if path is None else load_features(path)


def check_same(given: Schema, fitted: Schema, where: str) -> None:
    """ConfigError unless `given` reads the data as `fitted` (the model's) does, stats aside."""
    a, b = given.to_dict(), fitted.to_dict()
    a.pop("stats", None), b.pop("stats", None)
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise ConfigError(
            f"the schema given differs from the one the model was trained with ({where}) in {diff}: "
            "leave --schema out to read the data as the model was trained"
        )


def encode(records: Iterable[Mapping[str, Any]], schema: Schema | str | Path) -> dict[str, np.ndarray]:
    """The servable export's inputs for `records` ({column: raw value}, e.g. parsed JSON): each
    dense column's values as float64 [n, 1] (None, "" or a missing key: NaN, filled in the graph),
    the categorical feeds as ids hashed like training's (a value's text: str(value); None or a
    missing key: missing). `schema`: a Schema or a features.json (or a directory holding one)."""
    schema = schema if isinstance(schema, Schema) else load_features(schema)
    rows = list(records)
    out: dict[str, np.ndarray] = {}
    for c in schema.dense:
        out[c] = np.array([[_number(r.get(c), c)] for r in rows], np.float64).reshape(len(rows), 1)
    categorical = [*schema.sparse, *(c for c, _ in schema.multi)]
    text = {c: pa.array([_text(r.get(c)) for r in rows], pa.string()) for c in categorical}
    if schema.sparse:
        out["sparse"] = np.empty((len(rows), len(schema.sparse)), np.int64)
        for j, c in enumerate(schema.sparse):
            schema.ids(text[c], c, out["sparse"][:, j])
    for c, sep in schema.multi:
        out[c], out[f"{c}_len"] = schema._bag(text[c], c, sep, len(rows))
    return out


def _number(v: Any, column: str) -> float:
    if v is None or (isinstance(v, str) and v in _NULLS):
        return float("nan")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"dense column {column!r}: {v!r} is not a number") from None


def _text(v: Any) -> str | None:
    """A categorical value's text; None for what the file reader takes as missing."""
    return None if v is None or str(v) in _NULLS else str(v)


_NULLS = frozenset(pa.csv.ConvertOptions().null_values)


def dense_inputs(schema: Schema, widths: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The raw dense inputs of a servable export, in the `dense` feed's column order:
    [{name, width, fill, transform, mean, std}] (`widths`: of list columns, default 1)."""
    stats = {c: (m, s) for c, m, s in schema.stats}
    out = []
    for c in schema.dense:
        how = dict(schema.transform).get(c, "none")
        if how == "standardize" and c not in stats:
            raise ConfigError(f"dense column {c!r} is standardized but the features carry no stats for it")
        mean, std = stats.get(c, (0.0, 1.0))
        fill = schema.fill(c)
        out.append(
            {
                "name": c,
                "width": (widths or {}).get(c, 1),
                "fill": None if fill == "error" else float(fill),
                "transform": how,
                "mean": mean,
                "std": std if std > 0 else 1.0,
            }
        )
    return out
