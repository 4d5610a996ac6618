"""The name of one process of a run: its kind and index, written "kind:index" ("cpu:0", "gpu:1",
"ps:0", "eval:2"). Endpoints, engines, reports and traces key processes by that string; this module
is the one place that builds and parses it. A leaf: it imports nothing from the runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

SERVER = "ps"  # the kind of a parameter-server shard
EVALUATOR = "eval"  # the kind of an evaluation worker (runtime.evaluation.workers)


@dataclass(frozen=True, slots=True, order=True)
class ProcessId:
    """A process of kind `kind` (a trainer type, `SERVER` or `EVALUATOR`), the `index`-th of its kind."""

    kind: str
    index: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind or ":" in self.kind:
            raise ValueError(f"a process kind must be a non-empty string without ':', not {self.kind!r}")
        if type(self.index) is not int or self.index < 0:
            raise ValueError(f"a process index must be an int >= 0, not {self.index!r} (kind {self.kind!r})")

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @classmethod
    def parse(cls, name: str) -> ProcessId:
        """The id written `name` ("cpu:0"); a ValueError says what is wrong with a malformed one."""
        kind, _, index = name.partition(":") if isinstance(name, str) else ("", "", "")
        if kind and index.isascii() and index.isdecimal() and ":" not in index:
            pid = cls(kind, int(index))
            if str(pid) == name:  # (no leading zeros: one name per process)
                return pid
        raise ValueError(f"{name!r} is not a process name: expected 'kind:index' such as 'cpu:0' or 'ps:1'")

    @classmethod
    def maybe(cls, name: str) -> ProcessId | None:
        """The id written `name`, or None where `name` is not a process name ("driver")."""
        try:
            return cls.parse(name)
        except ValueError:
            return None

    @classmethod
    def server(cls, shard: int) -> ProcessId:
        """Parameter-server shard `shard` ("ps:shard")."""
        return cls(SERVER, shard)

    @property
    def is_server(self) -> bool:
        return self.kind == SERVER


def process_names(kind: str, count: int) -> list[str]:
    """The names of processes 0 .. count - 1 of `kind`: ["cpu:0", "cpu:1", ...]."""
    return [str(ProcessId(kind, i)) for i in range(count)]


def by_kind(of_name: dict[str, T]) -> dict[str, list[T]]:
    """{kind: its processes' values, by index} of {process name: value}; a ValueError for a malformed
    name or a kind whose indices are not 0 .. n - 1."""
    by: dict[str, dict[int, T]] = {}
    for name, value in of_name.items():
        pid = ProcessId.parse(name)
        by.setdefault(pid.kind, {})[pid.index] = value
    for kind, values in by.items():
        if sorted(values) != list(range(len(values))):
            raise ValueError(
                f"processes of kind {kind!r} have indices {sorted(values)}, not 0 .. {len(values) - 1}"
            )
    return {kind: [values[i] for i in range(len(values))] for kind, values in by.items()}
