"""Bounded staging memory: fixed-size slots, one record each, in the daemon's host arena.

Every byte a swap moves passes through a slot, so the slot count is the daemon's memory
bound: when none are free, swap_out answers ``busy`` rather than allocating more. Slots are
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
import logging
from typing import Any, Callable, Iterable

import numpy as np

from kvswap.backends.base import Backend, HeldRecord
from kvswap.backends.disk import aligned_empty
from kvswap.backends.host_arena import ArenaSlot as Slot
from kvswap.backends.host_arena import ArenaWindow, HostArena
from kvswap.protocol.errors import Busy, TooLarge
from kvswap.common.units import round_up_to_page

from .background import Background
from .data_threads import DataThreads, run
from .metrics import Metrics
from .movers.base import Mover

__all__ = ["Slot", "Staging", "StagingPool", "aligned_empty"]

log = logging.getLogger(__name__)


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
        """``count`` write slots; with ``partial``, as many as are free. Raises ``TooLarge``
        when ``count`` can never fit, ``Busy`` when it does not fit now."""
        pool = self.write
        assert pool is not None, "Staging.prepare() was not called"
        if count > pool.capacity and not partial:
            raise TooLarge(f"swap_out of {count} new blocks exceeds the write staging of {pool.capacity} records",
                           blocks=count, limit=pool.capacity)
        slots = pool.try_take(count)
        if slots is None and partial:
            slots = pool.try_take(min(count, pool.free)) or []
        if slots is None:
            self.metrics.write_failures.labels(code="busy").inc(count)
            self._grow()
            raise Busy("write staging is full; retry after pending writes finish", needed=count, free=pool.free,
                       pending_writes=pending_writes)
        self._grow()
        return slots

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
        if self.arena is not None:
            out["host_pool"] = {"slots": self.arena.capacity, "faulted": self.arena.faulted,
                                "available": self.arena.available, "slot_bytes": self.arena.slot_bytes,
                                "growing": self._growing}
        return out


def _reading(window: ArenaWindow) -> tuple[Callable[[], float], Callable[[], float]]:
    """Gauge callbacks for a window's free and used slot counts."""
    return (lambda: window.free), (lambda: window.in_use)
