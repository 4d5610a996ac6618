"""The parameter-server shards of a run, started through its engine (`train`, and `evaluate` /
`predict` with workers): start them, give them a plan's imported values, read every table back.
(`runtime.ps.Servers` starts shards as plain local processes, without an engine.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from runtime.engines import Engine
from runtime.ps import PSClient, serve
from runtime.transport.channels import DRIVER
from runtime.transport.wire import link_key
from transpiler.plan import Plan
from transpiler.tables import TableSpec, tables_to_dicts


def start_servers(
    eng: Engine,
    specs: list[TableSpec],
    ps_eps: list[str],
    *,
    mode: str,
    secret: bytes,
    admin: bytes,
    report: str,
    ps_secret: bytes,
    pushes: int | dict[str, int] = 1,
    trace: bool = False,
    roots: list[Path] | None = None,
    holders: dict[str, str] | None = None,
) -> None:
    """Start the shards "ps:k" serving tables `specs` at `ps_eps` through `eng`: requests signed with
    a client's key under the shards' master `ps_secret`, admin ones (assign, save, load) with
    `admin`; a shard reports a failure to `report` under its link key from the run's master `secret`
    (wire.link_key; the shard is not given `secret`); save / load only inside `roots`; `holders`:
    table -> the trainer that may hold it (server.py)."""
    for k, ep in enumerate(ps_eps):
        name = f"ps:{k}"
        eng.start(
            name,
            serve,
            dict(
                endpoint=ep,
                specs=tables_to_dicts(specs),  # plain data into the shard's process
                shard=k,
                num_shards=len(ps_eps),
                mode=mode,
                pushes_per_step=pushes,
                secret=ps_secret,
                trace=trace,
                admin_secret=admin,
                checkpoint_root=[str(p) for p in roots or ()] or None,
                holders=holders,
            ),
            report=report,
            secret=link_key(secret, name, DRIVER),
        )


def load_values(
    plan: Plan, ps_eps: list[str], secret: bytes, admin: bytes, watch: Callable[[], None] | None = None
) -> None:
    """Give the servers the parameter values the plan carries (ONNX / Paddle imports); `watch`: see
    PSClient."""
    with PSClient(ps_eps, secret=secret, admin_secret=admin, watch=watch) as client:
        for name, value in plan.params.items():
            if name in client.specs:
                sparse = client.specs[name].kind == "sparse"
                client.assign(name, value, np.arange(len(value)) if sparse else None)


def pull_all(client: PSClient, plan: Plan) -> dict[str, np.ndarray]:
    """Every table's values (sparse tables of a known vocab: all rows; others are left out)."""
    out = {}
    for t in plan.tables:
        if t.kind == "dense":
            out[t.name] = client.pull(t.name)
        elif t.shape[0] > 0:
            out[t.name] = client.pull(t.name, np.arange(t.shape[0]))
    return out
