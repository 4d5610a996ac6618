"""The errors a plan raises when it cannot run (shared by `verify`, `schedule` and `Plan.load`)."""


class PlanError(ValueError):
    """A plan that cannot run; the message lists every problem found, naming ops and tensors."""


class DeadlockError(PlanError):
    """The sub-programs wait on each other's messages in a cycle."""
