"""Parameter-server processes over ZeroMQ: sync-mode equivalence, async / GEO lose no update,
bad input is refused while the server keeps serving. Servers start once per module (a fleet per mode).
"""

import threading
import time

import numpy as np
import pytest
from raw_ps import Raw

from ops_registry import init_rows
from runtime.ps import GeoTable, PSClient, PSError, PSTimeoutError, Servers, Shard
from transpiler.tables import TableSpec

VOCAB, DIM = 40, 4
OPTIMIZERS = {
    "sgd": {"type": "sgd", "lr": 0.1},
    "adagrad": {"type": "adagrad", "lr": 0.1, "epsilon": 1e-6, "initial_accumulator_value": 0.1},
    "adam": {"type": "adam", "lr": 0.05, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": 0},
    "lazyadam": {"type": "adam", "lr": 0.05, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "lazy_mode": 1},
}
SECRET = b"test-secret"


def _specs(init: dict, optimizers: dict) -> list[TableSpec]:
    specs = []
    for key, opt in optimizers.items():
        specs.append(
            TableSpec(
                name=f"emb_{key}",
                kind="sparse",
                shape=[VOCAB, DIM],
                dtype="float32",
                initializer={**init, "seed": 1},
                optimizer=opt,
            )
        )
        specs.append(
            TableSpec(
                name=f"w_{key}",
                kind="dense",
                shape=[6, 3],
                dtype="float32",
                initializer={**init, "seed": 2},
                optimizer=opt,
            )
        )
    return specs


@pytest.fixture(scope="module")
def sync_servers():
    specs = _specs({"type": "uniform", "low": -0.5, "high": 0.5}, OPTIMIZERS)
    with Servers(specs, num_shards=2, mode="sync", pushes_per_step=2) as s:
        yield s, {t.name: t for t in specs}


SGD_EXACT = {"sgd": {"type": "sgd", "lr": 0.5}}
EXACT_INIT = {"type": "constant", "value": 1.0}


@pytest.fixture(scope="module")
def async_servers():
    with Servers(_specs(EXACT_INIT, SGD_EXACT), num_shards=2, mode="async", secret=SECRET) as s:
        yield s


@pytest.fixture(scope="module")
def geo_servers():
    with Servers(_specs(EXACT_INIT, SGD_EXACT), num_shards=2, mode="geo", transport="ipc") as s:
        yield s


# -- 1. sync mode = one optimizer step on the summed gradient ------------------------------------
class Reference:
    """Paddle's update formulas written out in float64 numpy on the whole table."""

    def __init__(self, param: np.ndarray, opt: dict) -> None:
        self.p, self.opt = param.astype(np.float64), opt
        self.m = np.full_like(self.p, opt.get("initial_accumulator_value", 0.0))
        self.v = np.zeros_like(self.p)
        # Paddle keeps Beta1Pow / Beta2Pow as float32 tensors of the parameter's dtype
        self.b1p, self.b2p = np.float32(opt.get("beta1", 0.0)), np.float32(opt.get("beta2", 0.0))

    def step(self, g: np.ndarray, touched: np.ndarray) -> None:
        o, lr = self.opt, self.opt["lr"]
        if o["type"] == "sgd":
            self.p -= lr * g
        elif o["type"] == "adagrad":
            self.m += g * g
            self.p -= lr * g / (np.sqrt(self.m) + o["epsilon"])
        else:
            rows = touched if o["lazy_mode"] else np.ones(len(self.p), bool)
            b1, b2 = o["beta1"], o["beta2"]
            self.m[rows] = b1 * self.m[rows] + (1 - b1) * g[rows]
            self.v[rows] = b2 * self.v[rows] + (1 - b2) * g[rows] ** 2
            lr_t = lr * np.sqrt(1 - np.float64(self.b2p)) / (1 - np.float64(self.b1p))
            eps = o["epsilon"] * np.sqrt(1 - np.float64(self.b2p))
            self.p[rows] -= lr_t * self.m[rows] / (np.sqrt(self.v[rows]) + eps)
            self.b1p, self.b2p = self.b1p * np.float32(b1), self.b2p * np.float32(b2)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_sync_two_clients_equal_one_step_on_the_summed_gradient(sync_servers, opt):
    servers, specs = sync_servers
    rng = np.random.default_rng(5)
    emb, w = specs[f"emb_{opt}"], specs[f"w_{opt}"]
    ref_emb = Reference(init_rows(emb.initializer, (VOCAB, DIM), "float32"), OPTIMIZERS[opt])
    ref_w = Reference(init_rows(w.initializer, (6, 3), "float32"), OPTIMIZERS[opt])
    clients = [servers.client(pusher=r, timeout=20) for r in range(2)]
    waiting = servers.client(pusher=9, timeout=0.3)
    all_ids = np.arange(VOCAB)
    for step in range(3):
        g_emb, g_w, touched = np.zeros((VOCAB, DIM)), np.zeros((6, 3)), np.zeros(VOCAB, bool)
        for r, c in enumerate(clients):
            ids = rng.integers(0, VOCAB // 2, size=12)  # ids overlap between clients and repeat
            rows = rng.normal(size=(12, DIM)).astype(np.float32)
            dense = rng.normal(size=(6, 3)).astype(np.float32)
            np.testing.assert_allclose(
                c.pull(emb.name, ids, step=step),
                ref_emb.p[ids],
                rtol=0 if step == 0 else 1e-6,
                atol=0 if step == 0 else 1e-6,
            )
            c.push(emb.name, rows, ids, step=step)
            c.push(w.name, dense, step=step)
            np.add.at(g_emb, ids, rows)
            touched[ids] = True
            g_w += dense
            if r == 0 and step == 0:  # step not applied yet: a pull of the next step waits (here: times out)
                with pytest.raises(PSTimeoutError, match="no reply to 'pull'"):
                    waiting.pull(w.name, step=step + 1)
        ref_emb.step(g_emb, touched)
        ref_w.step(g_w, np.ones(6, bool))
        for c in clients:
            np.testing.assert_allclose(
                c.pull(emb.name, all_ids, step=step + 1), ref_emb.p, rtol=1e-6, atol=1e-6
            )
            np.testing.assert_allclose(c.pull(w.name, step=step + 1), ref_w.p, rtol=1e-6, atol=1e-6)
    for c in (*clients, waiting):
        c.close()


# -- 2. async and GEO lose no update ------------------------------------------------------------
def _run_threads(work, n=4):
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def _grads(i: int, n: int):
    """Small-integer gradients: every sum of them is exact in float32, in any order."""
    rng = np.random.default_rng(100 + i)
    for _ in range(n):
        ids = rng.integers(0, VOCAB, size=8)
        yield (
            ids,
            rng.integers(-4, 5, size=(8, DIM)).astype(np.float32),
            rng.integers(-4, 5, size=(6, 3)).astype(np.float32),
        )


def _expected(n: int):
    emb, w = np.ones((VOCAB, DIM)), np.ones((6, 3))
    for i in range(4):
        for ids, rows, dense in _grads(i, n):
            np.add.at(emb, ids, -0.5 * rows)
            w -= 0.5 * dense
    return emb, w


def test_async_concurrent_pushes_lose_no_update(async_servers):
    def work(i):
        with PSClient(async_servers.endpoints, secret=SECRET, pusher=i) as c:
            for ids, rows, dense in _grads(i, 25):
                c.push("emb_sgd", rows, ids)
                c.push("w_sgd", dense)

    _run_threads(work)
    emb, w = _expected(25)
    with PSClient(async_servers.endpoints, secret=SECRET) as c:
        np.testing.assert_array_equal(c.pull("emb_sgd", np.arange(VOCAB)), emb)
        np.testing.assert_array_equal(c.pull("w_sgd"), w)


def test_geo_concurrent_delta_pushes_lose_no_update(geo_servers):
    def work(i):
        with geo_servers.client(pusher=i) as c:
            emb, w = GeoTable(c, "emb_sgd", k=3), GeoTable(c, "w_sgd", k=3)
            for ids, rows, dense in _grads(i, 10):
                emb.pull(ids)
                emb.push(rows, ids)
                w.push(dense)
            emb.sync()
            w.sync()

    _run_threads(work)
    emb, w = _expected(10)
    with geo_servers.client() as c:
        np.testing.assert_array_equal(c.pull("emb_sgd", np.arange(VOCAB)), emb)
        np.testing.assert_array_equal(c.pull("w_sgd"), w)


# -- 4. bad input: a clear error on the client, and the server keeps serving ---------------------
def _raw_request(raw: Raw, frames: list) -> dict:
    """Send frames as they are; the reply header (signed, or unsigned for an auth refusal)."""
    return raw.ask(frames, 5000)


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(async_servers):
    eps = async_servers.endpoints
    with PSClient(eps, secret=SECRET, pusher="bad") as c:
        before = c.pull("emb_sgd", np.arange(VOCAB))
        with pytest.raises(PSError, match="unknown table 'nope'"):
            c.push("nope", np.ones((1, DIM), np.float32), np.array([1]))
        wrong_dim = r"'emb_sgd' \(shape \[40, 4\]\): gradient has shape \[1, 5\], expected \[1, 4\]"
        with pytest.raises(PSError, match=wrong_dim):
            c.push("emb_sgd", np.ones((2, DIM + 1), np.float32), np.array([1, 2]))
        with pytest.raises(PSError, match=r"has shape \[3, 3\], expected \[6, 3\]"):
            c.push("w_sgd", np.ones((3, 3), np.float32))
        with pytest.raises(PSError, match="NaN or Inf; rejected"):
            c.push("emb_sgd", np.full((2, DIM), np.nan, np.float32), np.array([1, 2]))
        with pytest.raises(PSError, match=r"ids out of range \[0, 40\): \[40\]"):
            c.pull("emb_sgd", np.array([3, 40]))
        # what a buggy or hostile peer might send, bypassing the client
        raw = Raw(async_servers, cid="raw-test")
        _signed = raw.sign
        h = _raw_request(raw, _signed({"op": "push", "table": "nope", "pusher": raw.name}, [np.ones(2)]))
        assert h["ok"] is False and "unknown table 'nope'" in h["error"]
        h = _raw_request(raw, _signed({"op": "frobnicate"}))
        assert h["ok"] is False and "unknown request op 'frobnicate'" in h["error"]
        h = _raw_request(raw, _signed({"op": "pull"}))
        assert h["ok"] is False and "needs field 'table'" in h["error"]
        frames = _signed({"op": "pull", "table": "w_sgd"})
        h = _raw_request(raw, [frames[0][:-1], *frames[1:]])  # altered header
        assert h["ok"] is False and "authentication failed" in h["error"]
        raw.close()
        with pytest.raises(PSError, match="authentication failed: it refused the connection"):
            PSClient(eps, timeout=5)
        with pytest.raises(PSError, match="authentication failed: it refused the connection"):
            PSClient(eps, secret=b"guess", timeout=5)
        # nothing was applied, and the server still serves
        np.testing.assert_array_equal(c.pull("emb_sgd", np.arange(VOCAB)), before)
        assert c.stats()[0]["emb_sgd"]["rows"] > 0


def test_nan_gradients_can_be_allowed():
    spec = _specs(EXACT_INIT, SGD_EXACT)
    shard = Shard(spec, check_finite=False)
    shard.push("emb_sgd", np.array([[np.nan, 1, 1, 1]], np.float32), np.array([3]))
    assert np.isnan(shard.pull("emb_sgd", np.array([3]))[0, 0])


def test_a_request_without_answer_times_out():
    t = time.monotonic()
    with pytest.raises(PSTimeoutError, match=r"no reply to 'hello' within 0.3 s from shard 0"):
        PSClient(["tcp://127.0.0.1:9"], timeout=0.3)
    assert time.monotonic() - t < 3


def test_unauthenticated_clients_are_logged_and_the_server_stops_cleanly(tmp_path):
    with Servers(_specs(EXACT_INIT, SGD_EXACT), transport="ipc", secret=SECRET, log_dir=tmp_path) as s:
        assert s.endpoints[0].startswith("ipc://")
        with pytest.raises(PSError, match="authentication failed"):
            PSClient(s.endpoints, timeout=5)
        with pytest.raises(PSError, match="authentication failed"):
            PSClient(s.endpoints, secret=b"another run's", timeout=5)  # (its log-in reaches the gate)
        with PSClient(s.endpoints, secret=SECRET) as c:
            assert c.pull("w_sgd").shape == (6, 3)
    assert [p.exitcode for p in s.processes] == [0]  # SIGTERM handled: a clean exit
    log = (tmp_path / "ps-shard0.log").read_text()
    assert "WARNING refused a connection (1 so far)" in log and "not a client of this run" in log


def test_a_refused_client_is_told_so_and_never_blocks(async_servers, monkeypatch):
    """A client with a wrong key has no connection to queue on once the shard has refused its login
    (ZeroMQ drops the pipe and reconnects): a hello sent after that blocked forever (the suite hung at
    `PSClient(eps, secret=b"guess")` under load, where the client was slow between connecting and its
    first send). Here the client waits 0.5 s before each send: it must still be told it was refused."""
    frames = PSClient._frames

    def slow_frames(self, *a):
        time.sleep(0.5)
        return frames(self, *a)

    monkeypatch.setattr(PSClient, "_frames", slow_frames)
    t0 = time.monotonic()
    with pytest.raises(PSError, match="authentication failed: it refused the connection"):
        PSClient(async_servers.endpoints, secret=b"guess", timeout=5)
    assert time.monotonic() - t0 < 5
