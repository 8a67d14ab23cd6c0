"""A wake-up for code waiting for records to arrive: lookups with ``wait_ms`` and peer exports
waiting for a prefill's swap_out (peer_records.py). One event per generation: ``notify`` wakes
every waiter of the current one, and the next ``wait`` starts a new one. Event loop only."""

from __future__ import annotations

import asyncio


class Arrivals:
    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

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
