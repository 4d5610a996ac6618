"""Parameter server: tables with server-side optimizers, shards and modes, a ZeroMQ server process,
its client, GEO trainer-side copies and shard-count-independent checkpoints. Tables are described by
`transpiler.TableSpec`s (a plan's `plan.tables`).

    with Servers(specs, num_shards=2, mode="sync", pushes_per_step=2) as servers:
        client = PSClient(servers.endpoints, pusher=rank)
        rows = client.pull("emb", ids, step=t)
        client.push("emb", row_grads, ids, step=t)
"""

from runtime.ps.checkpoint import CheckpointError
from runtime.ps.client import PSClient, PSTimeoutError
from runtime.ps.geo import GeoTable
from runtime.ps.local import Servers
from runtime.ps.make import make_table
from runtime.ps.server import serve
from runtime.ps.shard import MODES, Limits, NotReady, Shard, save_shards
from runtime.ps.sharding import place_dense, shard_of
from runtime.ps.table import DenseTable, SparseTable, check_spec
from runtime.ps.tiered import TieredSparseTable
from runtime.ps.types import PSError, Table

__all__ = [
    "MODES",
    "CheckpointError",
    "DenseTable",
    "GeoTable",
    "Limits",
    "NotReady",
    "PSClient",
    "PSError",
    "PSTimeoutError",
    "Servers",
    "Shard",
    "SparseTable",
    "Table",
    "TieredSparseTable",
    "check_spec",
    "make_table",
    "place_dense",
    "save_shards",
    "serve",
    "shard_of",
]
