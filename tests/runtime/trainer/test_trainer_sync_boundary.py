"""The sync step boundary of reader trainers (runtime.trainer.ps_access.PSAccess.push_step with `ahead`).

In sync mode a reader's push of step t carries the row pull of step t + 1 (one `push_pull`
request, one round trip). Two readers share ids, against real parameter-server shards: the rows a
reader gets for step t + 1 must include both readers' step-t gradients (the reply waits for the
other reader's push), checked against numpy by hand (SGD from known rows). And a whole sync run of
two readers equals full-batch SGD by hand, step by step."""

from __future__ import annotations

import threading

import numpy as np

from ops_registry import SparseRows
from runtime import train
from runtime.ps import PSClient, Servers
from runtime.telemetry.outputs import Recorder
from runtime.trainer.mail import Item
from runtime.trainer.ps_access import PSAccess
from runtime.trainer.steps import StepBook
from transpiler import builder as nn
from transpiler import transpile
from transpiler.models import wide_deep

VOCAB, DIM, LR, SLOTS = 40, 4, 0.5, 6
TABLES = {"deep_emb.w_0": DIM, "wide_emb.w_0": 1}


def items_of_step(t: int, reader: int, rng: np.random.Generator, sizes=(3, 5)) -> list[Item]:
    return [
        Item(t, reader, m, n, 2 * sum(sizes), {"sparse": rng.integers(0, VOCAB, (n, SLOTS))})
        for m, n in enumerate(sizes)
    ]


def run_items(ps: PSAccess, items: list[Item], rng: np.random.Generator, seen: dict, grads: list) -> None:
    """What the reader's program does per item: look up the rows of its unique ids (kept in `seen`
    per (item, table)), then hand back a row gradient per lookup (kept in `grads`)."""
    for it in items:
        ids = it.feed["sparse"]
        uniq, index = np.unique(ids, return_inverse=True)
        for table, u, _ in ps.sparse_feeds:
            seen[(it.key, table)] = (uniq, np.asarray(ps.pull_sparse(it, table, u, uniq)))
            g = rng.normal(size=(ids.size, TABLES[table])).astype(np.float32)
            grads.append((table, np.ravel(ids), g))
            ps.push_sparse(it, table, uniq, SparseRows(index.reshape(-1), g, uniq.size))


class CountingClient(PSClient):
    """A PSClient that records the ops of each exchange with the shards (one round trip each)."""

    def __init__(self, log: list, *args, **kwargs) -> None:
        self.log = log
        super().__init__(*args, **kwargs)

    def _exchange(self, requests):
        self.log.append(sorted({req.OP for _, req in requests}))
        return super()._exchange(requests)


def reader(plan, servers: Servers, r: int, log: list) -> PSAccess:
    """Reader cpu:r's parameter-server access; `log` gets the ops of its exchanges (all threads)."""
    ps = PSAccess(
        plan.programs["cpu"],
        plan.tables,
        "sync",
        np,
        StepBook(f"cpu:{r}", True, 2),
        {"ps_s": 0.0},
        Recorder(on=False),
    )
    ps.connect(
        lambda: CountingClient(log, servers.endpoints, secret=servers.secret, timeout=20, pusher=f"cpu:{r}")
    )
    return ps


def test_a_sync_push_carries_the_next_steps_rows_which_include_every_readers_step():
    plan = transpile(wide_deep(vocab=VOCAB, dim=DIM, num_slots=SLOTS, optimizer=nn.SGD(lr=LR)).main)
    rng = np.random.default_rng(0)
    start = {t: rng.normal(size=(VOCAB, d)).astype(np.float32) for t, d in TABLES.items()}
    want = {t: v.astype(np.float64) for t, v in start.items()}
    with Servers(plan.tables, num_shards=2, mode="sync", pushes_per_step=2, transport="ipc") as servers:
        admin = servers.client()
        for table, values in start.items():
            admin.assign(table, values, ids=np.arange(VOCAB))
        logs: list[list] = [[], []]
        readers = [reader(plan, servers, r, logs[r]) for r in range(2)]
        try:
            items = {r: items_of_step(0, r, rng) for r in range(2)}
            for r, ps in enumerate(readers):
                ps.prefetch_rows(0, items[r])
            for t in range(3):
                seen: dict = {}
                grads: list = []
                for r, ps in enumerate(readers):
                    run_items(ps, items[r], rng, seen, grads)
                for (key, table), (uniq, rows) in seen.items():  # rows of step t include steps < t
                    np.testing.assert_allclose(
                        rows, want[table][uniq], rtol=1e-5, atol=1e-5, err_msg=f"step {t}, item {key}"
                    )
                nxt = {r: items_of_step(t + 1, r, rng) for r in range(2)}
                before = [len(log) for log in logs]

                def push(r: int) -> None:  # step t's push and step t + 1's rows, until they are back
                    readers[r].push_step(t, readers[r].book.step(t), nxt[r])
                    readers[r].bg.settle()

                first = threading.Thread(target=push, args=(0,))
                first.start()
                first.join(1.0)
                assert first.is_alive(), "step t + 1's rows came back before every reader pushed step t"
                push(1)
                first.join(20)
                assert not first.is_alive()
                # one round trip per reader: step t's push with step t + 1's row pull
                assert [log[n:] for log, n in zip(logs, before, strict=True)] == [[["push_pull"]]] * 2
                for table, ids, g in grads:
                    np.add.at(want[table], ids, -LR * g.astype(np.float64))
                items = nxt
                for r, ps in enumerate(readers):
                    ps.book.flushed = t + 1
                    ps.prefetch_rows(t + 1, items[r])  # as the announcement does: already asked for
                    ps.bg.settle()
                assert [len(log) for log in logs] == [n + 1 for n in before]
        finally:
            for ps in readers:
                ps.bg.close()
                ps.close()
            admin.close()


def by_hand(start: dict[str, np.ndarray], batches: list[dict], lr: float) -> tuple[list[float], dict]:
    """Full-batch SGD on loss = mean((emb(ids).flatten() @ w + b - label)^2), in float64."""
    p = {k: v.astype(np.float64) for k, v in start.items()}
    losses = []
    for b in batches:
        ids, label = b["ids"], b["label"].astype(np.float64)
        n = ids.shape[0]
        x = p["emb.w_0"][ids].reshape(n, -1)
        y = x @ p["fc.w_0"] + p["fc.b_0"]
        losses.append(float(np.mean((y - label) ** 2)))
        dy = 2 * (y - label) / n
        dx = (dy @ p["fc.w_0"].T).reshape(n, ids.shape[1], -1)
        p["fc.w_0"] -= lr * (x.T @ dy)
        p["fc.b_0"] -= lr * dy.sum(axis=0)
        np.add.at(p["emb.w_0"], ids.reshape(-1), -lr * dx.reshape(-1, dx.shape[-1]))
    return losses, p


def test_sync_run_of_two_readers_sharing_ids_equals_full_batch_sgd_by_hand():
    """Two readers x 2 micro-batches whose ids overlap in every step, emulated gpu trainer, 2 shards:
    each step's loss and the final parameters equal full-batch SGD by hand. A reader whose rows of
    step t + 1 missed the other reader's step t would show in the next step's loss."""
    vocab, slots, dim, n, steps, lr = 12, 3, 4, 16, 6, 0.3
    main, startup = nn.Program(), nn.Program()
    with nn.program_guard(main, startup):
        ids = nn.data("ids", [-1, slots], "int64")
        label = nn.data("label", [-1, 1])
        emb = nn.embedding(ids, vocab, dim, name="emb")
        y = nn.fc(nn.reshape(emb, [-1, slots * dim]), 1, name="fc")
        nn.SGD(lr=lr).minimize(nn.reduce_mean(nn.square_error(y, label)))
    rng = np.random.default_rng(3)
    start = {
        "emb.w_0": rng.normal(size=(vocab, dim)).astype(np.float32),
        "fc.w_0": rng.normal(size=(slots * dim, 1)).astype(np.float32) * 0.3,
        "fc.b_0": np.full(1, 0.1, np.float32),
    }
    main.params = dict(start)
    batches = [
        {"ids": rng.integers(0, vocab, (n, slots)), "label": rng.normal(size=(n, 1)).astype(np.float32)}
        for _ in range(steps)
    ]
    hist = train(
        main,
        batches,
        epochs=1,
        trainers={"cpu": 2, "gpu": 1},
        servers=2,
        mode="sync",
        micro_batches=2,
        allow_emulation=True,
        return_params=True,
    )
    losses, want = by_hand(start, batches, lr)
    np.testing.assert_allclose(hist.loss, losses, rtol=1e-5)
    for name, w in want.items():
        np.testing.assert_allclose(hist.params[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
