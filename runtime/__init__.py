"""hetps runtime: executes programs and plans (executor, data, metrics)."""

from .executor import ExecutionError, Executor, MissingFeedError

__all__ = ["ExecutionError", "Executor", "MissingFeedError"]
