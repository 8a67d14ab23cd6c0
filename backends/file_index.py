"""The file tier's in-memory index: which records exist, how many bytes they take, their
recency and chain links (:class:`~.chains.ChainOrder`, the eviction rule), and which are pinned
by a read in progress.

Pure bookkeeping, thread-safe, no I/O: the store decides what to do, the index remembers.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterable, Protocol, Sequence

from .chains import ChainOrder


class IndexWatcher(Protocol):
    """Told every change of which names are indexed, under the index's lock (so in order)."""

    def entered(self, names: Sequence[str], key: str | None = None) -> None:
        """``names`` are indexed now; ``key`` is the one name's key where the caller knows it."""

    def left(self, names: Sequence[str]) -> None: ...

    def emptied(self) -> None: ...


class RecordIndex:
    """``name -> bytes on disk``, with the order records are evicted in."""

    def __init__(self, policy: str = "chain") -> None:
        self._sizes: dict[str, int] = {}
        self._order: ChainOrder[str] = ChainOrder(policy)
        self._pins: Counter[str] = Counter()
        #: Records that could not be deleted: still on disk (their bytes count), never offered
        #: for eviction again, so one bad file cannot wedge eviction.
        self._stuck: dict[str, int] = {}
        self._lock = threading.Lock()
        self._bytes = 0
        self._watcher: IndexWatcher | None = None

    def watch(self, watcher: IndexWatcher) -> None:
        with self._lock:
            self._watcher = watcher

    # -- membership ----------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._sizes or name in self._stuck

    def __len__(self) -> int:
        return len(self._sizes) + len(self._stuck)

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, name: str, size: int, stamp: int | None = None, key: str | None = None) -> bool:
        """Record ``name`` as stored and just used (a write or a read), with ``stamp`` if given
        (the mtime its file was given); ``key`` is for the watcher. Returns False when it is
        stranded: its predecessor is known to be gone, so no lookup can reach it and the caller
        should drop it."""
        with self._lock:
            if self._watcher is not None and name not in self._sizes and name not in self._stuck:
                self._watcher.entered((name,), key)
            self._set(name, size)
            self._order.add(name, stamp)
            return not self._order.is_stranded(name)

    def stamp(self, name: str) -> int | None:
        """``name``'s recency stamp, None when it is not indexed."""
        with self._lock:
            return self._order.stamp(name)

    def touch(self, name: str) -> bool:
        with self._lock:
            if name in self._sizes:
                self._order.add(name)
                return True
            return name in self._stuck

    def present_prefix(self, names: Sequence[str], also_present: Callable[[int], bool] = lambda i: False) -> int:
        """How many leading names are indexed, or held by the caller (``also_present(i)``: a
        record still being written). Touches nothing: a hit prefix is touched as a whole, by
        :meth:`touch_chain`. On the loop, for every lookup: one C-level pass (``map`` of the
        dict's membership test), Python only from the first name not stored on, and without the
        lock, as RamTier.present_prefix: the write threads take it for every record, and a loop
        that waited for it waited for their GIL hand-offs too. A lookup is a snapshot either way;
        each membership test is atomic under the GIL, and the pass over the names runs in C
        without letting go of it."""
        found = list(map(self._sizes.__contains__, names))
        i = 0
        while True:
            try:
                i = found.index(False, i)
            except ValueError:
                return len(names)
            if names[i] not in self._stuck and not also_present(i):
                return i
            i += 1

    def touch_chain(self, names: Sequence[str], reserve: bool = False) -> list[tuple[str, int]]:
        """See :meth:`ChainOrder.chain`: learn the links, stamp the chain head newest; with
        ``reserve`` the records not yet stored keep their stamps for their writes. Returns the
        stored records touched, with their stamps."""
        with self._lock:
            return self._order.chain(names, reserve)

    def stamp_for_write(self, name: str) -> tuple[bool, int]:
        """Before writing ``name``: (whether it is worth writing, the stamp to give its file).
        Not worth it when a swap_out named it and its predecessor is gone: stored, it would be
        a record no lookup reaches."""
        with self._lock:
            if self._order.orphaned(name):
                self._order.release(name)
                return False, 0
            return True, self._order.upcoming_stamp(name)

    def release(self, name: str) -> None:
        """A write ``name`` was reserved for failed."""
        with self._lock:
            self._order.release(name)

    def merge_scanned(self, found: Iterable[tuple[str, int, int]]) -> int:
        """Merge ``(name, size, last_used_ns)`` found on disk. Records already known keep their
        place (they were used since the scan began); the others go before them, in their mtime
        order. Returns how many were new."""
        with self._lock:
            new = [(name, size, mtime) for name, size, mtime in found
                   if name not in self._sizes and name not in self._stuck]
            for name, size, _ in new:
                self._set(name, size)
            if self._watcher is not None and new:
                self._watcher.entered([name for name, _, _ in new])
            return self._order.merge_older((name, mtime) for name, _, mtime in new)

    def load(self, names: Sequence[str], size: int, stamps: Sequence[int]) -> None:
        """A start-up load of records all ``size`` bytes (the slab layout's journals), whole:
        into an empty index, without merging name by name; otherwise :meth:`merge_scanned`."""
        with self._lock:
            if self._sizes or self._stuck:
                empty = False
            else:
                empty = True
                self._sizes = dict.fromkeys(names, size)
                self._bytes = size * len(self._sizes)
                self._order.merge_older(zip(names, stamps))
                if self._watcher is not None and names:
                    self._watcher.entered(names)
        if not empty:
            self.merge_scanned((name, size, stamp) for name, stamp in zip(names, stamps))

    def replace_all(self, found: Iterable[tuple[str, int, int]]) -> None:
        """Make the index exactly what a fresh directory listing says (records other writers
        added appear, records others removed go), keeping known recency where it exists.
        Records whose predecessor another writer removed become stranded, evicted first."""
        found = list(found)
        names = {name for name, _, _ in found}
        with self._lock:
            gone = [n for n in self._sizes if n not in names]
            for name in gone:
                self._bytes -= self._sizes.pop(name)
                self._order.remove(name)
            stuck_gone = [n for n in self._stuck if n not in names]
            for name in stuck_gone:
                self._bytes -= self._stuck.pop(name)
            if self._watcher is not None and (gone or stuck_gone):
                self._watcher.left(gone + stuck_gone)
        self.merge_scanned(found)

    def remove(self, name: str) -> int | None:
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is not None:
                self._order.remove(name)
            else:
                size = self._stuck.pop(name, None)
            if size is not None:
                self._bytes -= size
                if self._watcher is not None:
                    self._watcher.left((name,))
            return size

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._order.clear()
            self._stuck.clear()
            self._bytes = 0
            if self._watcher is not None:
                self._watcher.emptied()

    # -- pins and eviction ------------------------------------------------------------------------

    def pin(self, name: str) -> None:
        with self._lock:
            self._pins[name] += 1

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pins[name] -= 1
            if self._pins[name] <= 0:
                del self._pins[name]

    def take_victim(self) -> tuple[str, int] | None:
        """Remove and return the next record to evict (:meth:`ChainOrder.victim`: stranded
        records first, then the least recently used record no other follows), skipping pinned
        ones; or None. The caller deletes the file; if that fails it calls :meth:`mark_stuck`."""
        return self._take(self._order.victim)

    def take_stranded(self) -> tuple[str, int] | None:
        """Remove and return one unpinned stranded record (its chain lost a record before it),
        or None: never a reachable one. Costs the stranded records, not the index's size."""
        return self._take(self._order.stranded_victim)

    def _take(self, choose) -> tuple[str, int] | None:
        with self._lock:
            name = choose(skip=self._pinned)
            if name is None:
                return None
            self._order.remove(name)
            size = self._sizes.pop(name)
            self._bytes -= size
            if self._watcher is not None:
                self._watcher.left((name,))
            return name, size

    def _pinned(self, name: str) -> bool:
        return bool(self._pins.get(name))

    def mark_stuck(self, name: str, size: int) -> None:
        with self._lock:
            if name not in self._stuck:
                if self._watcher is not None and name not in self._sizes:
                    self._watcher.entered((name,))  # taken as a victim, but its file is still there
                self._stuck[name] = size
                self._bytes += size

    @property
    def stuck(self) -> int:
        return len(self._stuck)

    def unreachable(self) -> int:
        """Indexed records no lookup can reach (their chain lost a record before them)."""
        with self._lock:
            return self._order.unreachable()

    def _set(self, name: str, size: int) -> None:
        old = self._sizes.get(name)
        self._sizes[name] = size
        self._bytes += size - (old or 0)
