"""Memory for records in transit between daemons: one fixed buffer cut into record-sized slots.

An exporter copies the records a peer asked for into slots of its buffer and holds them there
under a lease until the peer has read them (peer_export.py); an importer reads a peer's records
into slots of its own buffer and verifies them there before they are stored (peer_import.py).
The buffer is allocated once, at its full size (``--peer-export-bytes``), so it can be
registered with the transfer engine once and what peers can make a daemon hold is that size
and no more. Its pages are untouched until first used (``np.zeros`` maps zero pages lazily).

Slots have one size at a time, a record's rounded up to a page: the size is set by the first
take and changed only while no slot is in use (a daemon serves one layout at a time). Taken and
given back on the event loop only, so no lock: threads see only addresses and views.

Example: a 1 MiB buffer and records of 100,000 bytes make slots of 102,400 bytes (25 pages),
10 of them; ``take(4, 100_000)`` returns offsets ``[0, 102400, 204800, 307200]``.
"""

from __future__ import annotations

import numpy as np

from kvswap.common.units import round_up_to_page


class TransitBuffer:
    def __init__(self, nbytes: int) -> None:
        self.memory = np.zeros(nbytes, dtype=np.uint8)
        self.slot_bytes = 0
        self._free: list[int] = []
        self._used = 0

    @property
    def address(self) -> int:
        return int(self.memory.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.memory.nbytes)

    @property
    def used_bytes(self) -> int:
        return self._used * self.slot_bytes

    def capacity(self, record_bytes: int) -> int:
        """Slots a buffer of this size has for records of ``record_bytes``."""
        return self.nbytes // round_up_to_page(record_bytes)

    def take(self, count: int, record_bytes: int) -> list[int]:
        """Up to ``count`` free slots for records of ``record_bytes`` (offsets into the buffer);
        fewer, maybe none, when the buffer is short, or holds slots of another size."""
        size = round_up_to_page(record_bytes)
        if size != self.slot_bytes:
            if self._used:
                return []  # records of the last layout are still held; they go at release or expiry
            self.slot_bytes = size
            self._free = list(range((self.nbytes // size - 1) * size, -1, -size))
        taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
        self._used += len(taken)
        return taken

    def give(self, offsets: list[int]) -> None:
        self._free.extend(reversed(offsets))
        self._used -= len(offsets)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.memory[offset:offset + nbytes]
