"""Reading a parameter-server request's fields, each checked (a malformed request is refused with
a PSError naming the field), and naming its outcome (trace span, error reply)."""

from __future__ import annotations

from typing import Any

from runtime.ps.table import PSError


def field(h: dict, key: str, kind: type, optional: bool = False) -> Any:
    v = h.get(key)
    if (v is None and optional) or (isinstance(v, kind) and not isinstance(v, bool)):
        return v
    raise PSError(f"request {h.get('op')!r} needs field {key!r} of type {kind.__name__}, got {v!r}")


class ParkPulls(Exception):  # noqa: N818 (a signal, not an error)
    """The pushes of a push_pull are applied, its pulls must wait: park `header` (pulls only)."""

    def __init__(self, table: str, header: dict, arrays: list) -> None:
        super().__init__(table)
        self.table, self.header, self.arrays = table, header, arrays


def parts(h: dict, key: str, counts: tuple[int, ...], arrays: list) -> list[tuple[str, list]]:
    """The (table, arrays) parts `h[key]` = [[table, number of arrays], ...] describes, taken in
    order from `arrays`; PSError when malformed (a dense table pulled more than once)."""
    spec = h.get(key, [])
    if not isinstance(spec, list) or not all(
        isinstance(p, list)
        and len(p) == 2
        and isinstance(p[0], str)
        and p[1] in counts
        and not isinstance(p[1], bool)
        for p in spec
    ):
        raise PSError(
            f"push_pull field {key!r} must be a list of [table, number of arrays in {counts}], "
            f"got {spec!r:.200}"
        )
    bare = [t for t, n in spec if n == 0]  # a dense pull carries nothing: its reply is not bounded
    if len(set(bare)) != len(bare):  # by the request's bytes, so once per request
        raise PSError(f"push_pull {key!r} pulls a dense table more than once: {bare}")
    out, i = [], 0
    for table, n in spec:
        out.append((table, arrays[i : i + n]))
        i += n
    if i != len(arrays):
        raise PSError(f"push_pull describes {i} arrays, the request carries {len(arrays)}")
    return out


def span_name(h: dict) -> str:
    """A request's name in a trace: pull, push, or push_pull for one that does both."""
    if h.get("op") != "push_pull":
        return str(h.get("op"))
    return "push_pull" if h.get("push") and h.get("pull") else "push" if h.get("push") else "pull"


def describe(e: Exception) -> str:
    """A refusal's own message; any other failure prefixed by its type (it is a server bug)."""
    return str(e) if isinstance(e, PSError) else f"{type(e).__name__}: {e}"
