"""Writes under pressure (issue 27): a ``wait="persisted"`` swap_out finding write staging
full waits for room up to its deadline, in a bounded queue served first come first served;
``wait="copied"`` still answers ``busy`` at once. Nothing is copied for a request that was
answered (its deadline, its registration's release) before it got its slots.

The daemon runs on a thread of the test (support.InProcessDaemon) with a real socket and a
real directory; its disk's ``write_file`` is the one seam patched, to hold writes back and let
them through a given number at a time, so staging stays full for as long as a test needs."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from support import InProcessDaemon, wait_until

from kvswap.daemon.staging import MAX_WRITE_WAITERS
from kvswap.protocol import Busy, Client, HostKVCache, NotRegistered, Timeout
from kvswap.protocol import messages as m

#: Write staging of this many records.
SLOTS = 4


class MeteredWrites:
    """Wraps ``Disk.write_file``: each write waits for a permit (``allow``)."""

    def __init__(self, disk: Any) -> None:
        self.disk, self.original = disk, disk.write_file
        self.permits = threading.Semaphore(0)
        self.waiting = 0
        self._lock = threading.Lock()
        disk.write_file = self

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()

    def open(self) -> None:
        self.allow(10_000)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.waiting += 1
        assert self.permits.acquire(timeout=60), "the test never let this write through"
        with self._lock:
            self.waiting -= 1
        return self.original(*args, **kwargs)


@pytest.fixture
def pressed(tmp_path: Path, cache: HostKVCache) -> Iterator[tuple[InProcessDaemon, Client, MeteredWrites]]:
    slot = (cache.layout.record_bytes + 4095) // 4096 * 4096
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=0, file_layout="files", write_staging_bytes=SLOTS * slot,
                         read_staging_bytes=2 * slot, write_threads=2) as d, Client(d.endpoint, timeout=30) as c:
        c.register(cache)
        gate = MeteredWrites(d.daemon.file_backend.disk)
        try:
            yield d, c, gate
        finally:
            gate.open()


def fill_staging(c: Client, gate: MeteredWrites) -> list[str]:
    """Write staging full: SLOTS records copied, one swap_out each (so each write frees its
    slot when it ends: a swap_out's writes free theirs a chunk at a time), held at the gate."""
    keys = [f"full-{i}" for i in range(SLOTS)]
    for i, key in enumerate(keys):
        assert c.swap_out([i], [key]).queued == 1
    assert wait_until(lambda: gate.waiting == 2)  # two write threads, both held
    return keys


def waiting(c: Client) -> dict[str, int]:
    return c.stats()["write_waiting"]


def send_persisted(c: Client, blocks: list[int], keys: list[str], timeout: float = 30) -> int:
    return c.send(m.SwapOut, {"block_ids": tuple(blocks), "keys": tuple(keys), "wait": "persisted"}, timeout)


def test_a_persisted_swap_out_waits_for_room_and_a_copied_one_is_busy_at_once(
        pressed: tuple[InProcessDaemon, Client, MeteredWrites], cache: HostKVCache) -> None:
    d, c, gate = pressed
    fill_staging(c, gate)
    sent = send_persisted(c, [10, 11], ["p0", "p1"])
    assert wait_until(lambda: waiting(c)["now"] == 1)
    assert not c.done(sent)  # waiting, not refused
    with pytest.raises(Busy) as busy:
        c.swap_out([12], ["c0"])  # "copied": the engine waits to reuse its blocks, so no waiting
    assert busy.value.details["waiting"] == 1 and busy.value.details["needed"] == 1
    gate.open()
    result = c.wait(sent)
    assert result["stored"] == 2 and result["status"] == ["stored", "stored"]
    assert waiting(c) == {"now": 0, "waited": 1, "served": 1, "refused": 0, "timed_out": 0}
    cache.zero_blocks([20, 21])
    assert c.swap_in(["p0", "p1"], [20, 21]).loaded == 2
    assert [cache.block_record(b) for b in (20, 21)] == [cache.block_record(b) for b in (10, 11)]


def test_waiters_are_served_in_arrival_order_and_nobody_overtakes_a_big_one(
        pressed: tuple[InProcessDaemon, Client, MeteredWrites], cache: HostKVCache) -> None:
    d, c, gate = pressed
    fill_staging(c, gate)
    big = send_persisted(c, list(range(10, 10 + SLOTS)), [f"big-{i}" for i in range(SLOTS)])
    assert wait_until(lambda: waiting(c)["now"] == 1)
    small = [send_persisted(c, [20 + i], [f"small-{i}"]) for i in range(2)]
    assert wait_until(lambda: waiting(c)["now"] == 3)

    gate.allow(1)  # one slot free: the big one needs all four, and the small ones wait behind it
    assert wait_until(lambda: c.stats()["write_staging"]["free"] == 1)
    assert waiting(c)["served"] == 0 and waiting(c)["now"] == 3
    with pytest.raises(Busy):  # nor does a swap_out that does not wait take the head's slot
        c.swap_out([30], ["copied-0"], partial=False)
    assert c.swap_out([30], ["copied-1"], partial=True).skipped == 1

    gate.allow(SLOTS - 1)  # all four free: the big one's, first
    assert wait_until(lambda: waiting(c)["served"] == 1)
    assert waiting(c)["now"] == 2
    gate.allow(SLOTS)  # the big one's writes: then the small ones, in order
    assert c.wait(big)["stored"] == SLOTS
    assert wait_until(lambda: waiting(c)["served"] == 3)
    gate.open()
    assert [c.wait(s)["stored"] for s in small] == [1, 1]
    assert c.lookup([f"big-{i}" for i in range(SLOTS)]) == SLOTS
    assert c.lookup(["small-0"]) == 1 and c.lookup(["small-1"]) == 1


def test_a_waiter_whose_deadline_passes_is_a_timeout_and_nothing_of_it_is_copied(
        pressed: tuple[InProcessDaemon, Client, MeteredWrites], cache: HostKVCache) -> None:
    d, c, gate = pressed
    fill_staging(c, gate)
    before = c.stats()["write_staging"]
    sent = send_persisted(c, [10, 11], ["late-0", "late-1"], timeout=0.5)
    with pytest.raises(Timeout):
        c.wait(sent)
    assert wait_until(lambda: waiting(c)["now"] == 0)
    assert waiting(c)["timed_out"] == 1 and waiting(c)["served"] == 0
    cache.fill_random(seed=99)  # the engine reuses its blocks at once
    gate.open()
    c.flush()
    assert c.lookup(["late-0"]) == 0 and c.lookup(["late-1"]) == 0  # never copied, never stored
    assert c.stats()["write_staging"]["free"] == before["slots"]  # every slot back
    assert d.daemon.swapper.pending_writes == 0


def test_one_waiter_past_the_limit_is_busy_at_once(
        pressed: tuple[InProcessDaemon, Client, MeteredWrites], cache: HostKVCache) -> None:
    d, c, gate = pressed
    fill_staging(c, gate)
    sent = [send_persisted(c, [10 + i % 16], [f"w-{i}"]) for i in range(MAX_WRITE_WAITERS)]
    assert wait_until(lambda: waiting(c)["now"] == MAX_WRITE_WAITERS)
    with pytest.raises(Busy) as busy:
        c.wait(send_persisted(c, [9], ["one-more"]))
    assert busy.value.details["waiting"] == MAX_WRITE_WAITERS and busy.value.details["limit"] == MAX_WRITE_WAITERS
    assert waiting(c)["refused"] == 1
    gate.open()
    assert [c.wait(s)["stored"] for s in sent] == [1] * MAX_WRITE_WAITERS
    assert c.lookup(["one-more"]) == 0
    assert waiting(c)["served"] == MAX_WRITE_WAITERS and waiting(c)["now"] == 0


def test_a_waiter_lets_go_when_its_registration_is_released(
        pressed: tuple[InProcessDaemon, Client, MeteredWrites], cache: HostKVCache) -> None:
    d, c, gate = pressed
    fill_staging(c, gate)
    sent = send_persisted(c, [10], ["r-0"], timeout=30)
    assert wait_until(lambda: waiting(c)["now"] == 1)
    released = c.send(m.Unregister, {})  # the writes stay held: the waiter must let go by itself
    with pytest.raises(NotRegistered):
        c.wait(sent)
    assert c.wait(released)["released"] is True
    assert waiting(c)["now"] == 0 and waiting(c)["served"] == 0
