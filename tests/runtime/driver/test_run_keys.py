"""Who holds which key in a run (docs/cluster.md): every process the driver starts gets the keys of its
own links and its own client key to the shards, never the run's master secrets. Recorded at the
engine's `start`, the one place where what a process gets leaves the driver."""

from __future__ import annotations

import hashlib

from runtime import train
from runtime.data import SyntheticCTR
from runtime.engines import LocalEngine
from runtime.transport.channels import Links
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep


class RecordingEngine(LocalEngine):
    """The local engine, keeping what each process was started with."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[str, tuple[dict, bytes]] = {}

    def start(self, name, target, kwargs, **kw) -> None:
        self.started[name] = (kwargs, kw["secret"])
        super().start(name, target, kwargs, **kw)


def _link(master: bytes, a: str, b: str) -> bytes:
    """wire.link_key by hand (the module docstring's derivation)."""
    key = hashlib.blake2b(master, digest_size=64, person=b"hetps-wire-key").digest()
    return hashlib.blake2b(f"{a}/{b}".encode(), key=key, digest_size=32, person=b"hetps-link").digest()


def _all_bytes(obj) -> list[bytes]:
    if isinstance(obj, bytes):
        return [obj]
    if isinstance(obj, dict):
        return [b for v in obj.values() for b in _all_bytes(v)]
    if isinstance(obj, (list, tuple)):
        return [b for v in obj for b in _all_bytes(v)]
    return _all_bytes(vars(obj)) if hasattr(obj, "__dict__") else []


def test_trainers_and_shards_get_only_their_own_link_keys():
    plan = transpile(wide_deep(vocab=200, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1)).main)
    eng = RecordingEngine()
    hist = train(
        plan,
        SyntheticCTR(vocab=200),
        steps=3,
        batch_size=32,
        engine=eng,
        trainers={"cpu": 2, "gpu": 1},
        servers=1,
        allow_emulation=True,
        progress=False,
    )
    assert hist.steps == 3
    master = eng.secret
    trainers = ["cpu:0", "cpu:1", "gpu:0"]
    for name, (kwargs, report_key) in eng.started.items():
        assert report_key == _link(master, name, "driver")  # its failure report: its own link
        assert master not in _all_bytes(kwargs)
        if name in trainers:
            spec = kwargs["spec"]
            links = Links.of(spec["links"])
            assert links.name == name
            assert links.recv == {p: _link(master, p, name) for p in [*trainers, "driver"]}
            peers = {**spec["endpoints"], "driver": spec["driver"]}
            assert links.send == {ep: _link(master, name, p) for p, ep in peers.items()}


def test_evaluation_workers_get_their_own_link_and_client_keys(tmp_path):
    from runtime import evaluate
    from runtime.transport.wire import client_key

    plan = transpile(wide_deep(vocab=200, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1)).main)
    ckpt = tmp_path / "ck"
    train(
        plan,
        SyntheticCTR(vocab=200),
        steps=2,
        batch_size=32,
        checkpoint=str(ckpt),
        progress=False,
        trainers={"cpu": 1, "gpu": 1},
        allow_emulation=True,
    )
    eng = RecordingEngine()
    ev = [SyntheticCTR(vocab=200, seed=9).batch(i, 16) for i in range(2)]
    evaluate(plan, ev, checkpoint=str(ckpt), workers=2, servers=1, engine=eng)
    master = eng.secret
    shard_master = eng.started["ps:0"][0]["secret"]
    for name in ("eval:0", "eval:1"):
        (kwargs, report_key) = eng.started[name]
        spec = kwargs["spec"]
        assert master not in _all_bytes(kwargs) and shard_master not in _all_bytes(kwargs)
        assert report_key == _link(master, name, "driver")
        assert spec.links.send == {spec.driver: _link(master, name, "driver")} and spec.links.recv == {}
        assert spec.ps_key == client_key(shard_master, name) and spec.ps_key != client_key(
            shard_master, "eval:0" if name == "eval:1" else "eval:1"
        )
