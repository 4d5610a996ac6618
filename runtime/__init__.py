"""hetps runtime: executes programs and plans (executor, simulate, train, evaluate / predict / export,
data, metrics)."""

from .evaluation import evaluate, export, predict
from .executor import ExecutionError, Executor, MissingFeedError
from .simulate import InMemoryServer, simulate
from .train import History, TrainingError, train

__all__ = ["ExecutionError", "Executor", "History", "InMemoryServer", "MissingFeedError", "TrainingError",
           "evaluate", "export", "predict", "simulate", "train"]
