"""hetps runtime: executes programs and plans (executor, simulate, train, evaluate / predict / export,
data, metrics)."""

import importlib

from ops_registry.errors import HetpsError
from runtime.driver.settings import (
    CheckpointConfig,
    EvalConfig,
    FailureConfig,
    OnlineConfig,
    RunConfig,
    TelemetryConfig,
)
from runtime.driver.train import History, TrainingError, train
from runtime.evaluation.evaluate import evaluate, export, predict
from runtime.exec.executor import ExecutionError, Executor, MissingFeedError
from runtime.exec.simulate import InMemoryServer, simulate
from transpiler.settings import ScaleConfig

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "ExecutionError",
    "HetpsError",
    "Executor",
    "History",
    "InMemoryServer",
    "MissingFeedError",
    "FailureConfig",
    "OnlineConfig",
    "OnlineHistory",
    "RunConfig",
    "ScaleConfig",
    "TelemetryConfig",
    "TrainingError",
    "evaluate",
    "export",
    "predict",
    "simulate",
    "train",
]


def __getattr__(name: str):
    # the online pass loop (and the stream readers it imports) loads on first use: trainer and shard
    # processes import this package and never need it
    if name == "OnlineHistory":
        value = importlib.import_module("runtime.driver.online").OnlineHistory
        globals()[name] = value
        return value
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
