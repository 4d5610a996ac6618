"""The transpiler's passes, each a plain function over Programs (see docs/design.md).

append_backward -> assign_devices -> insert_ps -> insert_comm -> split -> segment_order, then
verify: placement and parameter-server and comm insertion work on the one global program, so every
inserted op sits at its place in the global order; split then cuts it into one sub-program per
trainer type, and segment_order stores in each how its trainer runs it. `pipeline.PASSES` lists
them with what each requires and ensures; `pipeline.run_passes` lints after each.

The passes change the program they are given in place (`transpile` hands them a clone: copying a
100k-op program per pass would cost more than the passes themselves) and return a typed result
(`transpiler.passes.types`).
"""

from transpiler.passes.assign_devices import assign_devices, bytes_per_example
from transpiler.passes.insert_comm import insert_comm
from transpiler.passes.insert_ps import insert_ps, optimizer_spec
from transpiler.passes.segment_order import order_segments
from transpiler.passes.split import split
from transpiler.passes.verify import verify

__all__ = [
    "assign_devices",
    "bytes_per_example",
    "insert_comm",
    "insert_ps",
    "optimizer_spec",
    "order_segments",
    "split",
    "verify",
]
