"""The parameter-server shard's CPU cost per CTR step, split into its work and its messaging (issue 18).

One shard process (`Servers`, ipc + shared memory, signed requests, as the local engine runs it)
serves the tables of `ctr.py`'s Wide&Deep model (sparse deep [100 000, 16] and wide [100 000, 1],
8 dense MLP tables, 2 MB, SGD). A client in this process sends it what one async `ctr.py` step
sends (`--micro-batches 1`): the reader's row prefetch (one pull of a step's ≈ 5 900 distinct ids
from both sparse tables) and its push (their row gradients), the gpu trainer's dense pull (the
2 MB reply) and push (2 MB). Printed, medians over `--rounds` rounds of `--steps` steps:

- the shard's CPU ms per step (from /proc: its main thread and ZeroMQ's I/O thread together);
- the same work on an in-process `Shard` (the reference, measured in the same run: the tables'
  pull / push alone, no messages), and the shard's CPU ÷ the reference: what messaging costs on top;
- the client's CPU ms per step (encoding, signing, shared memory, decoding replies).

    python benchmarks/ps_messages.py            # --steps 300 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.data import SyntheticCTR  # noqa: E402
from runtime.profile.machine import cpu_seconds  # noqa: E402
from runtime.ps import Servers  # noqa: E402
from runtime.ps.shard import Shard  # noqa: E402
from transpiler.tables import TableSpec  # noqa: E402

VOCAB, DIM, BATCH, SLOTS, NUM_STEPS = 100_000, 16, 512, 26, 20
DENSE = {
    "fc_0.w_0": [429, 400],
    "fc_0.b_0": [400],
    "fc_1.w_0": [400, 400],
    "fc_1.b_0": [400],
    "fc_2.w_0": [400, 400],
    "fc_2.b_0": [400],
    "fc_3.w_0": [400, 1],
    "fc_3.b_0": [1],
}


def specs() -> list[TableSpec]:
    sgd = {"type": "sgd", "lr": 0.01}
    init = {"type": "uniform", "low": -0.05, "high": 0.05, "seed": 1}
    return [
        TableSpec(
            name="deep", kind="sparse", shape=[VOCAB, DIM], dtype="float32", initializer=init, optimizer=sgd
        ),
        TableSpec(
            name="wide", kind="sparse", shape=[VOCAB, 1], dtype="float32", initializer=init, optimizer=sgd
        ),
        *(
            TableSpec(name=n, kind="dense", shape=s, dtype="float32", initializer=init, optimizer=sgd)
            for n, s in DENSE.items()
        ),
    ]


def steps() -> list[tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]]:
    """Per step: distinct sorted ids, their deep and wide row gradients, the dense gradients."""
    data, rng = SyntheticCTR(vocab=VOCAB, num_slots=SLOTS, seed=0), np.random.default_rng(0)
    out = []
    for i in range(NUM_STEPS):
        ids = np.unique(data.batch(i, BATCH)["sparse"]).astype(np.int64)
        out.append(
            (
                ids,
                rng.normal(0, 1e-3, (ids.size, DIM)).astype(np.float32),
                rng.normal(0, 1e-3, (ids.size, 1)).astype(np.float32),
                [rng.normal(0, 1e-3, s).astype(np.float32) for s in DENSE.values()],
            )
        )
    return out


def client_step(client, step) -> None:
    ids, g_deep, g_wide, g_dense = step
    client.pull_many([("deep", ids), ("wide", ids)])
    client.push_many([("deep", g_deep, ids), ("wide", g_wide, ids)])
    client.pull_many([(n, None) for n in DENSE])
    client.push_many([(n, g, None) for n, g in zip(DENSE, g_dense, strict=True)])


def shard_step(shard: Shard, step) -> None:
    ids, g_deep, g_wide, g_dense = step
    shard.pull("deep", ids), shard.pull("wide", ids)
    shard.push("deep", g_deep, ids), shard.push("wide", g_wide, ids)
    for n in DENSE:
        shard.pull(n)
    for n, g in zip(DENSE, g_dense, strict=True):
        shard.push(n, g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    data = steps()
    local = Shard(specs())
    server_ms, client_ms, ref_ms = [], [], []
    with Servers(specs(), transport="ipc") as servers, servers.client() as client:
        pid = servers.processes[0].pid
        for s in data:  # rows exist and rings are made: the steady state
            client_step(client, s)
            shard_step(local, s)
        for _ in range(args.rounds):  # interleaved, so that load from other processes hits both
            s0, c0 = cpu_seconds(pid), time.process_time()
            for i in range(args.steps):
                client_step(client, data[i % NUM_STEPS])
            s1, c1 = cpu_seconds(pid), time.process_time()
            server_ms.append(1e3 * (s1 - s0) / args.steps)
            client_ms.append(1e3 * (c1 - c0) / args.steps)
            t0 = time.process_time()
            for i in range(args.steps):
                shard_step(local, data[i % NUM_STEPS])
            ref_ms.append(1e3 * (time.process_time() - t0) / args.steps)
    med = statistics.median
    ids = med(d[0].size for d in data)
    print(
        f"one ctr.py step's requests to one shard ({ids:.0f} distinct ids, 2 MB dense each way), "
        f"{args.rounds} rounds x {args.steps} steps, load average {os.getloadavg()[0]:.1f}; "
        "medians (min - max)"
    )

    def line(name: str, ms: list[float], note: str = "") -> None:
        print(f"  {name:20s} {med(ms):6.2f} CPU ms per step ({min(ms):.2f} - {max(ms):.2f}){note}")

    line("shard process:", server_ms)
    line("in-process Shard:", ref_ms, "  (the reference: the same pulls and pushes, no messages)")
    print(
        f"  shard / reference:   {med(server_ms) / med(ref_ms):6.2f}x  "
        f"(messaging adds {med(server_ms) - med(ref_ms):.2f} ms per step, 4 requests)"
    )
    line("client process:", client_ms)


if __name__ == "__main__":
    main()
