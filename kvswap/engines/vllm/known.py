"""What the scheduler knows kvswap holds, without asking: the keys this engine saved, loaded,
or was told of by a lookup, most recent last, forgotten when a load or a save of them fails.

A new request whose stored prefix is known here is answered at once (no round trip, no
scheduler step waiting for a reply): in multi-turn traffic every turn's history was saved by
the engine that served the turn before. The view can be stale (the daemon evicted a record,
or restarted without its files), and then the load of those blocks fails and vLLM recomputes
them (the load-error path): a stale view costs a recompute, never a wrong token. Keys it does
not know go to the daemons (:mod:`.lookups`).

Bounded: at most ``capacity`` keys (least recently touched go first), about 200 bytes each.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

#: Keys remembered by default: 100k blocks, ~3M tokens at 32 a block, ~20 MB.
DEFAULT_CAPACITY = 100_000


class KnownKeys:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys.pop(key, None)

    def prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first on, are known stored (and touch them)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            self._keys.move_to_end(key)
            n += 1
        return n
