"""Background upkeep: index scans of newly opened stores, storage maintenance (eviction,
leadership, rescans), health probes of the tiers, and the check that the registered engine
is still alive.

Each runs on a thread of its own kind, so a slow one never holds up another: a directory
scan can take seconds, a remote probe can block for a connect timeout, and neither may delay
eviction or the swap pipeline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, TypeVar

from kvswap.backends.base import Backend, Store

from .data_threads import data_pool
from .registrar import Registrar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Upkeep:
    def __init__(self, backends: Iterable[Backend], registrar: Registrar, health_interval_s: float,
                 data_thread_nice: int = 0) -> None:
        self.backends = list(backends)
        self.data_thread_nice = data_thread_nice
        self.registrar = registrar
        self.health_interval_s = health_interval_s
        self._last_health_check = 0.0
        self._maintenance_pool: ThreadPoolExecutor | None = None
        self._health_pool: ThreadPoolExecutor | None = None
        self._liveness_pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        # Scans and eviction can take seconds on big directories; they get their own thread.
        # Below the loop's priority, like the other data threads (see data_threads.py).
        self._maintenance_pool = data_pool(1, "kvswap-maintain", self.data_thread_nice)
        # Remote health probes can block for a connect timeout; they must not hold up eviction.
        self._health_pool = ThreadPoolExecutor(1, thread_name_prefix="kvswap-health")
        self._liveness_pool = ThreadPoolExecutor(1, thread_name_prefix="kvswap-liveness")

    def stop(self) -> None:
        for pool in (self._maintenance_pool, self._health_pool, self._liveness_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=False)

    async def _run(self, pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> T:
        assert pool is not None, "Upkeep.start() was not called"
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    def start_scan(self, store: Store) -> None:
        """Index a newly opened store in the background (stores without an index find 0)."""

        def done(fut: asyncio.Future) -> None:
            if fut.exception() is not None:
                log.error("index scan of %s failed: %s", store.tier, fut.exception())
            else:
                log.info("index scan of %s found %d records", store.tier, fut.result())

        asyncio.ensure_future(self._run(self._maintenance_pool, store.scan)).add_done_callback(done)

    async def maintain(self) -> None:
        """Storage upkeep for every open store, and a health probe of every tier each
        ``health_interval_s``: an unhealthy tier recovers even when no request touches it."""
        now = time.monotonic()
        if now - self._last_health_check >= self.health_interval_s:
            self._last_health_check = now
            for backend in self.backends:
                asyncio.ensure_future(self._run(self._health_pool, backend.probe)).add_done_callback(log_failure)
        for store in self.registrar.open_stores():
            await self._run(self._maintenance_pool, store.maintain)

    async def check_engine(self) -> None:
        """Release the registration of an engine whose process is gone."""
        registration = self.registrar.current
        if registration is not None and not await self._run(self._liveness_pool, registration.engine_alive):
            log.warning("engine pid %d is gone; releasing its cache mapping", registration.pid)
            await self.registrar.release(registration, "engine_exited")


def log_failure(fut: "asyncio.Future[Any] | concurrent.futures.Future[Any]") -> None:
    """Done-callback of background work (probes, chain touches): a failure is logged, not lost."""
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("background task failed: %s", fut.exception())
