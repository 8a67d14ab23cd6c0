"""Background work has an owner that awaits it (daemon/background.py): ``stop`` cancels what
may be cancelled, waits for work a thread is in, and logs failures; and a daemon that stops
leaves no task on its loop, no job unfinished and no thread of its pools running."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import InProcessDaemon

from kvswap.daemon.background import Background
from kvswap.protocol import Client, HostKVCache


def test_stop_waits_for_thread_jobs_and_tasks_and_cancels_only_the_cancellable(
        caplog: pytest.LogCaptureFixture) -> None:
    go = threading.Event()
    ended: list[str] = []

    def job() -> None:
        go.wait(5)
        ended.append("job")

    async def waits_for_a_thread(pool: ThreadPoolExecutor) -> None:
        await asyncio.get_running_loop().run_in_executor(pool, go.wait, 5)
        ended.append("task")

    async def fails() -> None:
        raise OSError("probe failed")

    async def main() -> None:
        background = Background("test")
        with ThreadPoolExecutor(2) as pool:
            background.submit(pool, job, what="job")
            background.spawn(waits_for_a_thread(pool), "task")
            timer = background.spawn(asyncio.sleep(3600), "timer", cancel_on_stop=True)
            background.spawn(fails(), "failing")
            await asyncio.sleep(0)
            stopping = asyncio.ensure_future(background.stop())
            await asyncio.sleep(0.05)
            assert not stopping.done() and ended == []  # the thread work is waited for
            assert timer.cancelled()
            go.set()
            await asyncio.wait_for(stopping, 5)
            assert sorted(ended) == ["job", "task"] and background.running == 0

    with caplog.at_level(logging.WARNING, "kvswap.daemon.background"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == ["background task failed: probe failed"]
    assert caplog.records[0].work == "test: failing"  # type: ignore[attr-defined]


def test_a_stopped_daemon_leaves_no_task_job_or_pool_thread_running(tmp_path: Path, cache: HostKVCache) -> None:
    d = InProcessDaemon(tmp_path / "s", remote_check_interval_s=0.01, maintenance_interval_s=0.01)
    with d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0, 1], ["a", "b"], wait="copied").queued == 2
        assert c.lookup(["a", "b"]) == 2  # a chain touch in the background
        assert c.swap_in(["a"], [5]).loaded == 1
        assert c.swap_out([2], ["c"], wait="copied").queued == 1  # writes still in flight, perhaps
    swapper, loop = d.daemon.swapper, d._loop
    assert loop is not None
    owners = [swapper._writes, swapper._background, swapper.registrar._background, swapper.upkeep._background,
              swapper.staging._background]
    assert d.daemon.gate is not None
    owners.append(d.daemon.gate._background)
    assert [owner.running for owner in owners] == [0] * len(owners)
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
    threads = [t for pool in swapper.threads.pools for t in pool._threads]  # type: ignore[attr-defined]
    alive = [t.name for t in threads if t.is_alive()]
    assert alive == []
