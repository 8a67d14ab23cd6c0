"""A wake-up for code waiting for records to arrive: lookups with ``wait_ms`` and peer exports
waiting for a prefill's swap_out (peer_records.py). One event per generation: ``notify`` wakes
every waiter of the current one, and the next ``wait`` starts a new one. Event loop only.

Every waiter looks at the tiers again at each wake-up, so waiters cost loop time per arriving
record; at most MAX_WAITERS wait at once (:meth:`join`), whoever sends them: one more is told
to look once and answer, as at the end of its wait.
"""

from __future__ import annotations

import asyncio

#: Requests waiting for records at once, at most (lookups with wait_ms and peer exports).
MAX_WAITERS = 64


class Arrivals:
    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self.waiters = 0
        #: Waits refused because MAX_WAITERS were waiting (answered without waiting).
        self.refused = 0

    def join(self) -> bool:
        """Become a waiter (then :meth:`leave` when done); False when MAX_WAITERS are."""
        if self.waiters >= MAX_WAITERS:
            self.refused += 1
            return False
        self.waiters += 1
        return True

    def leave(self) -> None:
        self.waiters -= 1

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float) -> bool:
        """Until the next ``notify`` or ``timeout`` seconds; True when notified."""
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            return False
        return True
