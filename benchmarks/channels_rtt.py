"""Trainer-to-trainer round trip on one host: shared memory (runtime.transport.channels) vs ZeroMQ frames.

Two processes, each with an `Inbox` in a local run directory (as the local engine makes them) and
an `Outbox`: one sends a tensor message, the other sends the same arrays back, `--trips` times per
size, signed with a random key as in a run. Prints the median round trip and the CPU time both
processes spent per round trip, for ZeroMQ frames only (`Outbox(shm=False)`, the reference) and
with shared memory (the default), and their ratio, measured in the same run.

    python benchmarks/channels_rtt.py [--trips 300] [--sizes 1024,218112,1048576,4194304]

Messages over half the ring (`runtime.transport.shm.SHM_RING_BYTES`, 8 MiB: 4 MiB) and under `SHM_MIN_BYTES`
(16 KiB) go as ZeroMQ frames in both columns.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.transport.channels import Inbox, Links, Outbox  # noqa: E402
from runtime.transport.shm import shm_dir_for  # noqa: E402


def _echo(run_dir: str, secret: bytes, shm: bool, trips: int) -> None:
    inbox = Inbox(f"ipc://{run_dir}/echo", Links.derive(secret, "echo", senders=["main"]))
    out = Outbox(Links.derive(secret, "echo", {"main": f"ipc://{run_dir}/main"}), shm=shm)
    got = 0
    while got < trips:
        msg = inbox.recv(10_000)
        if msg is None:
            raise SystemExit("echo: no message within 10 s")
        # (copies: re-sending views of received ZeroMQ frames as zero-copy frames corrupted 4 MB
        # messages here, with or without shared memory: see benchmarks/README.md)
        out.send(f"ipc://{run_dir}/main", msg[0], [np.array(a) for a in msg[1]])
        got += 1
    out.close()
    inbox.close()


def round_trips(run_dir: str, secret: bytes, shm: bool, nbytes: int, trips: int) -> tuple[float, float]:
    """(median round trip in µs, CPU µs of both processes per round trip) for one message size."""
    inbox = Inbox(f"ipc://{run_dir}/main", Links.derive(secret, "main", senders=["echo"]))
    out = Outbox(Links.derive(secret, "main", {"echo": f"ipc://{run_dir}/echo"}), shm=shm)
    peer = mp.get_context("spawn").Process(target=_echo, args=(run_dir, secret, shm, trips))
    peer.start()
    arrays = [np.random.default_rng(0).random(nbytes // 4, np.float32), np.arange(16)]
    times, cpu0 = [], None
    try:
        for i in range(trips):
            if i == trips // 10:  # the first tenth warms up (connections, page faults)
                cpu0 = (time.process_time(), _cpu(peer.pid))
            t0 = time.perf_counter()
            out.send(f"ipc://{run_dir}/echo", {"k": "t", "i": i}, arrays)
            msg = inbox.recv(10_000)
            if msg is None or msg[0]["i"] != i or not np.array_equal(msg[1][0], arrays[0]):
                raise SystemExit(f"round trip {i}: wrong or no reply")
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0[0] + _cpu(peer.pid) - cpu0[1]
    finally:
        peer.join(30)
        out.close()
        inbox.close()
    n = trips - trips // 10
    return 1e6 * float(np.median(times[trips // 10 :])), 1e6 * cpu / n


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trips", type=int, default=300)
    ap.add_argument("--sizes", default="1024,218112,1048576,4194304", help="bytes of the float32 array")
    args = ap.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="hetps-run-")
    shm_dir = shm_dir_for(run_dir)
    os.mkdir(shm_dir, 0o700)
    secret = os.urandom(32)
    print(
        f"round trip of one tensor message between two processes; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    try:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            zmq_rt, zmq_cpu = round_trips(run_dir, secret, False, nbytes, args.trips)
            shm_rt, shm_cpu = round_trips(run_dir, secret, True, nbytes, args.trips)
            print(
                f"{nbytes:>9,} B: ZeroMQ frames {zmq_rt:8.0f} µs ({zmq_cpu:7.0f} µs CPU), shared memory "
                f"{shm_rt:8.0f} µs ({shm_cpu:7.0f} µs CPU): {zmq_rt / shm_rt:.2f}x faster, "
                f"{zmq_cpu / shm_cpu:.2f}x less CPU"
            )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
