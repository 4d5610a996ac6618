"""What a cost profile holds: kernel times per op signature and trainer kind, the link, the
parameter server and the per-process overheads, measured on one machine (runtime/profile/machine.py
measures them; transpiler/cost/model.py predicts from them)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ops_registry import get_op
from transpiler.config import KINDS
from transpiler.ir import Op, Program

COMM_TYPES = frozenset({"send", "recv", "pull_dense", "push_dense", "pull_sparse", "push_sparse", "data"})


def op_signature(op: Op, program: Program) -> str:
    """What an op's kernel time depends on: type, input shapes and dtypes, attrs (a short hash)."""
    block = program.global_block()
    ins = {}
    for slot, names in sorted(op.inputs.items()):
        vs = [block.vars.get(n) for n in names if n]
        ins[slot] = [(list(v.shape) if v.shape is not None else None, v.dtype) if v else None for v in vs]
    attrs = {k: v for k, v in op.attrs.items() if k not in ("op_role", "op_device", "fwd_id")}
    text = json.dumps([op.type, ins, attrs], sort_keys=True, default=str)
    return f"{op.type}:{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def kernel_ops(program: Program) -> list[Op]:
    """The ops of a (sub-)program that run a registry kernel (not comm, PS or data ops)."""
    return [op for op in program.ops if op.type not in COMM_TYPES and get_op(op.type).kernel is not None]


# -- the measured profile -------------------------------------------------------------------------
@dataclass
class KernelCost:
    """Seconds for one call of an op's kernel on `examples` examples: fixed_s + per_example_s * n."""

    fixed_s: float
    per_example_s: float

    def at(self, examples: float) -> float:
        return self.fixed_s + self.per_example_s * examples


@dataclass
class LinkCost:
    """One message between two processes: latency_s + per_byte_s * bytes, for each of the sender and
    the receiver (each pays half of a measured send + receive)."""

    latency_s: float
    per_byte_s: float

    def message(self, nbytes: float) -> float:
        return self.latency_s + self.per_byte_s * nbytes


@dataclass
class PSCost:
    """A parameter-server round trip: request_s each, table_s per table in it, plus per byte of dense
    tables, plus per sparse row (id handling) and per byte of sparse rows; `client_cpu`: the share
    of a round trip's time the client spends on its own CPU (encoding, signing, decoding; the rest
    it waits for the shard, whose serving is counted on the shard)."""

    request_s: float
    dense_byte_s: float
    sparse_byte_s: float
    sparse_row_s: float = 0.0
    lookup_s: float = 0.0  # a reader's own work per id looked up (gather of pulled rows, merge of grads)
    table_s: float = 0.0  # per table in a request (a pull or push of many tables is one request)
    union_s: float = 0.0  # a reader's own work per id of a step's feed (the union of its ids, per feed)
    client_cpu: float = 1.0


@dataclass
class Overhead:
    """The runtime's own CPU work beyond kernels, messages and PS calls (trainer loop, scheduling,
    reports), calibrated from short real runs: per item and per step of a reader trainer and of
    another trainer, per step and trainer a shard serves, and the driver's per item and step.

    Most of a trainer's work per item beyond its profiled kernels is per op (the executor's dispatch
    of each op, the op's call in a running process rather than in a hot loop), so the per-item
    figures hold for the calibration model's trainers and scale with the ops per item of another
    model's: `reader_ops` / `ops` are the calibration plan's kernel ops of the reader and of the
    other trainer type (0: not recorded, the figures taken as they are)."""

    reader_item_s: float = 0.0
    reader_step_s: float = 0.0
    item_s: float = 0.0
    step_s: float = 0.0
    serve_trainer_s: float = 0.0
    driver_item_s: float = 0.0  # the driver (the process calling train): per item reported
    driver_step_s: float = 0.0  # and per step; it shares the cores, off the critical path
    reader_ops: int = 0  # kernel ops per item of the calibration plan's reader type
    ops: int = 0  # and of its other trainer type

    def per_item_s(self, reader: bool, ops: int) -> float:
        """The overhead per item of a trainer type with `ops` kernel ops per item (the reader's or
        another's), scaled from the calibration plan's by ops."""
        item, base = (self.reader_item_s, self.reader_ops) if reader else (self.item_s, self.ops)
        return item * ops / base if base and ops else item


@dataclass
class Load:
    """How busy the machine was (runtime/profile/load.py measures it): the `cores` a run may use,
    the share of a core a busy calibration thread got beside the other processes: `alone` (one
    thread) and `all_cores` (each of one thread per core at once), +- `spread` (relative, half the
    range over the probe's slices); the load average and the run queue (other runnable threads) then,
    and when (`at`, seconds since the epoch)."""

    cores: int
    alone: float = 1.0
    all_cores: float = 1.0
    spread: float = 0.0
    load_average: float = 0.0
    run_queue: float = 0.0
    at: float = 0.0
    chain: float = 1.0  # the share of the wall time a chain of two processes waking each other progresses
    competing: float = 0.0  # other processes' runnable threads, weighted by nice (runtime/profile/load.py)
    # the other sessions' scheduling groups (Linux autogroups) with runnable threads: (their runnable
    # threads weighted by nice, the group's weight against this run's group); empty when the kernel
    # does not group by session, and then `competing` counts every other process
    groups: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        self.groups = check_groups(self.groups, "Load.groups")

    @property
    def capacity(self) -> float:
        """Cores a run gets when it keeps every core busy."""
        return self.cores * self.all_cores

    def describe(self) -> str:
        return (
            f"{self.cores} core(s), of which a run gets {self.capacity:.2f} (a busy thread gets "
            f"{100 * self.alone:.0f}% of a core alone, {100 * self.all_cores:.0f}% with one per core, "
            f"{100 * self.chain:.0f}% in a chain; +-{100 * self.spread:.0f}%); load average "
            f"{self.load_average:.1f}, {self.run_queue:.1f} other runnable threads ({self.competing:.1f} "
            f"weighted by nice{_in_groups(self.groups)})"
        )


def _in_groups(groups: tuple[tuple[float, float], ...]) -> str:
    if not groups:
        return ""
    return f" in this session, {sum(d for d, _ in groups):.1f} in {len(groups)} other session(s)"


def check_groups(groups: Any, what: str) -> tuple[tuple[float, float], ...]:
    """`groups` as a tuple of (runnable threads >= 0, weight > 0) pairs (a file's lists too)."""
    try:
        out = tuple((float(d), float(w)) for d, w in groups)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be (runnable threads, weight) pairs, got {groups!r}") from None
    if not all(d >= 0 and w > 0 for d, w in out):
        raise ValueError(f"{what}: runnable threads must be >= 0 and weights > 0, got {groups!r}")
    return out


@dataclass
class Profile:
    """What was measured on one machine. `kernels[kind][signature]`; `emulated`: kinds whose kernels
    ran on the CPU (a GPU type emulated with numpy), so they use CPU cores."""

    kernels: dict[str, dict[str, KernelCost]]
    link: LinkCost
    ps: PSCost
    cores: int = 1
    emulated: list[str] = field(default_factory=list)
    machine: str = ""
    overhead: dict[str, Overhead] = field(default_factory=dict)  # by PS mode (sync, async)
    method: int = 0  # the version of the measuring code (runtime/profile/machine.py METHOD) that made it
    load: Load | None = None  # the machine's load when it was measured (None: not measured)

    def overhead_for(self, mode: str) -> Overhead:
        return self.overhead.get(mode) or Overhead()

    def kernel(self, kind: str, sig: str, op: Op | None = None) -> KernelCost:
        try:
            return self.kernels[kind][sig]
        except KeyError:
            what = f"op {op.type!r} (id {op.id})" if op is not None else sig
            raise KeyError(
                f"the profile has no {kind} time for {what}; profile the plan's ops first "
                "(runtime.profile.machine.machine_profile, or `hetps tune`, which profiles what is "
                "missing)"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        kernels = {k: {s: KernelCost(**c) for s, c in table.items()} for k, table in d["kernels"].items()}
        return cls(
            kernels,
            LinkCost(**d["link"]),
            PSCost(**d["ps"]),
            d.get("cores", 1),
            list(d.get("emulated", [])),
            d.get("machine", ""),
            {mode: Overhead(**o) for mode, o in d.get("overhead", {}).items()},
            int(d.get("method", 0)),
            Load(**d["load"]) if d.get("load") else None,
        )

    def missing(self, programs: dict[str, Program], kinds: Iterable[str] = KINDS) -> dict[str, list[Op]]:
        """{kind: ops of `programs` without a kernel time for that kind}."""
        out: dict[str, list[Op]] = {}
        for kind in kinds:
            have = self.kernels.get(kind, {})
            for prog in programs.values():
                for op in kernel_ops(prog):
                    if op_signature(op, prog) not in have:
                        out.setdefault(kind, []).append(op)
        return out


# -- settings and predictions -----------------------------------------------------------------------
