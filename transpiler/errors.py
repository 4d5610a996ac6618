"""The transpiler's own errors: a plan that cannot run (shared by `verify`, `schedule` and `Plan.load`),
and a model a frontend cannot import (the base of the ONNX, Paddle and model-file errors)."""

from ops_registry.errors import HetpsError


class PlanError(HetpsError, ValueError):
    """A plan that cannot run; the message lists every problem found, naming ops and tensors."""


class DeadlockError(PlanError):
    """The sub-programs wait on each other's messages in a cycle."""


class ModelImportError(HetpsError, ValueError):
    """A model file or program that a frontend cannot turn into a hetps Program (ONNX, Paddle, or a
    file of no known kind); the message names the node / op and what is not supported."""
