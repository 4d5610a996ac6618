"""Dense tables held by the one trainer that updates them (`transpiler.passes.held`), on both sides.

The protocol, per held table (in sync and async mode alike):
- `hold`: the trainer asks the table's shard for its whole state (parameter, optimizer slots and
  scalars, e.g. Adam's moments and Beta1Pow) when it starts; from then on the shard refuses pushes
  and pulls of the table (a peek, i.e. an evaluation or the driver's read, still answers), so no
  other client can update it behind its holder's back or read a stale value;
- each step the trainer applies its step's gradient to its own copy (`HeldTables.apply`: the
  servers' `DenseTable`, the same optimizer kernel, NaN / Inf check and dtype), zeros when it got
  no item, exactly as the shard would have;
- `write_back`: before a checkpoint or an evaluation (the driver asks, `messages.WriteBack`, and
  waits for it through `lifecycle.wait_applied`) and at the end of the run (`final`: the hold
  ends), the trainer sends the state and the number of steps applied since the hold; the shard
  loads it and counts those steps as applied pushes (and, in sync mode, as applied steps), so
  checkpoints, `wait_applied` and resumed runs see what they would have seen without the hold.

On a gpu trainer (`xp` cupy) the held tables, their optimizer state and scalars live on the device
from the hold to the end of the run: `pull` gives the device array, `apply` runs the optimizer
kernel on the device with the device gradient, and only a write-back copies the state to the host.
No per-step NaN / Inf check of the gradients there (it would cost kernels and a sync each step):
a non-finite gradient makes the state non-finite, which the write-back refuses on the host, naming
the table, so the shard keeps the state written back before.

If the holder dies, the steps since the last write-back are lost with it, and the run fails naming
it (as it would anyway); a resumed run starts from the last checkpoint, which has every step
before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.exec.device import to_device, to_host
from runtime.exec.graphs import GraphedCall
from runtime.ps.table import DenseTable
from runtime.ps.types import PSError
from runtime.telemetry.outputs import Recorder, timed

if TYPE_CHECKING:
    from runtime.ps.client import PSClient
    from runtime.ps.shard import Shard


# -- the shard's side -------------------------------------------------------------------------------
def hold(shard: Shard, name: str, holder: str = "") -> dict[str, np.ndarray]:
    """Start holding `name` for one trainer (`holder`: its client id; only it may write the table
    back): the table's state (copies), and the shard refuses its pushes and pulls until
    `write_back(final=True)`."""
    t = shard.table(name)
    refusals = (
        (t.spec.kind != "dense", "it is not a dense table"),
        (t.kernel is None, "it is frozen (no optimizer)"),
        (name in shard.clip_tables, "it is clipped by global norm (the servers clip)"),
        (shard.expected[name] != 1, f"{shard.expected[name]} trainers push it each step, not one"),
        (name in shard.holds, "it is held already"),
        (bool(shard.pending[name]), "pushes of it wait on this shard"),
    )
    why = next((why for refused, why in refusals if refused), None)
    if why is not None:
        raise PSError(f"hold of table {name!r} refused: {why}")
    shard.holds[name] = (shard.version[name], shard.applied[name], holder)
    return {k: np.array(a) for k, a in t.state_dict().items()}


def write_back(
    shard: Shard, name: str, keys: list[str], arrays: list, steps: int, final: bool, holder: str = ""
) -> None:
    """Load a held table's state (`arrays`, named by `keys`, one each: `protocol.WriteBack` checks a
    request's) from its holder, which has applied `steps` steps since the hold (all checked: the
    arrays and shapes are the table's, finite, and the count never goes back)."""
    if name not in shard.holds:
        raise PSError(f"write_back of table {name!r} refused: no trainer holds it")
    if shard.holds[name][2] != holder:
        raise PSError(f"write_back of table {name!r} refused: another client holds it")
    t, state = shard.table(name), dict(zip(keys, arrays, strict=True))
    want = t.state_dict()
    if sorted(state) != sorted(want) or len(state) != len(keys):
        raise PSError(f"write_back of table {name!r}: arrays {sorted(state)}, the table has {sorted(want)}")
    version, applied, _ = shard.holds[name]
    if steps < shard.applied[name] - applied:
        raise PSError(
            f"write_back of table {name!r}: {steps} steps since the hold, fewer than the "
            f"{shard.applied[name] - applied} written back before"
        )
    t.load_state({k: t.check_grad(a, want[k].shape, f"written-back {k}") for k, a in state.items()})
    shard.applied[name] = applied + steps
    if shard.mode == "sync":
        shard.version[name] = version + steps
    if final:
        del shard.holds[name]


# -- the trainer's side -----------------------------------------------------------------------------
class HeldTables:
    """The dense tables one trainer holds: its copies, the steps applied since the hold (from step
    `start`), and when to write them back (`due`: (steps pushed, final))."""

    def __init__(
        self, client: PSClient, names: list[str], start: int, sync: bool, xp: Any = np, graphs: bool = False
    ) -> None:
        self.tables: dict[str, DenseTable] = {}
        self.xp = xp
        # on a device with `graphs`: every table's optimizer step as one CUDA graph (runtime.exec.graphs),
        # captured at the third step: the segments' graphs hand out their buffers from the second on, so
        # the gradients it sees then (the same arrays every step with one item per step) are read in place
        self.graphed = GraphedCall(xp, "the held tables' step", self._step_all, warmup=2) if graphs else None
        for name, state in client.hold(names).items():
            t = self.tables[name] = DenseTable(client.specs[name])
            t.load_state(state)
            if xp is not np:  # the whole state on the device, once
                t.param = to_device(xp, t.param)
                t.state = {k: to_device(xp, a) for k, a in t.state.items()}
                t.scalars = {k: to_device(xp, a) for k, a in t.scalars.items()}
        self.start, self.sync, self.steps = start, sync, 0
        self.due: tuple[int, bool] | None = None
        self.lent: dict[str, int] = {}  # table -> the latest step given a view of its value

    def pull(self, name: str, step: int) -> np.ndarray:
        """The table's value for `step`: a read-only view, no copy. The step reads that one value
        throughout: `apply` copies the table before it updates it while a later step holds a view."""
        if self.sync and self.start + self.steps != step:
            raise RuntimeError(
                f"held table {name!r} read for sync step {step} after the steps up to "
                f"{self.start + self.steps - 1} were applied: a sync step must see every step before it"
            )
        self.lent[name] = max(step, self.lent.get(name, step))
        return self.tables[name].pull(copy=False) if self.xp is np else self.tables[name].param

    def apply(self, grads: dict[str, np.ndarray], step: int) -> None:
        """Step `step` (every step before it is done with the tables): every held table's optimizer
        step with its gradient (zeros when none), in place unless a later step still reads the value
        it was given (copy on write: that step keeps the old array)."""
        for name, t in self.tables.items():
            if self.lent.pop(name, step) > step:
                t.param = t.param.copy()
            if self.xp is np:
                grad = grads.get(name)
                t.push(np.zeros(t.shape, t.dtype) if grad is None else grad)
        if self.xp is not np:
            self._apply_on_device(grads)
        self.steps += 1

    def _apply_on_device(self, grads: dict[str, Any]) -> None:
        """Every table's optimizer step on the device (one graph replay with `graphs`), the
        gradients' shapes and dtypes checked on the host (metadata)."""
        xp, arrays = self.xp, {}
        for name, t in self.tables.items():
            grad = grads.get(name)
            grad = xp.zeros(t.shape, t.dtype) if grad is None else to_device(xp, grad)
            if tuple(grad.shape) != t.shape:
                raise PSError(
                    f"held table {name!r}: a gradient of shape {list(grad.shape)}, expected {list(t.shape)}"
                )
            arrays[(name, "Grad")] = grad if grad.dtype == t.dtype else grad.astype(t.dtype)
            arrays[(name, "Param")] = t.param
            arrays.update({(name, k): a for k, a in (*t.state.items(), *t.scalars.items())})
        if self.graphed is None:
            return self._step_all(arrays)
        self.graphed(arrays, {k for k in arrays if k[1] != "Grad"})

    def _step_all(self, arrays: dict[tuple[str, str], Any]) -> None:
        """The optimizer kernels of every table on `arrays` ((table, slot) -> device array), which
        they update in place (the scalar states too: written back into their arrays)."""
        for name, t in self.tables.items():
            ins = {slot: arrays[(name, slot)] for slot in ("Param", "Grad", *t.state, *t.scalars)}
            res = t.kernel(self.xp, ins, t.attrs)
            for slot in t.scalars:
                ins[slot][...] = res[t.out_slot[slot]]

    def _host_states(self) -> dict[str, dict[str, np.ndarray]]:
        """Every table's state on the host (copies off the device, refused when not finite: a NaN /
        Inf gradient since the last write-back)."""
        if self.xp is np:
            return {n: t.state_dict() for n, t in self.tables.items()}
        states = {n: {k: to_host(a) for k, a in t.state_dict().items()} for n, t in self.tables.items()}
        bad = [n for n, st in states.items() if not all(np.isfinite(a).all() for a in st.values())]
        if bad:
            raise PSError(
                f"held table(s) {bad}: the state holds NaN or Inf (a non-finite gradient since the last "
                "write-back); it is not written back (the shard keeps the one written back before)"
            )
        return states

    def write_back_due(self, client: PSClient, pushed: int, rec: Recorder) -> None:
        """Write the tables back when `due` (once `pushed` steps have been pushed)."""
        if self.due is not None and pushed >= self.due[0]:
            with timed("write back", "ps", rec=rec, step=pushed - 1, final=self.due[1]):
                client.write_back(self._host_states(), self.steps, self.due[1])
            self.due = None
