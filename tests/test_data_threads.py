"""Data threads (copies, record I/O, upkeep) run below the event loop's priority, so the
kernel gives the loop a core first; read from /proc of a real daemon after real swaps. And
``spread``, which hands a batch's items to a pool one job each."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvswap.daemon.data_threads import data_pool, lower_priority, spread
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


def test_spread_runs_each_item_on_a_job_of_its_own() -> None:
    # Four items that can only end once all four have started: one job per item on four
    # threads finishes, a batch on one thread would wait at the barrier until it broke.
    barrier = threading.Barrier(4, timeout=10)

    def work(item: int) -> tuple[int, str]:
        barrier.wait()
        return item * 10, threading.current_thread().name

    with ThreadPoolExecutor(4) as pool:
        results = spread(pool, work, [1, 2, 3, 4]).result(timeout=10)
    assert [r for r, _ in results] == [10, 20, 30, 40]
    assert len({name for _, name in results}) == 4


def test_spread_resolves_once_the_last_job_ended_with_results_in_item_order() -> None:
    gates = [threading.Event() for _ in range(3)]
    ended = [threading.Event() for _ in range(3)]

    def work(i: int) -> int:
        gates[i].wait(10)
        ended[i].set()
        return i

    with ThreadPoolExecutor(3) as pool:
        future = spread(pool, work, [0, 1, 2])
        gates[2].set()
        gates[1].set()
        assert ended[2].wait(10) and ended[1].wait(10)
        # Items 1 and 2 are done (their jobs return right after); item 0 still runs.
        assert not future.done()
        gates[0].set()
        assert future.result(timeout=10) == [0, 1, 2]


def test_spread_raises_a_jobs_failure_only_after_the_other_jobs_ended() -> None:
    release = threading.Event()
    ended: list[int] = []

    def work(i: int) -> int:
        if i == 0:
            raise ValueError("item 0")
        release.wait(10)  # still reading its item when item 0 has failed
        ended.append(i)
        return i

    with ThreadPoolExecutor(3) as pool:
        future = spread(pool, work, [0, 1, 2])
        assert not future.done()
        release.set()
        with pytest.raises(ValueError, match="item 0"):
            future.result(timeout=10)
    assert sorted(ended) == [1, 2]


def test_spread_never_raises_when_the_pool_refuses_work() -> None:
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shutdown"):
        spread(pool, lambda i: i, [1, 2]).result(timeout=10)
    assert spread(pool, lambda i: i, []).result(timeout=10) == []


def test_spread_waits_for_the_jobs_submitted_before_the_pool_refused_the_rest() -> None:
    release = threading.Event()
    ran: list[int] = []

    class Refusing(ThreadPoolExecutor):
        """Takes two jobs, then refuses (as a pool does once it is shut down)."""

        taken = 0

        def submit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if self.taken == 2:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.taken += 1
            return super().submit(*args, **kwargs)

    def work(i: int) -> int:
        release.wait(10)
        ran.append(i)
        return i

    with Refusing(2) as pool:
        future = spread(pool, work, [0, 1, 2, 3])
        assert not future.done()  # the two jobs taken still run: their items are still in use
        release.set()
        with pytest.raises(RuntimeError, match="shutdown"):
            future.result(timeout=10)
    assert sorted(ran) == [0, 1]
