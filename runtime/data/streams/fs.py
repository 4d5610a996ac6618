"""Where a pass-directory stream lives (`PassDirectorySource`'s `root`): a local directory, or a
directory of any file system pyarrow.fs reads.

`root` may be
- a local path (str or PathLike), or a `file://` URI: read in place;
- a URI pyarrow knows (`s3://bucket/logs`, `gs://...`, `hdfs://...`: `pyarrow.fs.FileSystem.
  from_uri`), else one fsspec knows (`memory://logs`, `abfs://...`, with fsspec installed: the
  `stream` extra), wrapped as `pyarrow.fs.PyFileSystem(FSSpecHandler(fs))`;
- a pair (file system, path): a `pyarrow.fs.FileSystem`, or an fsspec filesystem (wrapped the
  same way).

Listing (pass folders, done flags, a pass's files) goes through the file system; the files of a
pass on a non-local file system are copied into a private temporary directory when the pass is
read (the format readers open local paths: byte ranges of text, .gz, Parquet row groups) and
removed when its last batch was read, so one pass at a time is on local disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs


@dataclass(frozen=True)
class Tree:
    """A directory tree on file system `fs` below `root` (a path in `fs`); `local`: `fs` is this
    machine's, its files read in place; `name`: how messages name the root."""

    fs: pafs.FileSystem
    root: str
    local: bool
    name: str

    def join(self, *parts: str) -> str:
        """The path of `parts` (each "a" or "a/b") below the root."""
        parts = tuple(p for p in parts if p)
        return "/".join([self.root.rstrip("/"), *parts]) if parts else self.root

    def describe(self, path: str) -> str:
        """`path` as messages name it (a URI on a non-local file system)."""
        if self.local:
            return path
        return self.name.rstrip("/") + path[len(self.root.rstrip("/")) :]

    def _list(self, path: str, kind: pafs.FileType) -> list[str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except (NotADirectoryError, FileNotFoundError):
            return []
        return sorted(i.base_name for i in infos if i.type == kind)

    def dirs(self, path: str) -> list[str]:
        """The names of the directories in `path` (none when it is not a directory)."""
        return self._list(path, pafs.FileType.Directory)

    def files(self, path: str) -> list[str]:
        """The names of the files in `path`."""
        return self._list(path, pafs.FileType.File)

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type != pafs.FileType.NotFound

    @contextlib.contextmanager
    def staged(self, paths: list[str]) -> Iterator[list[str]]:
        """Local paths of `paths` while the block runs: the files themselves on a local file
        system, else copies in a private temporary directory, removed at the end of the block."""
        if self.local:
            yield paths
            return
        tmp = tempfile.mkdtemp(prefix="hetps-pass-")
        try:
            out = []
            for k, p in enumerate(paths):
                local = os.path.join(tmp, f"{k:05d}-{p.rsplit('/', 1)[-1]}")
                with self.fs.open_input_stream(p) as src, open(local, "wb") as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)
                out.append(local)
            yield out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def tree(root: Any) -> Tree:
    """The `Tree` that `root` names (see the module docstring); ValueError when it names none."""
    if isinstance(root, tuple):
        if len(root) != 2 or not isinstance(root[1], str):
            raise ValueError(f"a stream root pair is (file system, path as str), got {root!r:.200}")
        fs = _pyarrow_fs(root[0])
        return _made(fs, root[1], f"{type(root[0]).__name__}:{root[1]}")
    if isinstance(root, str) and "://" in root:
        return _from_uri(root)
    if isinstance(root, (str, os.PathLike)):
        path = str(Path(root).absolute())
        return Tree(pafs.LocalFileSystem(), path, True, path)
    raise ValueError(
        f"a stream root is a path, a URI or a (file system, path) pair, got {type(root).__name__}"
    )


def _made(fs: pafs.FileSystem, path: str, name: str) -> Tree:
    local = isinstance(fs, pafs.LocalFileSystem)
    return Tree(fs, str(Path(path).absolute()) if local else path, local, name)


def _from_uri(uri: str) -> Tree:
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, TypeError) as e:  # (pyarrow.ArrowInvalid is a ValueError)
        try:
            import fsspec.core
        except ImportError:
            raise ValueError(
                f"{uri}: pyarrow.fs does not read this URI ({e}), and fsspec, which may, is not "
                "installed (pip install fsspec, or hetps[stream])"
            ) from None
        try:
            ffs, path = fsspec.core.url_to_fs(uri)
        except (ValueError, ImportError) as e2:
            raise ValueError(f"{uri}: neither pyarrow.fs ({e}) nor fsspec ({e2}) reads this URI") from None
        fs = _pyarrow_fs(ffs)
    return _made(fs, path, uri)


def _pyarrow_fs(fs: Any) -> pafs.FileSystem:
    """`fs` as a pyarrow FileSystem (an fsspec filesystem wrapped by FSSpecHandler)."""
    if isinstance(fs, pafs.FileSystem):
        return fs
    if type(fs).__module__.split(".")[0] == "fsspec" or hasattr(fs, "protocol") and hasattr(fs, "ls"):
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    raise ValueError(
        f"a stream root's file system is a pyarrow.fs.FileSystem or an fsspec filesystem, got "
        f"{type(fs).__name__}"
    )
