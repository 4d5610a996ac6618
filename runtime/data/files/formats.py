"""Files in the formats CTR users have, read as batches of arrow columns, in pieces.

Formats (guessed from the suffix, `.gz` allowed for text):
- `criteo`: Criteo's raw TSV, no header: label, I1..I13 (integers), C1..C26 (categoricals);
- `csv` / `tsv`: a header line, then comma- / tab-separated rows;
- `slot`: PaddleRec's slot text, `click:0 dense_feature:0.05 ... 1:737395 2:210498 ...` — a key
  that repeats on a line (dense_feature) is a list column;
- `parquet`: files of a Parquet dataset (a directory or glob of them).

A `Piece` is what one reader reads of one file: a byte range of a plain text file (the lines that
*start* in it: every line belongs to exactly one piece), a whole `.gz` file, or a run of Parquet
row groups. Its row count is known before reading (newlines counted, Parquet metadata), so each
reader knows every reader's number of rows and all agree on the steps of an epoch.
"""

from __future__ import annotations

import glob
import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq

FORMATS = ("criteo", "csv", "tsv", "slot", "parquet")
CRITEO_COLUMNS = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]
BLOCK = 2 << 20  # bytes of text parsed at a time (8 MiB blocks ran ~25% slower: out of cache)


@dataclass(frozen=True)
class Piece:
    """Lines starting in bytes [start, stop) of a text file (whole file for .gz: stop = -1), or row
    groups [start, stop) of a Parquet file; `rows` of them."""

    path: str
    start: int
    stop: int
    rows: int


def expand(paths: str | os.PathLike | list) -> list[str]:
    """Files named by paths, directories (their files, sorted) and globs, in order, each once."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for p in map(str, items):
        if any(ch in p for ch in "*?["):
            found = sorted(f for f in glob.glob(p) if os.path.isfile(f))
        elif os.path.isdir(p):
            found = sorted(
                str(f) for f in Path(p).iterdir() if f.is_file() and not f.name.startswith((".", "_"))
            )
        elif os.path.isfile(p):
            found = [p]
        else:
            raise FileNotFoundError(f"no data file at {p}")
        if not found:
            raise FileNotFoundError(f"{p} names no data files")
        out += [f for f in found if f not in out]
    return out


def guess_format(path: str) -> str:
    """The format of a file by its suffix (a `.txt` file by its first line)."""
    name = path[:-3] if path.endswith(".gz") else path
    suffix = Path(name).suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv"):
        return suffix[1:]
    with _open(path) as f:
        first = f.readline().decode("utf-8", "replace").rstrip("\r\n")
    if first.count("\t") == 39:
        return "criteo"
    tokens = first.split()
    if tokens and all(":" in t for t in tokens):
        return "slot"
    raise ValueError(
        f"cannot tell the format of {path}: name it .csv, .tsv or .parquet, or pass "
        f"format= one of {FORMATS} (its first line: {first[:80]!r})"
    )


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def header(path: str, fmt: str) -> list[str] | None:
    """The column names of a csv / tsv file's header line (None for other formats)."""
    if fmt not in ("csv", "tsv"):
        return None
    with _open(path) as f:
        line = f.readline().rstrip(b"\r\n")
    if not line:
        raise ValueError(f"{path} is empty: a {fmt} file starts with a header line")
    row = pcsv.read_csv(
        pa.py_buffer(line + b"\n"),
        read_options=pcsv.ReadOptions(autogenerate_column_names=True),
        parse_options=_parse_options(fmt),
        convert_options=pcsv.ConvertOptions(strings_can_be_null=False),
    ).to_pylist()[0]
    return [str(v) for v in row.values()]


def plan(files: list[str], fmt: str, readers: int) -> list[list[Piece]]:
    """Each reader's pieces: plain text split into `readers` byte ranges of the files end to end;
    .gz files and Parquet row groups whole, each to the reader its middle byte / row falls to."""
    if fmt == "parquet":
        metas = [(f, parquet_file(f).metadata) for f in files]
        units = [(f, g, g + 1, m.row_group(g).num_rows) for f, m in metas for g in range(m.num_row_groups)]
        return _by_middle(units, readers, lambda u: u[3], lambda f, a, b, rows: Piece(f, a, b, rows))
    plain = [f for f in files if not f.endswith(".gz")]
    if len(plain) != len(files) and plain:
        raise ValueError("mix of .gz and plain text files: give one kind (gzip them all, or none)")
    if not plain:
        units = [(f, 0, -1, os.path.getsize(f)) for f in files]
        return _by_middle(
            units, readers, lambda u: u[3], lambda f, a, b, _: Piece(f, 0, -1, count_rows(f, 0, -1, fmt))
        )
    sizes = [os.path.getsize(f) for f in files]
    total, out = sum(sizes), [[] for _ in range(readers)]
    base = 0
    for f, size in zip(files, sizes, strict=True):
        for r in range(readers):
            lo, hi = max(total * r // readers - base, 0), min(total * (r + 1) // readers - base, size)
            if hi > lo:
                out[r].append(Piece(f, lo, hi, count_rows(f, lo, hi, fmt)))
        base += size
    return out


def _by_middle(units, readers, weight, make) -> list[list[Piece]]:
    total = sum(weight(u) for u in units)
    out: list[list[Piece]] = [[] for _ in range(readers)]
    acc = 0
    for u in units:
        r = min(int((acc + weight(u) / 2) * readers // max(total, 1)), readers - 1)
        acc += weight(u)
        prev = out[r][-1] if out[r] else None
        if prev is not None and prev.path == u[0] and prev.stop == u[1] and u[2] != -1:  # adjacent row groups
            out[r][-1] = Piece(prev.path, prev.start, u[2], prev.rows + u[3])
        else:
            out[r].append(make(*u))
    return out


def count_rows(path: str, start: int, stop: int, fmt: str) -> int:
    """Rows of the lines starting in bytes [start, stop) (stop -1: the whole file), header excluded."""
    lines = 0
    with _open(path) as f:
        if stop == -1:  # a .gz file, whole
            last = b"\n"
            while chunk := f.read(BLOCK):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
            lines += last != b"\n"
        else:  # line starts s in [start, stop): s = 0, or s = p + 1 for a newline at p < size - 1
            size = os.fstat(f.fileno()).st_size
            lines = start == 0 and size > 0
            f.seek(max(start - 1, 0))
            left = min(stop, size) - 1 - max(start - 1, 0)
            while left > 0 and (chunk := f.read(min(BLOCK, left))):
                lines += chunk.count(b"\n")
                left -= len(chunk)
    return int(lines) - (fmt in ("csv", "tsv") and start == 0 and lines > 0)


def line_blocks(piece: Piece) -> Iterator[tuple[int, memoryview]]:
    """(offset, block): blocks of whole lines (each ends with a newline) of the lines starting in
    the piece, and where each block starts in the (uncompressed) file. Each block is a view of a
    buffer of its own (read once, not copied)."""
    with _open(piece.path) as f:
        pos = 0  # the file offset of the first byte not yet yielded
        if piece.start > 0:
            f.seek(piece.start - 1)
            f.readline()  # the line that started before `start` belongs to the previous piece
            pos = f.tell()
        stop = None if piece.stop == -1 else piece.stop
        carry = b""  # the start of a line that the previous read cut
        while stop is None or pos < stop:
            buf = bytearray(len(carry) + BLOCK)
            buf[: len(carry)] = carry
            end = len(carry) + f.readinto(memoryview(buf)[len(carry) :])
            if end == len(carry):  # the end of the file
                if carry:  # a last line without a newline
                    yield pos, memoryview(carry + b"\n")
                return
            cut = buf.rfind(b"\n", 0, end) + 1
            carry = bytes(buf[cut:end])
            if stop is not None and pos + cut > stop:  # keep the lines starting before `stop`
                yield pos, memoryview(buf)[: buf.index(b"\n", stop - 1 - pos) + 1]
                return
            if cut:
                yield pos, memoryview(buf)[:cut]
            pos += cut


def _parse_options(fmt: str) -> pcsv.ParseOptions:
    if fmt == "csv":
        return pcsv.ParseOptions(delimiter=",", ignore_empty_lines=False)
    if fmt in ("tsv", "criteo"):
        return pcsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False)
    return pcsv.ParseOptions(
        delimiter="\x01", quote_char=False, ignore_empty_lines=False
    )  # slot: whole lines


def parquet_file(path: str) -> pq.ParquetFile:
    """The Parquet file at `path`; ValueError naming it when it is not one (e.g. truncated: its footer
    is missing)."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable Parquet file (truncated or corrupt?): {e}") from None


def read_piece(
    piece: Piece, fmt: str, names: list[str] | None, types: dict[str, pa.DataType], rows: int
) -> Iterator[dict[str, pa.Array]]:
    """Batches of the piece's rows as {column: arrow array} for the columns of `types` (Parquet:
    batches of up to `rows` rows)."""
    if fmt == "parquet":
        f = parquet_file(piece.path)
        missing = [c for c in types if c not in f.schema_arrow.names]
        if missing:
            raise ValueError(f"{piece.path} has no columns {missing}; its columns: {f.schema_arrow.names}")
        batches = f.iter_batches(
            rows, row_groups=range(piece.start, piece.stop), columns=list(types), use_threads=False
        )
        while True:
            try:
                b = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise ValueError(
                    f"{piece.path}: cannot read row groups {piece.start}..{piece.stop} as Parquet: {e}"
                ) from None
            if b is None:
                return
            yield {c: b.column(c) for c in types}
    skip = int(piece.start == 0 and fmt in ("csv", "tsv"))  # the header line
    for offset, block in line_blocks(piece):
        try:
            if fmt == "slot":
                cols = _slot_columns(_lines(block), list(types))
            else:
                cols = _csv_columns(block, fmt, names, types, skip)
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as e:
            raise ValueError(
                f"{piece.path}: cannot read it as {fmt} (in the lines from byte {offset}; rows counted "
                f"from there{', the header being row #1' if skip else ''}): {e}"
            ) from None
        skip = 0
        yield cols


def _csv_columns(
    block: memoryview, fmt: str, names: list[str] | None, types: dict[str, pa.DataType], skip: int
) -> dict[str, pa.Array]:
    table = pcsv.read_csv(
        pa.py_buffer(block),
        read_options=pcsv.ReadOptions(
            column_names=names, use_threads=False, block_size=len(block) + 1, skip_rows=skip
        ),
        parse_options=_parse_options(fmt),
        convert_options=pcsv.ConvertOptions(
            include_columns=list(types),
            column_types=types,
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
            check_utf8=False,  # text columns are categoricals: their bytes are hashed as they are
        ),
    )
    return {c: _one_chunk(table.column(c)) for c in types}


def json_columns(block: bytes, types: dict[str, pa.DataType]) -> dict[str, pa.Array]:
    """{column: values} of JSON Lines (one object per line) for the columns of `types`: a key a
    line lacks (or null) is a missing value, keys not in `types` are ignored."""
    table = pjson.read_json(
        pa.py_buffer(block),
        read_options=pjson.ReadOptions(use_threads=False, block_size=len(block) + 1),
        parse_options=pjson.ParseOptions(
            explicit_schema=pa.schema(list(types.items())), unexpected_field_behavior="ignore"
        ),
    )
    return {c: _one_chunk(table.column(c)) for c in types}


def _one_chunk(col: pa.ChunkedArray) -> pa.Array:
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _lines(block: memoryview) -> pa.Array:
    return _one_chunk(
        pcsv.read_csv(
            pa.py_buffer(block),
            read_options=pcsv.ReadOptions(
                column_names=["line"], use_threads=False, block_size=len(block) + 1
            ),
            parse_options=_parse_options("slot"),
            convert_options=pcsv.ConvertOptions(
                column_types={"line": pa.string()}, strings_can_be_null=False
            ),
        ).column("line")
    )


def _slot_columns(lines: pa.Array, keys: list[str]) -> dict[str, pa.Array]:
    """{key: list<string> of each line's values of the key} of slot-format lines."""
    n = len(lines)
    tokens = pc.ascii_split_whitespace(lines)
    flat = pc.list_flatten(tokens)
    parent = pc.list_parent_indices(tokens).to_numpy()
    kv = pc.split_pattern(flat, ":", max_splits=1)
    if len(flat) and pc.min(pc.list_value_length(kv)).as_py() < 2:
        bad = pc.filter(flat, pc.less(pc.list_value_length(kv), 2))[0].as_py()
        raise ValueError(f"slot-format token {bad!r} is not key:value")
    key, value = pc.list_element(kv, 0), pc.list_element(kv, 1)
    out = {}
    for k in keys:
        mask = pc.equal(key, k)
        rows = parent[mask.to_numpy(zero_copy_only=False)] if len(flat) else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))]).astype(np.int32)
        out[k] = pa.ListArray.from_arrays(pa.array(offsets), pc.filter(value, mask))
    return out
