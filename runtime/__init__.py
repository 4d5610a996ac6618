"""hetps runtime: executes programs and plans (executor, data, metrics)."""

from .executor import ExecutionError, Executor, MissingFeedError
from .simulate import InMemoryServer, simulate

__all__ = ["ExecutionError", "Executor", "InMemoryServer", "MissingFeedError", "simulate"]
