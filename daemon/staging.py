"""Bounded staging memory: fixed-size slots, one record each, in the daemon's host arena.

Every byte a swap moves passes through a slot, so the slot count is the daemon's memory
bound: when none are free, swap_out answers ``busy`` rather than allocating more, or (a
``wait="persisted"`` swap_out) waits for room in a bounded queue, up to its deadline
(:meth:`Staging.wait_write`). Slots are
4 KiB aligned so direct I/O can use them, and are faulted in before they are handed out, so
no page fault lands on the swap path.

:class:`Staging` is the daemon's staging: one :class:`~kvswap.backends.host_arena.HostArena`
shared by a write window (swap_out), a read window (swap_in) and the RAM tier, its metrics,
its pinning for GPU movers and its registration with tiers that transfer straight from
registered memory. Its interface is slots: take them (all or nothing), hold them with
``retain``, give them back with ``release``; a slot returns to the arena when its last holder
lets go, as a free slot or, when the RAM tier kept it, as a cached record.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable, Final, Iterable

import numpy as np

from kvswap.backends.base import Backend, HeldRecord
from kvswap.backends.disk import aligned_empty
from kvswap.backends.host_arena import ArenaSlot as Slot
from kvswap.backends.host_arena import ArenaWindow, HostArena
from kvswap.protocol.errors import Busy, KvswapError, Timeout, TooLarge
from kvswap.common.units import round_up_to_page

from .background import Background
from .data_threads import DataThreads, run
from .metrics import Metrics
from .movers.base import Mover

__all__ = ["Slot", "Staging", "StagingPool", "aligned_empty"]

log = logging.getLogger(__name__)

#: swap_outs waiting for write staging at once (``wait="persisted"``); one more answers
#: ``busy`` at once. Each holds its decoded request and a lease on the registration while it
#: waits, so the queue is bounded like every other (docs/security.md).
MAX_WRITE_WAITERS: Final = 64
#: How often a waiter looks again whatever woke it: for its deadline, for its registration
#: being released, and for room freed on a path that did not say so.
WRITE_WAIT_POLL_S: Final = 0.05


class _WriteWaiter:
    """A swap_out waiting for ``count`` write slots; ``slots`` is set when they are its."""

    __slots__ = ("count", "slots")

    def __init__(self, count: int, slots: "asyncio.Future[list[Slot]]") -> None:
        self.count = count
        self.slots = slots


class StagingPool(ArenaWindow):
    """A standalone staging pool: a window over an arena of its own (no RAM tier). The daemon's
    :class:`Staging` shares one arena between its windows and the RAM tier instead."""

    def __init__(self, record_bytes: int, budget_bytes: int, name: str = "staging") -> None:
        capacity = max(1, budget_bytes // round_up_to_page(record_bytes))
        super().__init__(HostArena(record_bytes, capacity), name, capacity)

    @property
    def arena(self) -> np.ndarray:
        """The arena's memory (what GPU movers pin)."""
        return self._arena.memory

    @property
    def _slots(self) -> list[Slot]:
        """Every slot by index (tests pick slots at chosen places in the arena)."""
        return self._arena._slots


class Staging:
    """The write and read windows for the registered record size, over one host arena that
    also holds the RAM tier's records (see :mod:`kvswap.backends.host_arena`).

    The arena is made (and remade when the record size changes) by :meth:`prepare`, on a
    thread: reserving and faulting in the staging share takes time. The tier that keeps records
    in host memory makes it, with its own share and the RAM tier over it
    (:meth:`~kvswap.backends.base.Backend.make_arena`); without one, staging makes a plain one.
    The arena it replaces is retired: it hands out nothing more, and its memory is unmapped when
    its last held slot is released (at once if none is), not left to the cyclic GC. Slots are
    taken and released on the event loop; the RAM-tier share is faulted in on a background
    thread as it fills.
    """

    def __init__(self, write_bytes: int, read_bytes: int, backends: Iterable[Backend], metrics: Metrics,
                 threads: DataThreads | None = None) -> None:
        self.write_bytes = write_bytes
        self.read_bytes = read_bytes
        self.backends = list(backends)
        self.metrics = metrics
        #: The daemon's pools (the fault-in runs on ``threads.fault``); without them (a staging
        #: made alone, in tests) the arena is faulted in only as slots are first taken.
        self.threads = threads
        self.arena: HostArena | None = None
        self.write: ArenaWindow | None = None
        self.read: ArenaWindow | None = None
        # Created on first use, on the loop: swap_ins waiting for read slots wait on it.
        self._read_freed: asyncio.Condition | None = None
        #: The fault-in in progress, awaited by ``stop``.
        self._background = Background("staging")
        self._growing = False
        #: swap_outs waiting for write slots, first come first served (wait_write).
        self._write_waiters: collections.deque[_WriteWaiter] = collections.deque()
        #: Waits for write slots: started, served, refused at the cap, ended by the deadline
        #: (or the registration's release) before slots were free.
        self.write_waits = {"waited": 0, "served": 0, "refused": 0, "timed_out": 0}

    @property
    def pools(self) -> list[ArenaWindow]:
        return [p for p in (self.write, self.read) if p is not None]

    def prepare(self, record_bytes: int) -> None:
        """An arena of ``record_bytes`` slots (blocking: run on a thread)."""
        if self.arena is not None and self.arena.record_bytes == record_bytes:
            return
        slot_bytes = round_up_to_page(record_bytes)
        writes = max(1, self.write_bytes // slot_bytes)
        reads = max(1, self.read_bytes // slot_bytes)
        arena = self._make_arena(record_bytes, writes + reads)
        write, read = ArenaWindow(arena, "write", writes), ArenaWindow(arena, "read", reads)
        self._register_with_tiers(arena)
        old, self.arena, self.write, self.read = self.arena, arena, write, read
        self.metrics.staging_slots.clear()
        for window in (write, read):
            free, used = _reading(window)
            self.metrics.staging_slots.labels(pool=window.name, state="free").set_function(free)
            self.metrics.staging_slots.labels(pool=window.name, state="used").set_function(used)
        if old is not None:
            old.retire()  # unmapped now, or when the writes and reads holding its slots release them

    def _make_arena(self, record_bytes: int, staging_slots: int) -> HostArena:
        """The RAM tier's arena (staging's share and its own) where there is one, else staging's."""
        for backend in self.backends:
            arena = backend.make_arena(record_bytes, staging_slots)
            if arena is not None:
                return arena
        return HostArena(record_bytes, staging_slots)

    def _grow(self) -> None:
        """Fault in the rest of the arena's RAM-tier share in the background once the free
        slots run low (on the loop; the faulting itself runs on a low-priority thread)."""
        arena = self.arena
        if arena is None or self.threads is None or self._growing or not arena.wants_growth():
            return
        self._growing = True
        self._background.spawn(self._grow_all(arena, self.threads), "faulting in the host pool")

    async def _grow_all(self, arena: HostArena, threads: DataThreads) -> None:
        try:
            await run(threads.fault, arena.grow_all)
        except Exception as exc:
            log.error("faulting in the host pool failed: %s", exc)
        finally:
            self._growing = False
            self.writes_released()  # more of the arena is free

    async def stop(self) -> None:
        """End the fault-in after its current step and wait for it (its thread touches the
        arena: not cancelled)."""
        if self.arena is not None:
            self.arena.stop_growing()
        await self._background.stop()

    def pin(self, mover: Mover) -> None:
        """Page-lock the arena's memory for a GPU mover now, not on the first swap (blocking)."""
        if self.arena is not None:
            mover.pin_host(self.arena.memory)

    def _register_with_tiers(self, arena: HostArena) -> None:
        """Tiers that can transfer straight from registered memory (Mooncake) get the arena's
        memory, so records move without an extra copy."""
        for backend in self.backends:
            try:
                backend.register_buffer(arena.memory)
            except Exception as exc:  # zero-copy is an optimisation; copying still works
                log.warning("cannot register staging with the %s tier: %s", backend.tier, exc)
                continue
            unregister = getattr(backend, "unregister_buffer", None)
            if unregister is not None:  # it keeps the arena referenced (and registered) until told
                arena.before_unmap.append(unregister)

    # -- slots ----------------------------------------------------------------------------------

    def take_write(self, count: int, partial: bool, pending_writes: int) -> list[Slot]:
        """``count`` write slots now; with ``partial``, as many as are free. Raises ``TooLarge``
        when ``count`` can never fit, ``Busy`` when it does not fit now. Slots the first waiter
        (:meth:`wait_write`) still needs are not free to it: nobody overtakes the queue's head."""
        pool = self._write_pool(count, partial)
        room = self._write_room()
        slots = pool.try_take(count) if count <= room else None
        if slots is None and partial:
            slots = (pool.try_take(min(count, room)) if room > 0 else None) or []
        if slots is None:
            self.metrics.write_failures.labels(code="busy").inc(count)
            self._grow()
            raise Busy("write staging is full; retry after pending writes finish", needed=count, free=pool.free,
                       pending_writes=pending_writes, waiting=len(self._write_waiters))
        self._grow()
        return slots

    async def wait_write(self, count: int, until: float, pending_writes: int,
                         stopped: Callable[[], KvswapError | None]) -> tuple[list[Slot], bool]:
        """``count`` write slots for a swap_out that waits for room (``wait="persisted"``): at
        once when there is room and nobody waits; else in a queue of at most
        MAX_WRITE_WAITERS, first come first served, until ``until`` (``time.monotonic``).
        Returns the slots and whether it waited.

        First come first served, whatever the counts: the queue's head takes the first slots
        freed until it has all it asked for, and nobody behind it (or a swap_out that does not
        wait) takes slots it still needs, so a big request is never starved by small ones; the
        price is that small ones wait behind a big one. Raises ``TooLarge`` when ``count`` can
        never fit, ``Busy`` when the queue is full (as without waiting), ``Timeout`` when
        ``until`` passes first, and whatever ``stopped()`` returns (checked at every wake-up:
        the registration was released, the request was answered) — with no slot taken."""
        pool = self._write_pool(count, partial=False)
        if not self._write_waiters:
            slots = pool.try_take(count)
            if slots is not None:
                self._grow()
                return slots, False
        if len(self._write_waiters) >= MAX_WRITE_WAITERS:
            self.write_waits["refused"] += 1
            self.metrics.write_failures.labels(code="busy").inc(count)
            raise Busy("write staging is full and the swap_outs waiting for it are at their limit; retry after "
                       "pending writes finish", needed=count, free=pool.free, pending_writes=pending_writes,
                       waiting=len(self._write_waiters), limit=MAX_WRITE_WAITERS)
        waiter = _WriteWaiter(count, asyncio.get_running_loop().create_future())
        self._write_waiters.append(waiter)
        self.write_waits["waited"] += 1
        started = time.monotonic()
        served = False
        self._grow()
        try:
            while True:
                self._serve_writers()
                if waiter.slots.done():
                    self.write_waits["served"] += 1
                    served = True
                    return waiter.slots.result(), True
                failure = stopped()
                left = until - time.monotonic()
                if failure is None and left <= 0:
                    failure = Timeout("deadline passed while waiting for write staging", needed=count,
                                      waited_ms=round((time.monotonic() - started) * 1000))
                if failure is not None:
                    self.write_waits["timed_out"] += 1
                    raise failure
                await asyncio.wait({waiter.slots}, timeout=min(left, WRITE_WAIT_POLL_S))
        finally:
            if not waiter.slots.done():
                waiter.slots.cancel()
            elif not served:  # handed slots as it was leaving (cancelled meanwhile): give them back
                for slot in waiter.slots.result():
                    slot.release()
            try:
                self._write_waiters.remove(waiter)
            except ValueError:
                pass  # served: the queue let go of it
            self._serve_writers()  # the next one may fit now

    def _write_pool(self, count: int, partial: bool) -> ArenaWindow:
        """The write pool, once ``count`` slots are known to fit it some day (``TooLarge`` if
        not; with ``partial``, what fits is taken)."""
        pool = self.write
        assert pool is not None, "Staging.prepare() was not called"
        if count > pool.capacity and not partial:
            raise TooLarge(f"swap_out of {count} new blocks exceeds the write staging of {pool.capacity} records",
                           blocks=count, limit=pool.capacity)
        return pool

    def _write_room(self) -> int:
        """Write slots a swap_out that does not wait may take: the free ones less what the
        queue's head still needs."""
        assert self.write is not None
        head = self._write_waiters[0].count if self._write_waiters else 0
        return max(0, self.write.free - head)

    def _serve_writers(self) -> None:
        """Hand free write slots to the waiters, in order, while the first fits."""
        pool = self.write
        while self._write_waiters and pool is not None:
            head = self._write_waiters[0]
            if head.slots.done():  # given up (its deadline, a release): it leaves on its own
                self._write_waiters.popleft()
                continue
            slots = pool.try_take(head.count)
            if slots is None:
                return
            head.slots.set_result(slots)
            self._write_waiters.popleft()

    def writes_released(self) -> None:
        """Write slots were let go of (a write ended): wake the waiters they fit."""
        if self._write_waiters:
            self._serve_writers()

    @property
    def read_wave(self) -> int:
        """The most read slots one wait should ask for: half the pool, so concurrent swap_ins
        share it (each takes its wave at once, so none holds part and waits for more)."""
        assert self.read is not None, "Staging.prepare() was not called"
        return max(1, self.read.capacity // 2)

    async def take_read(self, count: int) -> list[Slot]:
        """``count`` read slots, waiting until that many are free (``count`` <= the pool)."""
        pool = self.read
        assert pool is not None, "Staging.prepare() was not called"
        if count == 0:
            return []
        freed = self._freed()
        async with freed:
            while True:
                taken = pool.try_take(count)
                if taken is not None:
                    return taken
                await freed.wait()

    async def release(self, slots: Iterable[HeldRecord]) -> None:
        """Let go of slots (write, read, or held by a RAM hit) and wake swap_ins waiting for
        read slots."""
        for slot in slots:
            slot.release()
        self.writes_released()  # a swap_in may have held a write's slot: the last holder frees it
        freed = self._freed()
        async with freed:
            freed.notify_all()

    def _freed(self) -> asyncio.Condition:
        if self._read_freed is None:
            self._read_freed = asyncio.Condition()
        return self._read_freed

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{w.name}_staging": {"slots": w.capacity, "free": w.free, "slot_bytes": w.slot_bytes}
                               for w in self.pools}
        out["write_waiting"] = {"now": len(self._write_waiters), **self.write_waits}
        if self.arena is not None:
            out["host_pool"] = {"slots": self.arena.capacity, "faulted": self.arena.faulted,
                                "available": self.arena.available, "slot_bytes": self.arena.slot_bytes,
                                "growing": self._growing}
        return out


def _reading(window: ArenaWindow) -> tuple[Callable[[], float], Callable[[], float]]:
    """Gauge callbacks for a window's free and used slot counts."""
    return (lambda: window.free), (lambda: window.in_use)
