"""Device graphs: a gpu trainer's segments captured once into CUDA graphs and replayed every step,
so that the host launches a few graphs instead of dispatching each kernel (docs/gpu.md).

A segment's ops split into the handlers that give its kernels their inputs (recv, pull_dense: run
on the host first), its kernels, and the handlers that take the kernels' results (send,
push_dense: run after); a handler that takes kernels' results and feeds later kernels (the
loss-gradient seed, scaled per item on the host) cuts the kernels into parts, each its own graph.
A part runs eagerly `warmup` times (cupy compiles and caches its kernels), is then captured with
cupy's stream capture (`Stream.begin_capture` / `end_capture`, on a stream of its own, with a
private memory pool so that no one else is handed the graph's memory), and from then on each run
copies its inputs into the graph's input buffers (but for inputs that are the same array at every
run, the held tables, read where they are, and for those another graph's output or input buffer
holds already: the backward part reads the received tensors the forward part copied in), launches
the graph on the compute stream and hands out its output buffers. An item (a ctx with a `key`: a
trainer's micro-batch) gets a *lane* of its own, one set of every part's graph
captured on buffers of its own, until `release(key)` (nothing reads its outputs any more: a trainer
releases an item's lane when the item's step is pushed): its outputs are read where its graphs wrote
them, and another item's replays, in other lanes, never overwrite them. A run without a key, or once
`lanes` lanes are lent, replays the shared lane, whose outputs are copied off (another run's replay
overwrites its buffers while this one still holds the values). `GraphedCall` does
the same for one function of named arrays (the held tables' optimizer step).

A part runs eagerly instead, said once per reason (a warning of logger `hetps.device`), when it
cannot be captured: an op draws random numbers seeded per step (a graph would replay one draw), a
kernel writes one of its inputs in place (an optimizer op: the graph would write the buffer, not
the value), a kernel synchronises with the host (CUDA refuses it during capture), or an input's
shape or dtype differs from the captured one (the last partial batch); an input read in place that
became another array makes it eager once and captured again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("hetps.device")


@dataclass
class Part:
    """A run of a segment's kernels captured as one graph, and the handlers run after it (those
    that take its results and feed later kernels: the loss-gradient seed, scaled per item on the
    host)."""

    kernels: list
    inputs: list[str]  # names its kernels read that none of them makes
    after: list = field(default_factory=list)
    needed: set[str] = field(default_factory=set)  # names read by what runs after it


@dataclass
class SegmentPlan:
    """A segment split for capture. `why`: why it cannot be captured ("" when it can)."""

    pre: list  # handler steps that read nothing a kernel makes (run first)
    parts: list[Part]  # its kernels, cut where a handler takes their results and feeds later ones
    post: list  # handler steps that take the kernels' results and feed none (send, push_dense)
    why: str = ""


@dataclass
class CapturedGraph:
    """A captured part: its graph, input buffers and output arrays (by name), the signature
    (name, shape, dtype) of the inputs it was captured for, and its private memory pool."""

    graph: Any
    inputs: dict[str, Any]  # buffers its inputs are copied into before each launch
    inplace: dict[str, Any]  # inputs it reads where they are (the same array every run: held tables)
    outputs: dict[str, Any]
    signature: tuple
    pool: Any
    # inputs read from another graph's buffer (output or input): name -> (that graph, the buffer's name)
    linked: dict[str, tuple[CapturedGraph, str]] = field(default_factory=dict)
    holds: dict[str, Any] = field(default_factory=dict)  # buffer -> the array whose values it holds
    copy: bool = True  # its outputs are copied off at each replay (the shared lane's)

    def buffer(self, name: str) -> Any:
        """Its output or input buffer `name` (what a graph linked to it reads)."""
        return self.outputs[name] if name in self.outputs else self.inputs[name]


@dataclass
class GraphStats:
    """Runs of graphed parts: captures, replays, eager runs (warm-up and fallback)."""

    captured: int = 0
    replays: int = 0
    eager: int = 0
    refused: dict[str, str] = field(default_factory=dict)  # part -> why it ran eagerly (the latest)

    def as_dict(self, prefix: str = "") -> dict[str, int]:
        """As a trainer reports them (`History.trainers`), the keys after `prefix`."""
        got = {
            "graphs_captured": self.captured,
            "graph_replays": self.replays,
            "graph_eager_runs": self.eager,
            "graph_eager_parts": len(self.refused),
        }
        return {prefix + k: v for k, v in got.items()}


Execute = Callable[[list, dict, set, Any, int], None]  # Executor._execute


def _names(slots: list) -> list[str]:
    out = []
    for _, names, variadic, *_ in slots:
        out.extend(n for n in (names if variadic else [names]) if n)
    return out


def plan_segment(steps: list) -> SegmentPlan:
    """Split a compiled segment's steps (`Executor._compile`): handlers that read nothing a kernel
    of the segment makes (moved ahead), kernel parts, handlers after; say why it cannot be
    captured."""
    plan = SegmentPlan([], [Part([], [])], [])
    made: set[str] = set()
    for i, s in enumerate(steps):
        if not s.handler:
            part = plan.parts[-1]
            part.inputs += [n for n in _names(s.ins) if n not in made and n not in part.inputs]
            part.kernels.append(s)
            made.update(_names(s.outs))
        elif not made & set(s.op.input_names()):
            plan.pre.append(s)
        elif set(s.op.output_names()) & {n for k in steps[i + 1 :] if not k.handler for n in _names(k.ins)}:
            plan.parts[-1].after.append(s)
            plan.parts.append(Part([], []))
            made = set()  # (what the next part reads from before it is its input)
        else:
            plan.post.append(s)
    plan.parts = [p for p in plan.parts if p.kernels]
    later = set(_names_of(plan.post))
    for p in reversed(plan.parts):
        p.needed = set(later)
        later |= _names_of(p.after) | set(p.inputs)
    whys = [_kernels_why(p.kernels, set(p.inputs)) for p in plan.parts]
    plan.why = next((w for w in whys if w), "") if plan.parts else "it has no kernels"
    return plan


def _kernels_why(kernels: list, inputs: set[str]) -> str:
    """Why these kernels cannot be replayed as a graph ("" when they can)."""
    for s in kernels:
        written = set(_names(s.outs)) & inputs
        if s.needs_rng:
            return f"its {s.op.type} op (id {s.op.id}) draws random numbers seeded per step"
        if written:
            return f"its {s.op.type} op (id {s.op.id}) writes its input(s) {sorted(written)} in place"
    return ""


class DeviceGraphs:
    """The captured graphs of an Executor's segments (one per kernel part of a segment, for the
    input signature it was captured with); `execute` runs a compiled segment through them
    (`Executor(graphs=)`)."""

    def __init__(self, xp: Any, warmup: int = 1, lanes: int = 8) -> None:
        self.xp, self.warmup, self.max_lanes = xp, warmup, lanes
        self.plans: dict[int, SegmentPlan] = {}
        # ((id of compiled segment, part), lane): lane None is the shared one (outputs copied off)
        self.graphs: dict[tuple[tuple[int, int], int | None], CapturedGraph] = {}
        self.lanes: dict[Any, int | None] = {}  # item key -> its lane (None: the shared one)
        self.free: list[int] = []  # lanes made and not lent
        self.made = 0  # lanes made
        self.failed: dict[tuple[int, int], str] = {}  # parts whose capture failed: why
        self.seen: dict[tuple[int, int], int] = {}  # eager runs of a part before its capture
        self.last: dict[tuple[int, int], dict[str, Any]] = {}  # a part's inputs at its last run
        self.moved: dict[tuple[int, int], set[str]] = {}  # inputs that were another array since
        self.told: set[tuple[str, str]] = set()
        self.stats = GraphStats()

    def execute(self, compiled: Any, values: dict, keep: set, ctx: Any, rng: int, run: Execute) -> None:
        """Run compiled segment `compiled` on `values` (as `Executor._execute` would): its
        handlers on the host, each kernel part as a graph replay once captured."""
        plan = self.plans.get(id(compiled))
        if plan is None:
            plan = self.plans[id(compiled)] = plan_segment(compiled.steps)
        if plan.why:
            self._eager(_name(compiled, None), plan.why)
            return run(compiled.steps, values, keep, ctx, rng)
        if plan.pre:
            run(plan.pre, values, keep, ctx, rng)
        lane = self._lane(getattr(ctx, "key", None))
        for i, part in enumerate(plan.parts):
            where = ((id(compiled), i), lane)
            graph = self.graphs.get(where)
            if graph is None or not self._replay(graph, values):
                self._run_part(where, _name(compiled, i), part, values, keep | part.needed, (ctx, rng, run))
            if part.after:
                run(part.after, values, keep, ctx, rng)
        if plan.post:
            run(plan.post, values, keep, ctx, rng)

    def _lane(self, key: Any) -> int | None:
        """The lane lent to item `key` (lent now if it has none: a free one, a new one while fewer
        than `lanes` exist, else the shared one, None), None for a run without a key."""
        if key is None:
            return None
        if key not in self.lanes:
            if not self.free and self.made < self.max_lanes:
                self.free.append(self.made)
                self.made += 1
            self.lanes[key] = self.free.pop() if self.free else None
        return self.lanes[key]

    def release(self, key: Any) -> None:
        """Nothing reads the values item `key`'s graphs handed out any more (its step is pushed): its
        lane goes back to be lent to another item (whose replays overwrite those values)."""
        lane = self.lanes.pop(key, None)
        if lane is not None:
            self.free.append(lane)

    def _run_part(self, where: tuple, name: str, part: Part, values: dict, keep: set, how: tuple) -> None:
        """One kernel part: its graph replayed, or its kernels run eagerly."""
        graph = self._graph_for(where, name, part, values, keep, how)
        if graph is not None and not self._replay(graph, values):
            self._moved(where, name, graph, values)
            graph = None
        if graph is None:
            ctx, rng, run = how
            run(part.kernels, values, keep, ctx, rng)

    def _eager(self, name: str, why: str) -> None:
        """Count an eager run; say why (once per part and reason) when it is not the warm-up."""
        self.stats.eager += 1
        if why and (name, why) not in self.told:
            self.told.add((name, why))
            self.stats.refused[name] = why
            log.warning("device graphs: %s runs eagerly: %s", name, why)

    def _graph_for(
        self, where: tuple, name: str, part: Part, values: dict, keep: set, how: tuple
    ) -> CapturedGraph | None:
        """The part's graph for these inputs (captured now, after the warm-up), or None: run its
        kernels eagerly (the warm-up, or why not, said once)."""
        sig, why = _signature(self.xp.ndarray, part.inputs, values)
        graph = self.graphs.get(where)
        ref = graph or self._other_lane(where)
        if ref is not None and not why and sig != ref.signature:
            why = f"its inputs {_changed(part.inputs, ref.signature, sig)} differ from the captured ones"
        why = why or self.failed.get(where[0], "")
        if graph is not None and not why:
            return graph
        if why:
            self._eager(name, why)
            return None
        if ref is not None:  # captured in another lane: this lane's own now, no warm-up
            same = {n for n, a in ref.inplace.items() if values[n] is a}
        else:
            same = self._same_as_last(where[0], part, values)
            if same is None:
                self._eager(name, "")
                return None
        graph, why = self._capture(part, values, same - self.moved.get(where[0], set()), keep, where[1], *how)
        if graph is None:
            self.failed[where[0]] = why
            self._eager(name, why)
            return None
        graph.signature = sig
        self.graphs[where] = graph
        self.stats.captured += 1
        return graph

    def _other_lane(self, where: tuple) -> CapturedGraph | None:
        """The part's graph in another lane, if any (its signature and in-place inputs hold here)."""
        return next((g for (w, _), g in self.graphs.items() if w == where[0]), None)

    def _same_as_last(self, part_at: tuple, part: Part, values: dict) -> set[str] | None:
        """A run of the part before its first capture: None while it warms up (run it eagerly),
        then the inputs that are the same arrays as at the run before (read in place)."""
        self.seen[part_at] = self.seen.get(part_at, 0) + 1
        now, before = {n: values[n] for n in part.inputs}, self.last.get(part_at, {})
        same, self.last[part_at] = {n for n, a in now.items() if before.get(n) is a}, now
        return None if self.seen[part_at] <= self.warmup else same

    def _capture(
        self,
        part: Part,
        values: dict,
        inplace: set[str],
        keep: set,
        lane: int | None,
        ctx: Any,
        rng: int,
        run: Execute,
    ) -> tuple[CapturedGraph | None, str]:
        """Capture the part's kernels for `lane` on fixed input buffers (copies of `values`' inputs,
        but those in `inplace`: the same arrays as at the last run, read where they are, and those
        a buffer of a graph of the lane holds); (None, why) when the capture fails."""
        xp = self.xp
        linked = {n: got for n in part.inputs if n not in inplace and (got := self._holder(values[n], lane))}
        bufs = {n: values[n].copy() for n in part.inputs if n not in inplace and n not in linked}
        vals = {**values, **bufs, **{n: g.buffer(m) for n, (g, m) in linked.items()}}
        graph, pool, why = capture(xp, lambda: run(part.kernels, vals, keep, ctx, rng))
        if why:
            return None, why
        made = {n for s in part.kernels for n in _names(s.outs)}
        outputs = {n: vals[n] for n in made if n in vals}
        held = {n: values[n] for n in inplace}
        return CapturedGraph(graph, bufs, held, outputs, (), pool, linked, copy=lane is None), ""

    def _holder(self, value: Any, lane: int | None) -> tuple[CapturedGraph, str] | None:
        """(graph of `lane`, buffer) whose buffer holds `value`'s values: an output buffer it
        handed out (or in the shared lane a copy of it), an input buffer `value` was copied into."""
        for (_, at), graph in self.graphs.items():
            if at != lane:
                continue
            for name, held in graph.holds.items():
                if held is value:
                    return graph, name
        return None

    def _moved(self, where: tuple, name: str, graph: CapturedGraph, values: dict) -> None:
        """An input the graph reads in place is another array now: drop the graph (the part is
        captured again, with a buffer for that input)."""
        moved = {n for n, a in graph.inplace.items() if values[n] is not a}
        self.moved.setdefault(where[0], set()).update(moved)
        for at in [k for k in self.graphs if k[0] == where[0]]:  # (every lane's: they read it too)
            del self.graphs[at]
        self.seen[where[0]] = 0
        self._eager(name, f"its input(s) {sorted(moved)} read in place became other arrays (captured again)")

    def _replay(self, graph: CapturedGraph, values: dict) -> bool:
        """Inputs into the graph's buffers, one launch on the compute stream, its output buffers
        handed out (copies of them in the shared lane); False (nothing done) when an input it reads
        in place is another array now, or one it copies is not a device array of its buffer's shape
        and dtype (`_graph_for` says why and runs the part eagerly)."""
        xp = self.xp
        if any(values.get(n) is not a for n, a in graph.inplace.items()):
            return False
        copied = [(n, values.get(n), buf) for n, buf in graph.inputs.items()]
        relinked = [
            (values.get(n), src, out)
            for n, (src, out) in graph.linked.items()
            if src.holds.get(out) is not values.get(n)
        ]
        for _, value, buf in copied:
            if not _fits_buffer(xp, value, buf):
                return False
        for value, src, out in relinked:
            if not _fits_buffer(xp, value, src.buffer(out)):
                return False
        for name, value, buf in copied:
            xp.copyto(buf, value)
            graph.holds[name] = value
        for value, src, out in relinked:  # (none, usually: the value is the buffer itself, or in it)
            xp.copyto(src.buffer(out), value)
            src.holds[out] = value
        graph.graph.launch(stream=xp.cuda.get_current_stream())
        outs = {n: out.copy() for n, out in graph.outputs.items()} if graph.copy else graph.outputs
        values.update(outs)
        graph.holds.update(outs)
        self.stats.replays += 1
        return True


def _fits_buffer(xp: Any, value: Any, buf: Any) -> bool:
    """`value` can be copied into graph buffer `buf`: a device array of its shape and dtype."""
    return type(value) is xp.ndarray and value.shape == buf.shape and value.dtype == buf.dtype


def capture(xp: Any, work: Callable[[], Any]) -> tuple[Any, Any, str]:
    """(graph, its memory pool, "") of what `work()` launches, captured on a stream of its own
    with a private memory pool; (None, None, why) when the capture fails (a host sync in it)."""
    stream, pool = xp.cuda.Stream(non_blocking=True), xp.cuda.MemoryPool()
    err: Exception | None = None
    graph = None
    with xp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            work()
        except Exception as e:  # (e.g. a sync inside the capture: CUDA refuses it)
            err = e
        try:
            graph = stream.end_capture()
        except Exception as e:
            err = err or e
    if err is not None:
        return None, None, f"its capture failed: {type(err).__name__}: {err}"
    return graph, pool, ""


class GraphedCall:
    """`fn(arrays)` (named device arrays; it may write those in `inplace`) replayed as one CUDA
    graph: after `warmup` eager calls it is captured, reading the `inplace` arrays where they are,
    and the others where they are too when they were the same arrays at the call before (the
    gradients a segment's graph hands out of its buffers at every step: read there, no copy), else
    through buffers they are copied into before each launch. It runs eagerly (captured again after
    a warm-up) when an array it reads where it is is another one than at the capture (one of the
    others: copied from then on) or an array's shape or dtype changed; a failed capture makes it
    eager for good, said once."""

    def __init__(self, xp: Any, name: str, fn: Callable[[dict], None], warmup: int = 1) -> None:
        self.xp, self.name, self.fn, self.warmup = xp, name, fn, warmup
        self.graph: CapturedGraph | None = None
        self.seen, self.failed = 0, ""
        self.last: dict[str, Any] = {}  # the arrays of the latest eager call
        self.moved: set[str] = set()  # arrays read where they were once, another array since: copied
        self.stats = GraphStats()

    def __call__(self, arrays: dict[str, Any], inplace: set[str]) -> None:
        g = self.graph
        if g is not None and not _fits(g, arrays):
            self.moved |= {n for n, a in g.inplace.items() if arrays.get(n) is not a} - inplace
            self.graph, self.seen, g = None, 0, None
        if g is None and not self.failed and self.seen >= self.warmup:
            same = {n for n, a in arrays.items() if self.last.get(n) is a} - self.moved
            g = self.graph = self._capture(arrays, inplace | same)
        if g is None:
            self.seen += 1
            self.stats.eager += 1
            self.last = dict(arrays)
            return self.fn(arrays)
        for n, buf in g.inputs.items():
            self.xp.copyto(buf, arrays[n])
        g.graph.launch(stream=self.xp.cuda.get_current_stream())
        self.stats.replays += 1

    def _capture(self, arrays: dict[str, Any], inplace: set[str]) -> CapturedGraph | None:
        bufs = {n: a.copy() for n, a in arrays.items() if n not in inplace}
        vals = {**arrays, **bufs}
        graph, pool, why = capture(self.xp, lambda: self.fn(vals))
        self.last = {}
        if why:
            self.failed = self.stats.refused[self.name] = why
            log.warning("device graphs: %s runs eagerly: %s", self.name, why)
            return None
        self.stats.captured += 1
        return CapturedGraph(graph, bufs, {n: arrays[n] for n in inplace}, {}, (), pool)


def _fits(g: CapturedGraph, arrays: dict[str, Any]) -> bool:
    """`arrays` fit captured call `g`: the same names, those it reads in place the same arrays, the
    others of its buffers' shapes and dtypes."""
    if len(arrays) != len(g.inplace) + len(g.inputs) or any(
        arrays.get(n) is not a for n, a in g.inplace.items()
    ):
        return False
    return all(
        (a := arrays.get(n)) is not None and a.shape == b.shape and a.dtype == b.dtype
        for n, b in g.inputs.items()
    )


def _names_of(steps: list) -> set[str]:
    return {n for s in steps for n in s.op.input_names()}


def _signature(array: type, names: list[str], values: dict) -> tuple[tuple, str]:
    """((shape, dtype) of each input), or why the inputs cannot be a graph's."""
    sig = []
    for n in names:
        v = values.get(n)
        if type(v) is not array:
            return (), f"its input {n!r} is not a device array ({type(v).__name__})"
        sig.append((v.shape, v.dtype))
    return tuple(sig), ""


def _changed(names: list[str], old: tuple, new: tuple) -> str:
    return ", ".join(
        f"{n} {list(a[0])} {a[1]} (captured: {list(b[0])} {b[1]})"
        for n, a, b in zip(names, new, old, strict=True)
        if a != b
    )


def _name(compiled: Any, part: int | None) -> str:
    ops = compiled.program.ops
    first = f"first op {ops[0].type} id {ops[0].id}" if ops else "empty"
    return f"segment ({len(ops)} ops, {first})" + ("" if part is None else f" part {part}")
