"""The root of hetps's errors. Every error hetps raises on purpose is a `HetpsError` (catch it to
handle any of them); each kind keeps the builtin base it had (`ValueError` for bad input, ...), so an
`except ValueError` written against an older hetps still catches it. It lives in the lowest layer so
that every layer can subclass it.

    HetpsError
    ├── UnknownOpError (KeyError)                      ops_registry: an op type no OpDef implements
    ├── ModelImportError (ValueError)                  transpiler/frontends: a model file hetps cannot read
    │   ├── OnnxImportError ── UnsupportedOnnxOpsError
    │   ├── PaddleImportError
    │   └── ModelFileError
    ├── LintError (ValueError)                         transpiler/ir: a Program breaks an invariant
    ├── PlanError (ValueError) ── DeadlockError        transpiler: a plan that cannot run
    ├── ExecutionError (RuntimeError), MissingFeedError (KeyError)   runtime/exec
    ├── WireError (ValueError) ── AuthError ── ReplayError, ProtocolError (RuntimeError)   runtime/transport
    ├── PSError (ValueError) ── PSTimeoutError, CheckpointError   runtime/ps
    ├── TrainingError (RuntimeError) ── CheckpointSaveError, EvaluationError   runtime/driver, evaluation
    ├── ConfigError (ValueError)                       settings, schemas, table specs, configs
    └── UsageError                                      runtime/cli: a command line that cannot run
"""

from __future__ import annotations


class HetpsError(Exception):
    """Base of every error hetps raises on purpose."""


class ConfigError(HetpsError, ValueError):
    """Settings, a schema, a table spec or a transpile config that is not valid; the message names the
    option and what it accepts."""


__all__ = ["ConfigError", "HetpsError"]
