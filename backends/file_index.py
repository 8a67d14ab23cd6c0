"""The file tier's in-memory index: which records exist, how many bytes they take, in which
order they were last used, and which are pinned by a read in progress.

Pure bookkeeping, thread-safe, no I/O: the store decides what to do, the index remembers.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Iterable


class RecordIndex:
    """``name -> bytes on disk``, least recently used first."""

    def __init__(self) -> None:
        self._entries: "OrderedDict[str, int]" = OrderedDict()
        self._pins: Counter[str] = Counter()
        #: Records that could not be deleted: still on disk (their bytes count), never offered
        #: for eviction again, so one bad file cannot wedge eviction.
        self._stuck: dict[str, int] = {}
        self._lock = threading.Lock()
        self._bytes = 0

    # -- membership ----------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._stuck

    def __len__(self) -> int:
        return len(self._entries) + len(self._stuck)

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, name: str, size: int) -> None:
        """Record ``name`` as just used (a write or a read)."""
        with self._lock:
            self._set(name, size)
            self._entries.move_to_end(name)

    def touch(self, name: str) -> bool:
        with self._lock:
            if name in self._entries:
                self._entries.move_to_end(name)
                return True
            return name in self._stuck

    def touch_prefix(self, names: Iterable[str | None]) -> int:
        """Touch leading names while they are indexed (None counts as present, untouched);
        return how many. One lock for the whole run."""
        count = 0
        with self._lock:
            for name in names:
                if name is None or name in self._stuck:
                    count += 1
                elif name in self._entries:
                    self._entries.move_to_end(name)
                    count += 1
                else:
                    break
        return count

    def merge_scanned(self, found: Iterable[tuple[str, int, int]]) -> int:
        """Merge ``(name, size, last_used_ns)`` found on disk. Records already known keep their
        place (they were used since the scan began); the others go before them, oldest first.
        Returns how many were new."""
        ordered = sorted(found, key=lambda item: item[2], reverse=True)
        added = 0
        with self._lock:
            for name, size, _ in ordered:
                if name in self._entries or name in self._stuck:
                    continue
                self._set(name, size)
                self._entries.move_to_end(name, last=False)
                added += 1
        return added

    def replace_all(self, found: Iterable[tuple[str, int, int]]) -> None:
        """Make the index exactly what a fresh directory listing says (records other writers
        added appear, records others removed go), keeping known recency where it exists."""
        found = list(found)
        names = {name for name, _, _ in found}
        with self._lock:
            for name in [n for n in self._entries if n not in names]:
                self._bytes -= self._entries.pop(name)
            for name in [n for n in self._stuck if n not in names]:
                self._bytes -= self._stuck.pop(name)
        self.merge_scanned(found)

    def remove(self, name: str) -> int | None:
        with self._lock:
            size = self._entries.pop(name, None)
            if size is None:
                size = self._stuck.pop(name, None)
            if size is not None:
                self._bytes -= size
            return size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._stuck.clear()
            self._bytes = 0

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
        """Remove and return the least recently used unpinned record, or None. The caller
        deletes the file; if that fails it calls :meth:`mark_stuck`."""
        with self._lock:
            for name, size in self._entries.items():
                if not self._pins.get(name):
                    del self._entries[name]
                    self._bytes -= size
                    return name, size
        return None

    def mark_stuck(self, name: str, size: int) -> None:
        with self._lock:
            if name not in self._stuck:
                self._stuck[name] = size
                self._bytes += size

    @property
    def stuck(self) -> int:
        return len(self._stuck)

    def oldest(self, n: int) -> list[str]:
        with self._lock:
            return [name for name, _ in zip(self._entries, range(n))]

    def _set(self, name: str, size: int) -> None:
        old = self._entries.get(name)
        self._entries[name] = size
        self._bytes += size - (old or 0)
