"""Background upkeep: index scans of newly opened stores, storage maintenance (eviction,
leadership, rescans), health probes of the tiers, and the check that the registered engine
is still alive.

Each runs on a thread pool of its own kind (:class:`~.data_threads.DataThreads`), so a slow
one never holds up another: a directory scan can take seconds, a remote probe can block for a
connect timeout, and neither may delay eviction or the swap pipeline. Scans and probes nobody
waits for are this object's background work (:class:`~.background.Background`), awaited by
``stop``.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from kvswap.backends.base import Backend, Store

from .background import Background
from .data_threads import DataThreads, run
from .registration import Registration

log = logging.getLogger(__name__)


class Upkeep:
    def __init__(self, backends: Iterable[Backend], threads: DataThreads, health_interval_s: float) -> None:
        self.backends = list(backends)
        self.threads = threads
        self.health_interval_s = health_interval_s
        self._last_health_check = 0.0
        self._background = Background("upkeep")

    async def stop(self) -> None:
        """Wait for the scans and probes started (each is on a thread: none is cancelled)."""
        await self._background.stop()

    def start_scan(self, store: Store) -> None:
        """Index a newly opened store in the background (stores without an index find 0)."""
        self._background.spawn(self._scan(store), f"index scan of {store.tier}")

    async def _scan(self, store: Store) -> None:
        try:
            found = await run(self.threads.maintain, store.scan)
        except Exception as exc:
            log.error("index scan of %s failed: %s", store.tier, exc)
        else:
            log.info("index scan of %s found %d records", store.tier, found)

    async def maintain(self, stores: Iterable[Store]) -> None:
        """Storage upkeep for every open store, and a health probe of every tier each
        ``health_interval_s``: an unhealthy tier recovers even when no request touches it."""
        now = time.monotonic()
        if now - self._last_health_check >= self.health_interval_s:
            self._last_health_check = now
            for backend in self.backends:
                self._background.submit(self.threads.health, backend.probe, what=f"probe of {backend.tier}")
        for store in stores:
            await run(self.threads.maintain, store.maintain)

    async def engine_alive(self, registration: Registration) -> bool:
        """Whether the registered engine's process still runs (asked on the liveness thread)."""
        return await run(self.threads.liveness, registration.engine_alive)
