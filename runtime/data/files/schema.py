"""A schema: which columns of a table become which feeds of a CTR model, and how.

    label: rating            # column; with label_threshold: 4, rating >= 4 is a positive (1.0)
    label_threshold: 4
    dense: [age]             # numeric columns -> `dense` float32 [n, width]
    transform: standardize   # none | log1p | standardize, for every dense column, or {column: transform}
    sparse: [user_id, gender]  # categorical -> `sparse` int64 [n, len(sparse)], one id per column
    multi: {genres: "|"}     # multi-valued categorical -> feed `genres` int64 [n, max_len] (pad 0)
    max_len: 8               # ids kept per multi-valued column (longer bags are cut)
    vocab: 1000000           # the id space
    hash64: false            # true: ids are the raw 64-bit hashes (no modulo; unbounded tables)
    vocab_files: {item_id: items.txt}  # optional: a column's known values, one per line
    missing: {age: 0, user_id: error}  # per column: the fill value of a missing value, or error

Ids are a stable hash: FNV-1a 64 of `column + "\\x1f" + value` (the value's bytes as in a text
file, not checked to be UTF-8; a number's decimal form), mapped to [1, vocab): id 0 is never a
value's id, it pads the bags. With `vocab_files` (paths relative to the schema file), the K values
they list get ids 1..K in the files' order (each column's block after the previous one's),
collision-free; other values hash into [K + 1, vocab). With `hash64: true` there is no modulo: an
id is the 64-bit hash itself (as int64 bits; `ids.view(np.uint64)` reads it back), moved up by K + 1
in the 2^-64-likely case it lies below; the expected collisions of N distinct values are
N^2 / 2^65 (< 0.03 for 10^9). The model's tables must then be unbounded (`TranspileConfig.
unbounded`, `hetps transpile --unbounded`): `vocab` only sizes the program's declared embedding.
A missing categorical
value hashes as the empty string; a missing dense value is 0 (before the transform). `log1p` is
collision-free; other values hash into [K + 1, vocab). A missing value (an empty field, or one
of pyarrow's null strings: `n/a`, `NA`, `null`, ...) is filled by the column's `missing` policy:
a fill value (a number for a dense column, a text for a categorical one), or `error` (the file,
row and column are named); without one a missing categorical value hashes as the empty string, a
missing dense value is 0 (before the transform), and a missing label is an error.
`open_dataset` counts the values filled per column (`Dataset.filled`). `log1p` is
log(1 + max(x, 0)), as DLRM reads Criteo's counts. `standardize` is (x - mean) / std with the
mean and std of the training data (`stats`: measured by `open_dataset` in one pass over the files
before training when not given, then stored with the model: `to_dict` / `features.json`).

Beside each multi-valued column's bag feed, `<column>_len` int64 [n, 1] holds the bag's length.
A column holding lists already (Parquet list columns, the slot text format's repeated keys) is
used as it is: a dense list column adds its (fixed) number of values to the dense width.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ops_registry.errors import ConfigError
from runtime.data.files import fnv

TRANSFORMS = ("none", "log1p", "standardize")
_KEYS = {
    "label",
    "label_threshold",
    "dense",
    "transform",
    "sparse",
    "multi",
    "max_len",
    "vocab",
    "stats",
    "vocab_files",
    "hash64",
    "vocab_values",  # {column: [values]}: vocab_files inline (what `to_dict` writes)
    "missing",
}


@dataclass(frozen=True)
class Schema:
    """See the module docstring; `Schema.load(path_or_dict)` reads one and checks it."""

    label: str
    dense: tuple[str, ...] = ()
    sparse: tuple[str, ...] = ()
    multi: tuple[tuple[str, str], ...] = ()  # (column, separator)
    vocab: int = 1_000_000
    label_threshold: float | None = None
    transform: tuple[tuple[str, str], ...] = ()  # (dense column, transform); absent: none
    max_len: int = 8
    stats: tuple[tuple[str, float, float], ...] = field(default=(), compare=False)  # (column, mean, std)
    known: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (column, its values from its vocab file)
    hash64: bool = False  # ids are raw 64-bit hashes (no modulo)
    missing: tuple[tuple[str, Any], ...] = ()  # (column, fill value or "error")

    @classmethod
    def load(cls, source: str | Path | dict[str, Any] | Schema) -> Schema:
        if isinstance(source, Schema):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source, "the schema", Path.cwd())
        import yaml

        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no schema file at {path}")
        d = yaml.safe_load(path.read_text())
        if not isinstance(d, dict):
            raise ConfigError(f"schema {path}: expected a mapping (label:, dense:, sparse:, ...), got {d!r}")
        return cls.from_dict(d, f"schema {path}", path.parent)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "the schema", base: Path | None = None) -> Schema:
        """A checked schema from a dict; `vocab_files` paths are relative to `base` (default: cwd)."""
        unknown = set(d) - _KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; a schema has {sorted(_KEYS)}")
        if not isinstance(d.get("label"), str):
            raise ConfigError(f"{where}: 'label' must name the label column, got {d.get('label')!r}")
        dense, sparse, multi = _columns(d, where)
        t = d.get("transform", "none")
        per = dict.fromkeys(dense, t) if isinstance(t, str) else dict(t)
        bad = {c: v for c, v in per.items() if v not in TRANSFORMS or c not in dense}
        if bad:
            raise ConfigError(
                f"{where}: transform {bad}: each must be one of {TRANSFORMS} for a dense column"
            )
        vocab, max_len = d.get("vocab", 1_000_000), d.get("max_len", 8)
        for what, v in (("vocab", vocab), ("max_len", max_len)):
            if not isinstance(v, int) or isinstance(v, bool) or v < (2 if what == "vocab" else 1):
                raise ConfigError(f"{where}: {what} must be a positive int (vocab >= 2), got {v!r}")
        if not isinstance(d.get("hash64", False), bool):
            raise ConfigError(f"{where}: hash64 must be true or false, got {d['hash64']!r}")
        thr = d.get("label_threshold")
        if thr is not None and not isinstance(thr, (int, float)):
            raise ConfigError(f"{where}: label_threshold must be a number, got {thr!r}")
        stats = tuple((c, float(m), float(s)) for c, (m, s) in (d.get("stats") or {}).items())
        known = _vocab_files(d.get("vocab_files") or {}, [*sparse, *multi], base or Path.cwd(), where)
        known += _vocab_values(d.get("vocab_values") or {}, [*sparse, *multi], where)
        missing = _missing(d.get("missing") or {}, d["label"], dense, [*sparse, *multi], where)
        if sum(len(v) for _, v in known) + 2 > vocab:
            raise ConfigError(
                f"{where}: vocab {vocab} must exceed the {sum(len(v) for _, v in known)} values "
                "of the vocab files by 2 or more (id 0 pads, one id at least for other values)"
            )
        return cls(
            d["label"],
            dense,
            sparse,
            tuple(multi.items()),
            vocab,
            None if thr is None else float(thr),
            tuple((c, v) for c, v in per.items() if v != "none"),
            max_len,
            stats,
            known,
            d.get("hash64", False),
            missing,
        )

    def to_dict(self) -> dict[str, Any]:
        """The schema as `from_dict` reads it, with its fitted `stats` and its vocab files' values
        inline (`vocab_values`): everything needed to read data as the model was trained on."""
        d: dict[str, Any] = {"label": self.label, "dense": list(self.dense), "sparse": list(self.sparse)}
        d.update(multi=dict(self.multi), vocab=self.vocab, max_len=self.max_len)
        d["transform"] = {c: t for c, t in self.transform}
        if self.label_threshold is not None:
            d["label_threshold"] = self.label_threshold
        if self.stats:
            d["stats"] = {c: [m, s] for c, m, s in self.stats}
        if self.known:
            d["vocab_values"] = {c: list(v) for c, v in self.known}
        if self.missing:
            d["missing"] = dict(self.missing)
        if self.hash64:
            d["hash64"] = True
        return d

    def fill(self, name: str) -> Any:
        """Column `name`'s fill value for a missing value ("error": none may be missing)."""
        default = 0.0 if name in self.dense else "" if name != self.label else "error"
        return dict(self.missing).get(name, default)

    def ids(self, col, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Ids of a categorical column's values: from its vocab file when listed there, else hashed
        (written into `out`, an int64 vector of len(col), if given); missing values by `fill`."""
        fill = self.fill(name)
        if col.null_count and fill == "error":
            raise ConfigError(missing_error(col, name))
        if col.null_count and fill != "":
            col = pc.fill_null(_as_text(col), str(fill))
        first = 1 + sum(len(v) for _, v in self.known)
        ids = hash_ids(col, name, 0 if self.hash64 else self.vocab, first, out)
        offset = 1
        for column, values in self.known:
            if column == name:
                at = pc.index_in(pc.fill_null(_as_text(col), ""), value_set=pa.array(values, pa.string()))
                at = pc.fill_null(at, -1).to_numpy(zero_copy_only=False)
                listed = at >= 0
                ids[listed] = offset + at[listed]
                return ids
            offset += len(values)
        return ids

    @property
    def columns(self) -> list[str]:
        """Every column the schema reads."""
        return [self.label, *self.dense, *self.sparse, *(c for c, _ in self.multi)]

    def needs_stats(self) -> list[str]:
        have = {c for c, _, _ in self.stats}
        return [c for c, t in self.transform if t == "standardize" and c not in have]

    def with_stats(self, stats: dict[str, tuple[float, float]]) -> Schema:
        return replace(self, stats=self.stats + tuple((c, m, s) for c, (m, s) in stats.items()))

    def feeds(self, columns: dict[str, pa.Array | pa.ChunkedArray]) -> dict[str, np.ndarray]:
        """The feed dict of a batch of rows: {column name: arrow array}."""
        n = len(columns[self.label])
        out = {"label": self._label(columns[self.label])}
        if self.dense:
            out["dense"] = np.concatenate([self._dense(c, columns[c], n) for c in self.dense], axis=1)
        if self.sparse:
            out["sparse"] = sparse = np.empty((n, len(self.sparse)), np.int64)
            for j, c in enumerate(self.sparse):
                self.ids(_single(columns[c], c), c, sparse[:, j])
        for c, sep in self.multi:
            out[c], out[f"{c}_len"] = self._bag(columns[c], c, sep, n)
        return out

    def _label(self, col) -> np.ndarray:
        col = _single(col, self.label)
        if col.null_count and self.fill(self.label) != "error":
            col = pc.fill_null(pc.cast(col, pa.float64()), float(self.fill(self.label)))
        if col.null_count:
            first = int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise ConfigError(
                f"label column {self.label!r} has {col.null_count} missing values (the first in row "
                f"{first + 1} of these)"
            )
        y = _numeric(col, self.label)
        if self.label_threshold is not None:
            y = (y >= self.label_threshold).astype(np.float32)
        return y.astype(np.float32).reshape(-1, 1)

    def _dense(self, name: str, col, n: int) -> np.ndarray:
        fill = self.fill(name)
        if fill == "error" and col.null_count:
            raise ConfigError(missing_error(col, name))
        x = numeric_values(col, name, 0.0 if fill == "error" else float(fill))
        x = x.reshape(n, -1) if n else np.zeros((0, 1))
        how = dict(self.transform).get(name, "none")
        if how == "log1p":
            x = np.log1p(np.maximum(x, 0))
        elif how == "standardize":
            stats = {c: (m, s) for c, m, s in self.stats}
            if name not in stats:
                raise ConfigError(
                    f"dense column {name!r} is standardized but the schema has no stats for "
                    "it: open it with runtime.data.open_dataset (which measures them) or give "
                    "stats: {column: [mean, std]}"
                )
            m, s = stats[name]
            x = (x - m) / (s if s > 0 else 1.0)
        return x.astype(np.float32)

    def _bag(self, col, name: str, sep: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            col = pc.split_pattern(pc.fill_null(_as_text(col), ""), sep)
        col = pc.fill_null(col, pa.scalar([], col.type))
        values = pc.list_flatten(col)
        keep = pc.not_equal(values, "").to_numpy(zero_copy_only=False) if len(values) else np.zeros(0, bool)
        rows = pc.list_parent_indices(col).to_numpy()[keep]
        ids = self.ids(values.filter(pa.array(keep)), name)
        lengths = np.bincount(rows, minlength=n)
        pos = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        short = pos < self.max_len
        bag = np.zeros((n, self.max_len), np.int64)
        bag[rows[short], pos[short]] = ids[short]
        return bag, np.minimum(lengths, self.max_len).astype(np.int64).reshape(n, 1)


def _names(v: Any, what: str, where: str) -> tuple[str, ...]:
    if isinstance(v, str) or not all(isinstance(c, str) for c in v):
        raise ConfigError(f"{where}: '{what}' must be a list of column names, got {v!r}")
    return tuple(v)


def _single(col, name: str):
    """A column with one value per row (a list column of at most one value per row is unpacked)."""
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if len(col) and pc.max(pc.list_value_length(col)).as_py() > 1:
            raise ConfigError(
                f"column {name!r} has rows with several values; list it under multi: "
                "to read it as a bag of ids"
            )
        has = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False) > 0
        at = pa.array(np.cumsum(has) - 1, mask=~has)  # row -> its value in the flat values, or null
        return pc.take(pc.list_flatten(col), at)
    return col


def missing_error(col, name: str) -> str:
    first = int(np.flatnonzero(np.asarray(pc.is_null(col)))[0])
    return (
        f"column {name!r} has {col.null_count} missing values (the first in row {first + 1} of these) "
        "and its missing policy is error: fix the data, or give a fill value (missing: {column: value})"
    )


def numeric_values(col, name: str, fill: float = 0.0) -> np.ndarray:
    """A numeric column's values as float64 (missing: `fill`); a list column's values row after row,
    which must have a fixed number per row."""
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        lengths = pc.list_value_length(pc.fill_null(col, pa.scalar([], col.type)))
        if len(col) and pc.min(lengths).as_py() != pc.max(lengths).as_py():
            raise ConfigError(
                f"dense column {name!r} holds lists of {pc.min(lengths)} to "
                f"{pc.max(lengths)} values; a dense list column needs a fixed width"
            )
        return _numeric(pc.list_flatten(col), name, fill)
    return _numeric(col, name, fill)


def _numeric(col, name: str, fill: float = 0.0) -> np.ndarray:
    if pa.types.is_dictionary(col.type):
        col = pc.cast(col, col.type.value_type)
    if not pa.types.is_float64(col.type):
        try:
            col = pc.cast(col, pa.float64())
        except pa.ArrowInvalid as e:
            raise ConfigError(f"column {name!r} should be numeric: {e}") from None
    col = pc.fill_null(col, fill)
    out = col.to_numpy() if isinstance(col, pa.ChunkedArray) else col.to_numpy(zero_copy_only=False)
    return np.asarray(out, dtype=np.float64)


def _as_text(col):
    if pa.types.is_dictionary(col.type):
        col = pc.cast(col, col.type.value_type)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        col = pc.cast(col, pa.string())
    return col


def _columns(d: dict[str, Any], where: str) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """The checked dense, sparse and multi-valued columns of a schema dict."""
    dense, sparse = (
        _names(d.get("dense", []), "dense", where),
        _names(d.get("sparse", []), "sparse", where),
    )
    multi = d.get("multi") or {}
    if not isinstance(multi, dict) or not all(isinstance(s, str) and s for s in multi.values()):
        raise ConfigError(
            f"{where}: 'multi' maps each multi-valued column to its separator, "
            f'e.g. {{genres: "|"}}; got {multi!r}'
        )
    if not dense and not sparse and not multi:
        raise ConfigError(f"{where}: no feature columns; give dense:, sparse: or multi:")
    seen = [d["label"], *dense, *sparse, *multi]
    dup = sorted({c for c in seen if seen.count(c) > 1})
    if dup:
        raise ConfigError(f"{where}: columns {dup} appear more than once (label, dense, sparse, multi)")
    return dense, sparse, multi


def _vocab_files(files: Any, columns: list[str], base: Path, where: str) -> tuple:
    if not isinstance(files, dict) or any(c not in columns for c in files):
        raise ConfigError(
            f"{where}: vocab_files maps categorical columns ({columns}) to files, got {files!r}"
        )
    out = []
    for column, name in files.items():
        path = base / name
        if not path.is_file():
            raise FileNotFoundError(f"{where}: no vocab file for {column!r} at {path}")
        values = path.read_text(encoding="utf-8").splitlines()
        if len(set(values)) != len(values):
            dup = next(v for v in values if values.count(v) > 1)
            raise ConfigError(f"{where}: vocab file {path} lists {dup!r} more than once")
        out.append((column, tuple(values)))
    return tuple(out)


def _vocab_values(values: Any, columns: list[str], where: str) -> tuple:
    if not isinstance(values, dict) or any(
        c not in columns or not isinstance(v, list) for c, v in values.items()
    ):
        raise ConfigError(
            f"{where}: vocab_values maps categorical columns ({columns}) to lists of values, got {values!r}"
        )
    return tuple((c, tuple(str(x) for x in v)) for c, v in values.items())


def _missing(policy: Any, label: str, dense: tuple, categorical: list[str], where: str) -> tuple:
    """The checked `missing:` policies: a number for the label and dense columns, a text for
    categorical ones, or "error"."""
    if not isinstance(policy, dict):
        raise ConfigError(f"{where}: missing maps columns to a fill value or error, got {policy!r}")
    for c, v in policy.items():
        numeric = c == label or c in dense
        if c not in (label, *dense, *categorical):
            raise ConfigError(f"{where}: missing: {c!r} is not a column of the schema")
        ok = v == "error" or (
            isinstance(v, (int, float)) and not isinstance(v, bool) if numeric else isinstance(v, (str, int))
        )
        if not ok:
            kind = "a number" if numeric else "a text"
            raise ConfigError(f"{where}: missing: {c}: {v!r}; give {kind} to fill with, or error")
    return tuple((c, v if v == "error" or c in (label, *dense) else str(v)) for c, v in policy.items())


def hash_ids(col, name: str, vocab: int, first: int = 1, out: np.ndarray | None = None) -> np.ndarray:
    """Ids in [first, vocab) of a categorical column's values (see the module docstring), written
    into `out` (an int64 vector of len(col)) if given; `vocab` 0: raw 64-bit hashes (`fnv.ids`)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    prefix = name.encode() + b"\x1f"
    if pa.types.is_dictionary(col.type):  # hash each distinct value once (and "" for nulls)
        words = pa.concat_arrays([_as_text(col.dictionary), pa.array([""], _as_text(col.dictionary).type)])
        codes = pc.fill_null(col.indices, len(col.dictionary)).to_numpy(zero_copy_only=False)
        out = np.empty(len(col), np.int64) if out is None else out
        out[:] = fnv.ids(words, prefix, first, vocab)[codes]
        return out
    return fnv.ids(_as_text(col), prefix, first, vocab, out)
