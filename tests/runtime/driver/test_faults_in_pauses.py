"""A shard that fails while the driver waits on it outside its loop — a checkpoint's save, the
applied-count wait, an evaluation, the shards' start-up — is named within seconds, with its own
error text, not after the stall timeout as a network problem."""

from __future__ import annotations

import os
import signal
import time

import pytest
from procs import alive

from runtime import TrainingError, train
from runtime.data import SyntheticCTR
from runtime.engines import LocalEngine
from transpiler import builder as nn
from transpiler.models import wide_deep

STALL_S = 30.0  # what the old way waited before it blamed "no reply" (the default is 60 s)


def run_with_fault(tmp_path, sig: signal.Signals, pause: str, at: int = 4) -> tuple[TrainingError, float]:
    """A sync run that pauses at step `at` (a checkpoint or an evaluation); ps:0 gets `sig` as the
    driver records step `at` - 1, i.e. just before the pause waits for the shards."""
    model = wide_deep(vocab=200, dim=4, hidden=(8,), optimizer=nn.SGD(lr=0.1))
    data = SyntheticCTR(vocab=200)
    eng, hit = LocalEngine(), []

    def fault(record):
        if record["step"] == at - 1 and not hit:
            os.kill(eng.pids()["ps:0"], sig)
            hit.append(time.monotonic())

    pauses = (
        {"checkpoint": str(tmp_path / "ck"), "checkpoint_every": at}
        if pause == "checkpoint"
        else {"eval_data": [data.batch(10_000, 64)], "eval_every": at}
    )
    with pytest.raises(TrainingError) as err:
        train(
            model.main,
            data,
            steps=50,
            batch_size=32,
            servers=2,
            mode="sync",
            engine=eng,
            allow_emulation=True,
            callback=fault,
            progress=False,
            stall_timeout=STALL_S,
            **pauses,
        )
    assert not alive(eng.pids().values())
    return err.value, time.monotonic() - hit[0]


@pytest.mark.parametrize(
    "sig, pause",
    [(signal.SIGKILL, "checkpoint"), (signal.SIGSTOP, "checkpoint"), (signal.SIGKILL, "evaluation")],
)
def test_a_shard_failing_during_a_pause_is_named_at_once(tmp_path, sig, pause):
    # Before the fix: "the pause at step 4 (checkpoint / evaluation) failed: PSTimeoutError: no
    # reply to 'stats' within 30.0 s ... is the server running and reachable?", after the timeout.
    err, took = run_with_fault(tmp_path, sig, pause)
    how = "was killed by signal SIGKILL" if sig == signal.SIGKILL else "is stopped (SIGSTOP"
    assert err.who == "ps:0" and how in str(err), str(err)
    assert "PSTimeoutError" not in str(err)
    assert took < STALL_S, took  # 1-2 s (chaos.py); the old way waited STALL_S for a reply


def test_a_shard_that_cannot_allocate_its_tables_is_reported_with_its_own_error():
    # Before the fix the shard died at start-up and the driver said, after the stall timeout, "no
    # reply to 'hello' ... is the server running and reachable?".
    model = wide_deep(vocab=100, dim=4, hidden=(200_000, 100_000), optimizer=nn.SGD(lr=0.1))  # 80 GB
    start = time.monotonic()
    with pytest.raises(TrainingError) as err:
        train(
            model.main,
            SyntheticCTR(vocab=100),
            steps=3,
            batch_size=8,
            allow_emulation=True,
            progress=False,
            stall_timeout=STALL_S,
        )
    text = str(err.value)
    assert err.value.who == "ps:0", text
    assert "shard 0 cannot start: its tables need 80.10 GB (table 'fc_1.w_0' 80.00 GB" in text
    assert "no reply" not in text
    assert time.monotonic() - start < 2 * STALL_S  # (start-up included: 6 s here, 27 s at load 24)
