"""Running programs: the Executor (op by op on a Scope), the comm-op handlers (send/recv, pulls and
pushes), the one-process reference runner `simulate`, and which array library a device computes with."""
