"""Engines start, watch and stop the processes of a run (parameter-server shards and trainers).

An engine knows nothing about training: it starts entry points (`runtime.ps.serve`,
`runtime.trainer.process.run_trainer`) under names such as "ps:0" or "gpu:1", gives each an address to bind,
reports processes that died, and tears everything down. `local` runs them as processes on this
machine; `ray` runs them as Ray actors on a Ray cluster (the optional extra hetps[ray]).
"""

from runtime.engines.base import Engine, ProcessFailure, child_main
from runtime.engines.local import LocalEngine
from runtime.engines.ray import RayEngine

ENGINES = {"local": LocalEngine, "ray": RayEngine}


def make_engine(engine: "str | Engine", address: str | None = None) -> Engine:
    """An Engine instance for a name in ENGINES (`address`: the Ray cluster to join, for "ray"),
    or `engine` itself when it already is one."""
    if isinstance(engine, Engine):
        if address is not None:
            raise ValueError("address= goes with engine='ray'; an Engine instance brings its own")
        return engine
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; available engines: {sorted(ENGINES)}")
    if address is not None:
        if engine != "ray":
            raise ValueError(f"address={address!r} is for the ray engine, not {engine!r}")
        return RayEngine(address)
    return ENGINES[engine]()


__all__ = ["ENGINES", "Engine", "LocalEngine", "ProcessFailure", "RayEngine", "child_main", "make_engine"]
