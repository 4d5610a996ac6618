"""Machines this one cannot run, predicted on paper (`hetps tune --cluster`): the cost model of
transpiler/cost/model.py with this machine's profile, changed by stated assumptions.

A `Cluster` is `nodes` machines of `cores` CPU cores and `gpus` GPUs each, joined by a network of
`bandwidth` bytes/s and `latency_s` one way. Its profile (`Cluster.profile`) is this machine's with:
- CPU kernels, the runtime's overhead and a process's own work as measured here (a core there is
  as fast as a core here);
- GPU kernels: as measured when the profile's GPU kind ran on a real device; when it was emulated on
  this CPU, the CPU timings / `gpu_speedup`, on the device (not CPU work);
- messages and PS calls: processes spread evenly over the nodes, so a share (nodes - 1) / nodes of
  them crosses the network: + latency per message (twice per PS round trip) and + bytes / bandwidth,
  counted as the sender's and the receiver's busy time (no overlap with their compute).
Every process shares the cluster's nodes x cores cores, and nothing else runs on them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace

from transpiler.config import kind_of
from transpiler.cost.model import Workload
from transpiler.cost.profile import KernelCost, Profile

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _bandwidth(text: str) -> float:
    """'10Gbit' / '10gbps' (bits per second) or '1.25GB' (bytes per second) -> bytes per second."""
    m = re.fullmatch(r"([\d.]+)\s*([kmgt]?)(bit|bps|b)?(/s)?", text.strip().lower())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected e.g. 10Gbit (bits/s) or 1.25GB (bytes/s)")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    return value / 8 if m.group(3) in ("bit", "bps") else value


def _seconds(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*(s|ms|us|ns)", text.strip().lower())
    if not m:
        raise ValueError(f"latency {text!r}: expected e.g. 50us, 0.2ms")
    return float(m.group(1)) * _TIME[m.group(2)]


@dataclass(frozen=True)
class Cluster:
    """`nodes` machines of `cores` cores and `gpus` GPUs each; the network between them."""

    nodes: int = 1
    cores: int = 16
    gpus: int = 0
    bandwidth: float = 1.25e9  # bytes/s between nodes (10 Gbit/s)
    latency_s: float = 50e-6  # one way between nodes
    gpu_speedup: float = 10.0  # an emulated GPU kind's kernels: this CPU's time / gpu_speedup

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.cores < 1 or self.gpus < 0:
            raise ValueError(
                f"cluster: expected nodes >= 1, cores >= 1 per node, gpus >= 0 per node, got "
                f"nodes={self.nodes}, cores={self.cores}, gpus={self.gpus}"
            )
        if not (self.bandwidth > 0 and self.latency_s >= 0 and self.gpu_speedup > 0):
            raise ValueError("cluster: bandwidth and gpu-speedup must be > 0, latency >= 0")

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """'nodes=4,cores=16,gpus=2,bandwidth=10Gbit,latency=50us,gpu-speedup=10' (any subset)."""
        got: dict = {}
        for part in filter(None, text.split(",")):
            key, eq, value = (x.strip() for x in part.partition("="))
            try:
                if key in ("nodes", "cores", "gpus"):
                    got[key] = int(value)
                elif key == "bandwidth":
                    got[key] = _bandwidth(value)
                elif key == "latency":
                    got["latency_s"] = _seconds(value)
                elif key == "gpu-speedup":
                    got["gpu_speedup"] = float(value)
                else:
                    raise ValueError(f"unknown key {key!r}")
            except ValueError as e:
                raise ValueError(
                    f"cluster {text!r}: {e}; expected keys nodes, cores, gpus (per node), "
                    "bandwidth (e.g. 10Gbit), latency (e.g. 50us), gpu-speedup"
                ) from None
        return cls(**got)

    @property
    def crossing(self) -> float:
        """The share of messages between two processes that crosses the network."""
        return (self.nodes - 1) / self.nodes

    def describe(self) -> str:
        net = (
            f", network {8 * self.bandwidth / 1e9:g} Gbit/s and {1e6 * self.latency_s:g} us one way"
            if self.nodes > 1
            else ""
        )
        return f"{self.nodes} node(s) x ({self.cores} cores, {self.gpus} GPU(s)){net}"

    def workload(self, w: Workload) -> Workload:
        """All processes share the cluster's cores; nothing else runs there."""
        return replace(w, cores=self.nodes * self.cores, share_alone=1.0, share_all=1.0, share_spread=0.0)

    def device_map(self, types: list[str]) -> dict[str, str] | None:
        """Without GPUs, a plan's GPU trainer types run their ops on CPU cores."""
        if self.gpus:
            return None
        return {t: "cpu" for t in types if kind_of(t) == "gpu"} or None

    def profile(self, p: Profile) -> Profile:
        """This machine's profile changed by the assumptions (`assumptions`)."""
        out = copy.deepcopy(p)
        x = self.crossing
        out.link.latency_s += x * self.latency_s
        out.link.per_byte_s += x / self.bandwidth
        out.ps.request_s += x * 2 * self.latency_s
        out.ps.dense_byte_s += x / self.bandwidth
        out.ps.sparse_byte_s += x / self.bandwidth
        for kind in [k for k in out.emulated if k == "gpu"]:
            out.kernels[kind] = {
                s: KernelCost(k.fixed_s / self.gpu_speedup, k.per_example_s / self.gpu_speedup)
                for s, k in out.kernels.get(kind, {}).items()
            }
            out.emulated.remove(kind)
        out.cores, out.load, out.machine = self.nodes * self.cores, None, f"on paper: {self.describe()}"
        return out

    def assumptions(self, p: Profile) -> list[str]:
        """What the prediction assumes, for printing beside it."""
        out = [
            f"{self.describe()}: every process shares the {self.nodes * self.cores} cores; nothing else runs",
            "a CPU core there is as fast as one here (kernels, the runtime's overhead: "
            f"{p.machine or 'this machine'})",
        ]
        if not self.gpus:
            out.append("no GPUs: the plan's GPU trainer types run on CPU cores (as CPU kernels, a core each)")
        elif "gpu" in p.emulated:
            out.append(
                f"GPU kernels: this CPU's emulated timings / {self.gpu_speedup:g} "
                "(--cluster gpu-speedup=...; no CUDA device measured them)"
            )
        else:
            out.append("GPU kernels: as measured on the profile's device")
        if self.nodes > 1:
            out.append(
                f"processes spread evenly over the nodes: {100 * self.crossing:.0f}% of messages and PS "
                "calls cross the network, its latency and bytes / bandwidth counted as busy time (no overlap)"
            )
        return out
