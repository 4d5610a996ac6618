"""A driver killed (SIGKILL) while it trains on a private local Ray: the janitor kills every process of
that Ray (gcs_server, raylet, and the DashboardAgent / RuntimeEnvAgent that outlived the driver before)
and removes its `hetps-ray-*` directory; while the run lives, hetps's directory stays private (0700)
although Ray opens its own temp dir, inside it, to all (0777)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

_DRIVER = textwrap.dedent(
    """
    import sys
    from runtime import train
    from runtime.data import SyntheticCTR
    from runtime.engines import RayEngine
    from transpiler import builder as nn, transpile
    from transpiler.models import wide_deep

    eng = RayEngine()
    def tell(rec):
        if rec["step"] == 1:
            print("TMP", eng.tmp, flush=True)
    plan = transpile(wide_deep(vocab=300, dim=8, hidden=(16,), optimizer=nn.SGD(lr=0.1)).main)
    train(plan, SyntheticCTR(vocab=300), steps=100000, batch_size=64, engine=eng,
          trainers={"cpu": 1, "gpu": 1}, servers=1, mode="async", allow_emulation=True,
          progress=False, callback=tell)
    """
)


def _holders(path: str) -> dict[int, str]:
    """{pid: name} of the processes that name `path` on their command line or hold a file in it."""
    found = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace")
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if path in args or any(fd.startswith(path + "/") for fd in fds):
            found[pid] = args.replace("\0", " ")
    return found


@pytest.mark.slow
def test_a_killed_ray_driver_leaves_no_ray_process_and_no_directory():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("TMP "), f"the driver did not train: {line!r}"
        tmp = line.split()[1]
        assert os.stat(tmp).st_mode & 0o777 == 0o700  # hetps's own directory
        assert os.path.isdir(os.path.join(tmp, "ray"))  # Ray's, inside it (Ray makes it 0777)
        ray_procs = _holders(tmp)
        assert any("raylet" in n for n in ray_procs.values()), ray_procs
        assert any("dashboard" in n.lower() for n in ray_procs.values()), ray_procs  # its agent
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 60
        while (_holders(tmp) or os.path.exists(tmp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {p: n[:80] for p, n in ray_procs.items() if _zombie(p) is False}  # (alive, not a zombie)
        assert not left, f"Ray processes of the killed driver still alive: {left}"
        assert not _holders(tmp) and not os.path.exists(tmp), f"{tmp} left behind"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def _zombie(pid: int) -> bool | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except OSError:
        return None
