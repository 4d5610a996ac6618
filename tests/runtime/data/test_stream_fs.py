"""Pass directories on file systems other than a local path (runtime/data/streams/fs.py): fsspec's
in-memory file system (by URI and as a (file system, path) pair, wrapped by pyarrow's
FSSpecHandler), a pyarrow FileSystem pair and a `file://` URI. Reference: the records written
(ids in the `rid` column) and the same passes read from a local directory."""

from __future__ import annotations

import collections
import glob
import tempfile
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from runtime.data.streams import PassDirectorySource, StreamPosition, StreamStalled

fsspec = pytest.importorskip("fsspec")

SCHEMA = {"label": "click", "dense": ["rid"], "sparse": ["user"], "vocab": 64}
PASSES = {"20240101/23": [range(0, 7), range(7, 17)], "20240102/00": [range(17, 30)]}


def body(rows) -> bytes:
    return ("click,rid,user\n" + "".join(f"{r % 2},{r},u{r % 7}\n" for r in rows)).encode()


def write(put, passes=PASSES, flag=True) -> None:
    """`put(relative path, bytes)` for each file of `passes`, then their done flags."""
    for name, files in passes.items():
        for k, rows in enumerate(files):
            put(f"{name}/part-{k:05d}.csv", body(rows))
        if flag:
            put(f"{name}/_SUCCESS", b"")


def ids(batches) -> list[int]:
    return [int(x) for b in batches for x in b["dense"][:, 0]]


@pytest.fixture
def memory_root():
    """A fresh root in fsspec's (process-wide) memory file system, removed after the test."""
    mem = fsspec.filesystem("memory")
    root = f"/logs-{uuid.uuid4().hex}"
    write(lambda rel, data: mem.pipe(f"{root}/{rel}", data))
    yield mem, root
    mem.rm(root, recursive=True)


def staged_dirs() -> set[str]:
    return set(glob.glob(f"{tempfile.gettempdir()}/hetps-pass-*"))


@pytest.mark.parametrize("how", ["uri", "fsspec pair", "pyarrow pair"])
def test_passes_on_fsspecs_memory_file_system_read_as_the_records_written(memory_root, how):
    mem, root = memory_root
    spec = {
        "uri": f"memory://{root}",
        "fsspec pair": (mem, root),
        "pyarrow pair": (pafs.PyFileSystem(pafs.FSSpecHandler(mem)), root),
    }[how]
    before = staged_dirs()
    src = PassDirectorySource(spec, SCHEMA, batch_size=8, follow=False)
    got = [(p.id, ids(p.batches)) for p in src.passes()]
    assert got == [("20240101/23", list(range(17))), ("20240102/00", list(range(17, 30)))]
    assert staged_dirs() == before  # each pass's local copies are gone once it was read


def test_a_memory_stream_resumes_mid_file_from_a_saved_position_reading_every_record_once(memory_root):
    mem, root = memory_root
    first = PassDirectorySource(f"memory://{root}", SCHEMA, batch_size=5, follow=False)
    it = first.batches()
    got = ids(next(it) for _ in range(2))
    second = PassDirectorySource((mem, root), SCHEMA, batch_size=5, follow=False)
    second.seek(StreamPosition.from_json(first.position().to_json()))
    got += ids(second.batches())
    assert collections.Counter(got) == collections.Counter(range(30))


def test_a_missing_flag_on_a_memory_file_system_stalls_naming_the_folder_by_uri():
    mem, root = fsspec.filesystem("memory"), f"/logs-{uuid.uuid4().hex}"
    write(lambda rel, data: mem.pipe(f"{root}/{rel}", data), flag=False)
    try:
        src = PassDirectorySource(f"memory://{root}", SCHEMA, 8, poll=0.02, timeout=0.2)
        with pytest.raises(StreamStalled, match=rf"memory://{root}/20240101/23 has had no done flag"):
            next(src.batches())
    finally:
        mem.rm(root, recursive=True)


def test_a_file_uri_reads_the_local_directory_in_place(tmp_path):
    def put(rel, data):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)

    write(put)
    by_uri = PassDirectorySource(Path(tmp_path).as_uri(), SCHEMA, batch_size=8, follow=False)
    assert by_uri.tree.local
    local = PassDirectorySource(tmp_path, SCHEMA, batch_size=8, follow=False)
    assert [ids(p.batches) for p in by_uri.passes()] == [ids(p.batches) for p in local.passes()]


def test_a_root_no_file_system_reads_is_refused_naming_it():
    with pytest.raises(ValueError, match="nosuchscheme://x/logs: neither pyarrow.fs"):
        PassDirectorySource("nosuchscheme://x/logs", SCHEMA, 8)
    with pytest.raises(ValueError, match="pyarrow.fs.FileSystem or an fsspec filesystem, got int"):
        PassDirectorySource((3, "/logs"), SCHEMA, 8)
