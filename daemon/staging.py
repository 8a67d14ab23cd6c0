"""Bounded staging memory: fixed-size slots, one record each, carved from one arena.

Every byte a swap moves passes through a slot, so the slot count is the daemon's memory
bound: when none are free, swap_out answers ``busy`` rather than allocating more. Slots are
4 KiB aligned so direct I/O can use them, and the arena is touched once at creation, so no
page fault lands on the swap path.

:class:`Staging` is the daemon's staging: a write pool (swap_out) and a read pool (swap_in),
their metrics, their pinning for GPU movers and their registration with tiers that transfer
straight from registered memory. Its interface is slots: take them (all or nothing), hold
them with ``retain``, give them back with ``release``; a slot returns to its pool when its
last holder lets go.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any, Iterable

import numpy as np

from kvswap.backends.base import Backend
from kvswap.backends.disk import aligned_empty
from kvswap.protocol.errors import Busy, TooLarge
from kvswap.protocol.units import PAGE_BYTES, round_up_to_page

from .metrics import Metrics
from .movers.base import Mover

__all__ = ["Slot", "Staging", "StagingPool", "aligned_empty", "slot_bytes_for"]

log = logging.getLogger(__name__)


def slot_bytes_for(record_bytes: int) -> int:
    """Bytes one staging slot takes for a record: whole pages, so every slot starts aligned."""
    return round_up_to_page(record_bytes)


class Slot:
    """One record's staging. ``view`` is exactly ``record_bytes`` long.

    A slot is returned to its pool when its last holder releases it: the swap that took it,
    plus any swap_in that reads a record still being written from it.
    """

    __slots__ = ("pool", "index", "view", "_refs")

    def __init__(self, pool: "StagingPool", index: int, view: np.ndarray) -> None:
        self.pool = pool
        self.index = index
        self.view = view
        self._refs = 0

    def retain(self) -> "Slot":
        with self.pool._lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with self.pool._lock:
            self._refs -= 1
            if self._refs == 0:
                self.pool._free.append(self.index)
            elif self._refs < 0:
                raise RuntimeError("staging slot released twice")


class StagingPool:
    def __init__(self, record_bytes: int, budget_bytes: int, name: str = "staging") -> None:
        self.name = name
        self.record_bytes = record_bytes
        self.slot_bytes = slot_bytes_for(record_bytes)
        self.capacity = max(1, budget_bytes // self.slot_bytes)
        self.arena = aligned_empty(self.capacity * self.slot_bytes)
        self.arena[::PAGE_BYTES] = 0  # fault every page in now, not during a swap
        self._slots = [
            Slot(self, i, self.arena[i * self.slot_bytes : i * self.slot_bytes + record_bytes])
            for i in range(self.capacity)
        ]
        self._free: deque[int] = deque(range(self.capacity))
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def try_take(self, count: int) -> list[Slot] | None:
        """``count`` slots, each held once, or None when fewer are free (all or nothing)."""
        with self._lock:
            if count > len(self._free):
                return None
            taken = [self._slots[self._free.popleft()] for _ in range(count)]
            for slot in taken:
                slot._refs = 1
        return taken

    def close(self) -> None:
        self._slots = []
        self._free.clear()


class Staging:
    """The write and read pools for the registered record size.

    Pools are made (and remade when the record size changes) by :meth:`prepare`, on a thread:
    allocating and faulting in the arenas takes time. Old pools stay alive until their last
    slot is released, then go with them. Slots are taken and released on the event loop.
    """

    def __init__(self, write_bytes: int, read_bytes: int, backends: Iterable[Backend], metrics: Metrics) -> None:
        self.write_bytes = write_bytes
        self.read_bytes = read_bytes
        self.backends = list(backends)
        self.metrics = metrics
        self.write: StagingPool | None = None
        self.read: StagingPool | None = None
        # Created on first use, on the loop: swap_ins waiting for read slots wait on it.
        self._read_freed: asyncio.Condition | None = None

    @property
    def pools(self) -> list[StagingPool]:
        return [p for p in (self.write, self.read) if p is not None]

    def prepare(self, record_bytes: int) -> None:
        """Pools of ``record_bytes`` slots (blocking: run on a thread)."""
        if self.write is not None and self.write.record_bytes == record_bytes:
            return
        write = StagingPool(record_bytes, self.write_bytes, "write")
        read = StagingPool(record_bytes, self.read_bytes, "read")
        self._register_with_tiers(write, read)
        self.write, self.read = write, read
        self.metrics.staging_slots.clear()
        for pool in (write, read):
            self.metrics.staging_slots.labels(pool=pool.name, state="free").set_function(lambda p=pool: p.free)
            self.metrics.staging_slots.labels(pool=pool.name, state="used").set_function(lambda p=pool: p.in_use)

    def pin(self, mover: Mover) -> None:
        """Page-lock both arenas for a GPU mover now, not on the first swap (blocking)."""
        for pool in self.pools:
            mover.pin_host(pool.arena)

    def _register_with_tiers(self, *pools: StagingPool) -> None:
        """Tiers that can transfer straight from registered memory (Mooncake) get the staging
        arenas, so records move without an extra copy."""
        for backend in self.backends:
            for pool in pools:
                try:
                    backend.register_buffer(pool.arena)
                except Exception as exc:  # zero-copy is an optimisation; copying still works
                    log.warning("cannot register staging with the %s tier: %s", backend.tier, exc)

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
            raise Busy("write staging is full; retry after pending writes finish", needed=count, free=pool.free,
                       pending_writes=pending_writes)
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

    async def release(self, slots: Iterable[Slot]) -> None:
        """Let go of slots (write or read) and wake swap_ins waiting for read slots."""
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
        return {f"{pool.name}_staging": {"slots": pool.capacity, "free": pool.free, "slot_bytes": pool.slot_bytes}
                for pool in self.pools}
