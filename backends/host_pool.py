"""Old names of the host arena and the RAM tier, kept while code outside this package's owners
still imports them (``daemon/tools/bench.py``: ``HostPool`` as a plain arena;
``benchmarks/prefix_replay.py``: a RAM tier over a pool with an eviction order). New code uses
:mod:`.host_arena` (the memory) and :mod:`.ram_tier` (the records kept in it), where a tier is
made with its arena; this module goes once those two callers have moved.
"""

from __future__ import annotations

from .host_arena import ArenaSlot as PoolSlot
from .host_arena import ArenaWindow as PoolWindow
from .host_arena import HostArena
from .ram_tier import HostBackend, RamTier

__all__ = ["HostPool", "HostPoolBackend", "PoolSlot", "PoolWindow"]


class HostPool(HostArena):
    """An arena that remembers the eviction order its RAM tier is to use."""

    def __init__(self, record_bytes: int, staging_slots: int, cache_slots: int = 0, eviction: str = "chain") -> None:
        super().__init__(record_bytes, staging_slots, cache_slots)
        self.eviction = eviction


class HostPoolBackend(HostBackend):
    """The RAM tier's root, given its arena after it was made (the old order of things)."""

    def attach(self, pool: HostArena) -> None:
        self._ram = RamTier(pool, getattr(pool, "eviction", self.eviction))
