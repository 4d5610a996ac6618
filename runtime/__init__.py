"""hetps runtime: executes programs and plans (executor, simulate, train, data, metrics)."""

from .executor import ExecutionError, Executor, MissingFeedError
from .simulate import InMemoryServer, simulate
from .train import History, TrainingError, train

__all__ = ["ExecutionError", "Executor", "History", "InMemoryServer", "MissingFeedError", "TrainingError",
           "simulate", "train"]
