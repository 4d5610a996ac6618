"""hetps runtime: executes programs and plans (executor, simulate, train, evaluate / predict / export,
data, metrics)."""

from runtime.driver.train import History, TrainingError, train
from runtime.evaluation.evaluate import evaluate, export, predict
from runtime.exec.executor import ExecutionError, Executor, MissingFeedError
from runtime.exec.simulate import InMemoryServer, simulate

__all__ = [
    "ExecutionError",
    "Executor",
    "History",
    "InMemoryServer",
    "MissingFeedError",
    "TrainingError",
    "evaluate",
    "export",
    "predict",
    "simulate",
    "train",
]
