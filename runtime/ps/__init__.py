"""Parameter server: tables with server-side optimizers, shards and modes, a ZeroMQ server process,
its client, GEO trainer-side copies and shard-count-independent checkpoints. Tables are described by
`transpiler.TableSpec`s (a plan's `plan.tables`).

    with Servers(specs, num_shards=2, mode="sync", pushes_per_step=2) as servers:
        client = PSClient(servers.endpoints, pusher=rank)
        rows = client.pull("emb", ids, step=t)
        client.push("emb", row_grads, ids, step=t)
"""

from .checkpoint import CheckpointError
from .client import PSClient, PSTimeoutError
from .geo import GeoTable
from .server import serve
from .servers import Servers
from .shard import MODES, Limits, NotReady, Shard, save_shards
from .sharding import place_dense, shard_of
from .table import DenseTable, PSError, SparseTable, check_spec, make_table

__all__ = [
    "MODES", "CheckpointError", "DenseTable", "GeoTable", "Limits", "NotReady", "PSClient", "PSError",
    "PSTimeoutError", "Servers", "Shard", "SparseTable", "check_spec", "make_table", "place_dense",
    "save_shards", "serve", "shard_of",
]
