"""A driver stopped (SIGSTOP, Ctrl-Z) for seconds near the end of a run and then continued: the
trainers' last messages still reach it, and the run that finished is reported as finished."""

from __future__ import annotations

import os
import signal
import subprocess

from procs import alive

from runtime import train
from runtime.data import SyntheticCTR
from runtime.engines import LocalEngine
from transpiler import builder as nn
from transpiler.models import wide_deep

STOP_S = 6  # the trainers finish meanwhile; their queued reports overflow the kernel's socket buffer


def test_a_sync_run_that_finished_while_the_driver_was_stopped_is_reported_finished():
    # Before the fix: "gpu:0 failed: exited before the run finished" (its last messages were dropped
    # after the 2 s linger, or after the 5 s a process waits at exit for them to go out).
    model = wide_deep(vocab=1000, dim=8, hidden=(16,), optimizer=nn.SGD(lr=0.1))
    eng, stopped = LocalEngine(), []

    def stop_self(record):
        if record["step"] == 3 and not stopped:
            subprocess.Popen(["sh", "-c", f"sleep {STOP_S}; kill -CONT {os.getpid()}"])
            stopped.append(1)
            os.kill(os.getpid(), signal.SIGSTOP)

    hist = train(
        model.main,
        SyntheticCTR(vocab=1000),
        steps=120,
        batch_size=512,
        mode="sync",
        engine=eng,
        allow_emulation=True,
        callback=stop_self,
        progress=False,
        stall_timeout=60.0,
    )
    assert stopped and hist.steps == 120 and len(hist.loss) == 120
    assert sorted(hist.trainers) == ["cpu:0", "cpu:1", "gpu:0"]
    assert not alive(eng.pids().values())
