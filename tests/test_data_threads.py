"""Data threads (copies, record I/O, upkeep) run below the event loop's priority, so the
kernel gives the loop a core first; read from /proc of a real daemon after real swaps."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvswap.daemon.data_threads import data_pool, lower_priority
from kvswap.protocol import Client, HostKVCache
from support import DaemonProcess, free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def thread_nices(pid: int) -> dict[int, int]:
    """tid -> nice value, from /proc/PID/task/TID/stat (field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = int(fields[16])
    return out


@pytest.mark.parametrize("nice", [10, 0])
def test_daemon_data_threads_run_below_the_loop(tmp_path: Path, cache: HostKVCache, nice: int) -> None:
    daemon = DaemonProcess(tmp_path / "store", free_port(), free_port(),
                           extra_args=["--data-thread-nice", str(nice)]).start()
    try:
        with Client(daemon.endpoint, timeout=10) as c:
            c.register(cache)
            keys = [f"k{i}" for i in range(8)]
            assert c.swap_out(list(range(8)), keys, wait="persisted").stored == 8
            assert c.swap_in(keys, list(range(8))).loaded == 8
            nices = thread_nices(daemon.proc.pid)
            # Relative to the loop's thread: the daemon inherits whatever nice value the test
            # runner has (a CI job may itself run niced), and data threads go below that.
            base = nices[daemon.proc.pid]  # the main thread runs the loop
            assert base == os.getpriority(os.PRIO_PROCESS, os.getpid())
            lowered = [tid for tid, n in nices.items() if n > base and tid != daemon.proc.pid]
            # the copy thread and at least one write and one read thread have run by now (the
            # upkeep thread only after its first interval); the I/O threads at the nice value
            # asked for, the copy thread (which the engine waits on) halfway to the loop
            assert (len(lowered) >= 3) if nice and base < 19 else all(n == base for n in nices.values()), nices
            below = {base, min(19, base + nice // 2), min(19, base + nice)}
            assert set(nices.values()) <= below, nices
            assert not nice or min(19, base + nice) in nices.values(), nices
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_pool_threads_lower_only_themselves() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with data_pool(2, "t", 5) as pool:
        seen = list(pool.map(lambda _: os.getpriority(os.PRIO_PROCESS, 0), range(4)))
    assert set(seen) == {min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + 5)}
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    assert lower_priority(0) is True
