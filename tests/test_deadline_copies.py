"""No byte is copied from or into an engine's memory after its request was answered (issue 22).

The property, at every row of a multi-block copy, on both copy paths (the native helper and the
preadv fallback), for swap_out and for swap_in from each place a record can come from (the file
tier, the RAM tier, a write still in flight): a :class:`RowHold` stops the copy in the *middle*
of row ``at`` until the daemon is answering the request at its deadline, then lets that row
finish. The daemon must hold the answer back until the row in progress ended, start no later
row, and store only records copied whole before the answer:

- ordering: every row the hold saw end comes before the ``timeout`` reply;
- promptness: rows copied == ``at + 1`` (the one in progress, none after);
- bytes: the engine overwrites its blocks with 0xEE the moment it has the answer; a swap_out's
  stored records hold the original bytes, exactly the records of the gather chunks that were
  whole; a swap_in's blocks stay 0xEE once the daemon has finished with the request.

A daemon in this process (the hold wraps the mover's ``copy_rows`` or the segment module's
``preadv``/``pwritev``, the one seam), the real client over a real socket.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from copy_paths import copy_path  # noqa: F401 (a fixture)
from support import GatedWrites, InProcessDaemon, wait_until

from kvswap.daemon import swapper as swapper_module
from kvswap.daemon.deadline import Deadline
from kvswap.daemon.movers import segment
from kvswap.protocol import CacheLayout, Client, HostKVCache, Timeout
from kvswap.protocol import messages as m

#: One layer: regions k.0 and v.0, so a block is two rows.
REGIONS = 2
BLOCKS = 6
ROWS = BLOCKS * REGIONS
FILL = 0xEE


class RowHold:
    """Counts the rows copied between engine memory and staging, in the order they end. In the
    middle of row ``at`` it waits until the daemon is answering (its ``Deadline.stop`` waits for
    this copy) or has answered, then finishes the row. ``events`` is the order of row ends and
    the timeout reply."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.rows = 0
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.reached = threading.Event()
        self.replied = threading.Event()
        self.deadline: Deadline | None = None

    def _ended(self, n: int) -> None:
        with self.lock:
            self.rows += n
            self.events.extend(["row"] * n)

    def _hold(self) -> None:
        self.reached.set()
        assert wait_until(lambda: (self.deadline is not None and self.deadline.waiting) or self.replied.is_set(),
                          30, interval=0.001), "the daemon never answered the held request"

    def reply(self, reply: Any) -> None:
        if not reply.ok and reply.error is not None and reply.error.code == "timeout":
            with self.lock:
                self.events.append("reply")
            self.replied.set()

    # -- the native path: wraps copy_rows ----------------------------------------------------

    def native(self, real: Callable[..., int]) -> Callable[..., int]:
        def copy_rows(table: np.ndarray, stop: Any = None) -> int:
            rows = table.reshape(-1, 3)
            k = self.at - self.rows
            if not 0 <= k < len(rows):
                done = real(rows, stop)
                self._ended(max(done, 0))
                return done
            done = real(rows[:k], stop)
            self._ended(max(done, 0))
            if done != k or (stop is not None and stop[0]):
                return done
            src, dst, n = (int(x) for x in rows[k])
            half = n // 2
            assert real(np.array([[src, dst, half]], dtype=np.uint64)) == 1
            self._hold()
            assert real(np.array([[src + half, dst + half, n - half]], dtype=np.uint64)) == 1
            self._ended(1)
            rest = real(rows[k + 1:], stop)
            if rest < 0:
                return -(k + 1) + rest
            self._ended(rest)
            return k + 1 + rest
        return copy_rows

    # -- the preadv path: wraps the segment module's os ----------------------------------------

    def io(self, call: Callable[[int, list, int], int]) -> Callable[[int, list, int], int]:
        def row(fd: int, buffers: list, offset: int) -> int:
            (buffer,) = buffers
            view = memoryview(buffer).cast("B")
            if self.rows != self.at:
                done = call(fd, [view], offset)
                self._ended(1)
                return done
            half = len(view) // 2
            done = call(fd, [view[:half]], offset)
            self._hold()
            done += call(fd, [view[half:]], offset + half)
            self._ended(1)
            return done
        return row


class _HeldOs:
    """``os`` for the segment module, with preadv/pwritev going through a hold."""

    def __init__(self, hold: RowHold) -> None:
        self.preadv = hold.io(os.preadv)
        self.pwritev = hold.io(os.pwritev)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


@pytest.fixture
def layout() -> CacheLayout:
    return CacheLayout("deadline-rows", num_layers=1, num_blocks=64, block_size=8, num_kv_heads=2, head_dim=16)


@pytest.fixture
def cache(layout: CacheLayout) -> Iterator[HostKVCache]:
    assert len(layout.regions) == REGIONS
    with HostKVCache.create(layout) as c:
        c.fill_random(seed=7)
        yield c


class Held:
    """Installs a :class:`RowHold` on a daemon for one request: the copy path's seam, the reply
    seam and ``Deadline.stop`` (to know which request is being answered)."""

    def __init__(self, d: InProcessDaemon, copy_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.d, self.copy_path, self.monkeypatch = d, copy_path, monkeypatch
        self.hold: RowHold | None = None
        real_stop = Deadline.stop

        async def stop(deadline: Deadline, *args: Any, **kwargs: Any) -> bool:
            if self.hold is not None:
                self.hold.deadline = deadline
            return await real_stop(deadline, *args, **kwargs)

        monkeypatch.setattr(Deadline, "stop", stop)
        real_send = d.daemon.dispatcher.send

        def send(envelope: list[bytes], reply: Any) -> None:
            if self.hold is not None:
                self.hold.reply(reply)
            real_send(envelope, reply)

        monkeypatch.setattr(d.daemon.dispatcher, "send", send)

    def arm(self, at: int) -> RowHold:
        self.hold = RowHold(at)
        mover = self.d.daemon.swapper.registration.mover  # type: ignore[union-attr]
        assert mover.describe()["copy"] == self.copy_path
        if self.copy_path == "native":
            self._real = getattr(self, "_real", mover._copy_rows)
            mover._copy_rows = self.hold.native(self._real)
        else:
            self.monkeypatch.setattr(segment, "os", _HeldOs(self.hold))
        return self.hold

    def disarm(self) -> None:
        mover = self.d.daemon.swapper.registration.mover  # type: ignore[union-attr]
        if self.copy_path == "native":
            mover._copy_rows = self._real
        else:
            self.monkeypatch.setattr(segment, "os", os)
        self.hold = None


def timed_out(attempt: Callable[[float], RowHold]) -> RowHold:
    """Run one held request with a deadline long enough for the copy to reach the held row
    first: on a busy machine the deadline may pass before it, so try again with a longer one."""
    timeout = 0.15
    for _ in range(6):
        hold = attempt(timeout)
        if hold.reached.is_set():
            return hold
        timeout *= 2
    raise AssertionError("the copy never reached the held row before the deadline")


def check_answer_order(hold: RowHold) -> None:
    assert hold.events.count("reply") == 1
    assert "row" not in hold.events[hold.events.index("reply"):], hold.events
    assert hold.rows == hold.at + 1  # the row in progress ended; none started after the stop


def fill(cache: HostKVCache, blocks: list[int]) -> None:
    for arr in cache.arrays.values():
        arr.view(np.uint8)[blocks] = FILL


def whole_chunks(rows_done: int) -> int:
    """Blocks of a swap_out whose gather chunk was copied whole after ``rows_done`` rows."""
    full = rows_done // REGIONS
    return max((stop for _, stop in swapper_module.gather_chunks(BLOCKS) if stop <= full), default=0)


def swapped_in(d: InProcessDaemon) -> float:
    registry = d.daemon.metrics.registry
    return sum(registry.get_sample_value("kvswap_blocks_total", {"op": "swap_in", "status": s}) or 0.0
               for s in ("loaded", "miss", "corrupt", "error"))


SOURCE = list(range(BLOCKS))
TARGET = list(range(20, 20 + BLOCKS))


@pytest.mark.parametrize("at", range(ROWS))
def test_a_swap_out_answered_at_its_deadline_stores_only_bytes_copied_before(
        tmp_path: Path, cache: HostKVCache, copy_path: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        at: int) -> None:
    original = [cache.block_record(b) for b in SOURCE]
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        held = Held(d, copy_path, monkeypatch)
        tries = iter(range(100))
        keys: list[str] = []

        def attempt(timeout: float) -> RowHold:
            keys[:] = [f"out{at}-{next(tries)}-{i}" for i in SOURCE]
            cache.fill_random(seed=7)
            hold = held.arm(at)
            try:
                with pytest.raises(Timeout):
                    c.swap_out(SOURCE, keys, timeout=timeout)
                fill(cache, SOURCE)  # the engine reuses its blocks at once
            finally:
                held.disarm()
            c.flush()
            return hold

        hold = timed_out(attempt)
        check_answer_order(hold)
        result = c.swap_in(keys, TARGET)
        stored = whole_chunks(hold.rows)
        assert result.status == ["loaded"] * stored + ["miss"] * (BLOCKS - stored)
        assert [cache.block_record(b) for b in TARGET[:stored]] == original[:stored]


def _swap_in_case(d: InProcessDaemon, c: Client, cache: HostKVCache, held: Held, at: int,
                  prepare: Callable[[list[str]], Callable[[], None]]) -> None:
    """``prepare(keys)`` makes the records of ``SOURCE`` findable under ``keys`` and returns
    what to do once the swap_in is over."""
    tries = iter(range(100))

    def attempt(timeout: float) -> RowHold:
        keys = [f"in{at}-{next(tries)}-{i}" for i in SOURCE]
        finish = prepare(keys)
        cache.zero_blocks(TARGET)
        before = swapped_in(d)
        hold = held.arm(at)
        try:
            with pytest.raises(Timeout):
                c.swap_in(keys, TARGET, timeout=timeout)
            fill(cache, TARGET)  # the engine reuses its blocks at once
            # Whatever the request still does after its answer, it must not touch the blocks.
            assert wait_until(lambda: swapped_in(d) - before >= BLOCKS, 30)
        finally:
            held.disarm()
            finish()
        if hold.reached.is_set():
            for b in TARGET:
                assert cache.block_record(b) == bytes([FILL]) * cache.layout.record_bytes, f"block {b} written late"
        return hold

    check_answer_order(timed_out(attempt))


def _persisted(c: Client) -> Callable[[list[str]], Callable[[], None]]:
    """A ``prepare`` for :func:`_swap_in_case`: the records stored (persisted) under the keys."""
    def stored(keys: list[str]) -> Callable[[], None]:
        assert c.swap_out(SOURCE, keys, wait="persisted").stored == BLOCKS
        return lambda: None
    return stored


def _file_hits(d: InProcessDaemon) -> float:
    return d.daemon.metrics.registry.get_sample_value(
        "kvswap_tier_ops_total", {"tier": "file", "op": "get", "result": "hit"}) or 0.0


@pytest.mark.parametrize("at", range(ROWS))
def test_a_swap_in_from_the_file_tier_writes_nothing_after_its_answer(
        tmp_path: Path, cache: HostKVCache, copy_path: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        at: int) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        _swap_in_case(d, c, cache, Held(d, copy_path, monkeypatch), at, _persisted(c))


@pytest.mark.parametrize("at", range(ROWS))
def test_a_swap_in_of_ram_hits_writes_nothing_after_its_answer(
        tmp_path: Path, cache: HostKVCache, copy_path: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        at: int) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=1 << 22, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        _swap_in_case(d, c, cache, Held(d, copy_path, monkeypatch), at, _persisted(c))
        assert _file_hits(d) == 0  # every record came from RAM, none from disk: the RAM-hit path


@pytest.mark.parametrize("at", range(ROWS))
def test_a_swap_in_of_writes_in_flight_writes_nothing_after_its_answer(
        tmp_path: Path, cache: HostKVCache, copy_path: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        at: int) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        held = Held(d, copy_path, monkeypatch)

        def in_flight(keys: list[str]) -> Callable[[], None]:
            gate = GatedWrites(d.daemon.file_backend.disk)
            assert c.swap_out(SOURCE, keys).queued == BLOCKS  # copied; the writes wait at the gate

            def open_gate() -> None:
                gate.gate.set()
                d.daemon.file_backend.disk.write_file = gate.original
                c.flush()
            return open_gate

        _swap_in_case(d, c, cache, held, at, in_flight)
        assert _file_hits(d) == 0


@pytest.mark.parametrize("copy_path", ["native"], indirect=True)
def test_a_swap_in_waiting_on_one_write_in_flight_survives_another_being_dropped(
        tmp_path: Path, cache: HostKVCache, copy_path: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A swap_in of two keys whose swap_out is still gathering: it waits for the first key's
    copy, and meanwhile the swap_out's deadline drops the second key's in-flight write and frees
    its slot. The second key is a miss, the first loads; the swap_in must not touch the freed
    slot (it raised 'retain of a slot nobody holds' and answered internal)."""
    original = [cache.block_record(b) for b in SOURCE]
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        held = Held(d, copy_path, monkeypatch)
        keys = [f"race-{i}" for i in SOURCE]
        hold = held.arm(REGIONS * swapper_module.GATHER_CHUNK + 1)  # inside block 4's gather chunk
        try:
            out = c.send(m.SwapOut, {"block_ids": tuple(SOURCE), "keys": tuple(keys)}, timeout=1.0)
            assert hold.reached.wait(10), "the gather never reached block 4's chunk"
            # keys[0] is in the first chunk (copied, its 'copied' set only when the gather
            # returns); keys[4] in a later one, dropped when the deadline cuts the gather short.
            swap_in = c.send(m.SwapIn, {"keys": (keys[0], keys[4]), "block_ids": (TARGET[0], TARGET[1])}, timeout=10)
            with pytest.raises(Timeout):
                c.wait(out, timeout=1.0)
            result = c.wait(swap_in, timeout=10)
        finally:
            held.disarm()
        assert result["status"] == ["loaded", "miss"], result
        assert cache.block_record(TARGET[0]) == original[0]


@pytest.mark.parametrize("copy_path", ["native"], indirect=True)
def test_a_flush_after_a_timed_out_swap_out_waits_for_the_records_it_copied(
        tmp_path: Path, cache: HostKVCache, copy_path: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The answer comes when the copy stops, which can be before the gather is back on the
    loop: a flush sent right after that answer must still wait for the first chunk's writes
    (it used to find no write task yet and answer at once, with the records unwritten). The
    copy thread is held after submitting the first chunk until the flush has arrived."""
    original = [cache.block_record(b) for b in SOURCE]
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        swapper = d.daemon.swapper
        held = Held(d, copy_path, monkeypatch)
        flush_arrived = threading.Event()
        real_flush, real_submit = swapper.flush, swapper_module._submit_writes

        async def flush() -> dict[str, Any]:
            flush_arrived.set()
            return await real_flush()

        def submit(*args: Any, **kwargs: Any) -> Any:
            future = real_submit(*args, **kwargs)
            flush_arrived.wait(10)  # on the copy thread: the gather returns after the flush came
            return future

        monkeypatch.setattr(swapper, "flush", flush)
        monkeypatch.setattr(swapper_module, "_submit_writes", submit)
        keys = [f"flush-{i}" for i in SOURCE]
        _, first_chunk = swapper_module.gather_chunks(BLOCKS)[0]
        hold = held.arm(REGIONS * first_chunk - 1)  # the first chunk's last row
        try:
            with pytest.raises(Timeout):
                c.swap_out(SOURCE, keys, timeout=2.0)
            assert hold.reached.is_set()
            flushed = c.flush()
            assert flushed == 1 and swapper.pending_writes == 0
        finally:
            flush_arrived.set()
            held.disarm()
        result = c.swap_in(keys, TARGET)
        assert result.status == ["loaded"] * first_chunk + ["miss"] * (BLOCKS - first_chunk)
        assert [cache.block_record(b) for b in TARGET[:first_chunk]] == original[:first_chunk]
