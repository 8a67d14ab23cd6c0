"""Bounded staging memory: fixed-size slots, one record each, carved from one arena.

Every byte a swap moves passes through a slot, so the slot count is the daemon's memory
bound: when none are free, swap_out answers ``busy`` rather than allocating more. Slots are
4 KiB aligned so direct I/O can use them, and the arena is touched once at creation, so no
page fault lands on the swap path.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from kvswap.backends.disk import aligned_empty
from kvswap.protocol.units import PAGE_BYTES, round_up_to_page

__all__ = ["Slot", "StagingPool", "aligned_empty", "slot_bytes_for"]


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
