"""Which engine's cache the daemon serves: registering it, handing out leases on it, and
releasing it (unregister, replacement, engine death, shutdown).

A request that touches the engine's memory holds a :class:`~.registration.Lease` on the
registration it was validated against, from validation to its last copy. Releasing a
registration marks it closing (no new leases), waits for the leases held, then unmaps.

The stores of each namespace opened so far are kept here too: a restarting engine of the
same layout finds its index warm.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence, TypeVar

from kvswap.backends.base import Backend, Store
from kvswap.protocol.errors import NotRegistered

from .metrics import Metrics
from .registration import Lease, Registration
from .staging import Staging
from .tiers import Locations, NamespaceTiers

log = logging.getLogger(__name__)
T = TypeVar("T")


class Registrar:
    def __init__(self, backends: dict[str, Backend], locations: Locations, staging: Staging, metrics: Metrics) -> None:
        self.backends = backends
        self.locations = locations
        self.staging = staging
        self.metrics = metrics
        self.current: Registration | None = None
        #: Stores per namespace; see the module doc.
        self.namespaces: dict[str, NamespaceTiers] = {}
        #: Called with each store when its namespace is first opened (the upkeep's scan).
        self.on_open_store: Callable[[Store], None] = lambda store: None
        self._pool: ThreadPoolExecutor | None = None
        self._lock: asyncio.Lock | None = None

    def start(self) -> None:
        # Mapping an engine's memory, opening stores and making staging take time; they run
        # here, one registration at a time, never on the loop or the copy thread.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvswap-register")

    async def stop(self) -> None:
        if self.current is not None:
            await self.release(self.current, "shutdown")
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)

    def close_stores(self) -> None:
        """Close every namespace's stores (after the writes to them have finished)."""
        for tiers in self.namespaces.values():
            tiers.close()
        self.namespaces.clear()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._pool is not None, "Registrar.start() was not called"
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def _serialised(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def open_stores(self) -> Iterator[Store]:
        for tiers in list(self.namespaces.values()):
            yield from tiers

    # -- register and release -------------------------------------------------------------------

    async def register(self, layout: dict[str, Any], handles: Sequence[dict], regions: Sequence[dict],
                       pid: int) -> dict[str, Any]:
        async with self._serialised():
            registration = await self._run(Registration.attach, layout, handles, regions, pid)
            try:
                tiers = self.namespaces.get(registration.namespace)
                if tiers is None:
                    tiers = await self._run(self._open_namespace, registration)
                    self.namespaces[registration.namespace] = tiers
                    for store in tiers:
                        self.on_open_store(store)
                await self._run(self.staging.prepare, registration.record_bytes)
                await self._run(self.staging.pin, registration.mover)
            except BaseException:
                registration.close()
                raise
            if self.current is not None:
                await self._release(self.current, "replaced")
            registration.tiers = tiers
            self.current = registration
            # One namespace at a time: another layout's stores give up their eviction lock (so
            # a daemon still registered for it can take over) and their metrics. Writes still
            # in flight keep their own reference and finish.
            for namespace in [ns for ns in self.namespaces if ns != registration.namespace]:
                self.namespaces.pop(namespace).close()
        self.metrics.registered.set(1)
        self.metrics.registrations.labels(event="registered").inc()
        log.info("registered namespace %s for pid %d: %d regions, %d blocks of %d bytes", registration.namespace,
                 pid, len(registration.placements), registration.layout.num_blocks, registration.record_bytes)
        assert self.staging.write is not None
        return {"namespace": registration.namespace, "record_bytes": registration.record_bytes,
                "write_slots": self.staging.write.capacity}

    def _open_namespace(self, registration: Registration) -> NamespaceTiers:
        stores = {tier: backend.open_store(registration.namespace, registration.layout.to_wire(),
                                           registration.record_bytes)
                  for tier, backend in self.backends.items()}
        return NamespaceTiers(stores, self.locations, self.metrics)

    async def unregister(self) -> bool:
        async with self._serialised():
            if self.current is None:
                return False
            await self._release(self.current, "unregistered")
            return True

    async def release(self, registration: Registration, reason: str) -> bool:
        """Release ``registration`` if it is still the current one (engine death, shutdown)."""
        async with self._serialised():
            if self.current is not registration:
                return False
            await self._release(registration, reason)
            return True

    async def _release(self, registration: Registration, reason: str) -> None:
        """Stop using the engine's memory: refuse new leases, wait for the requests holding
        one, then unmap. Records already copied to staging are still written."""
        if self.current is registration:
            self.current = None
        await registration.drain()
        await self._run(registration.close)
        # Reported after the unmap, so a watcher that sees 0 knows the memory is let go.
        self.metrics.registered.set(0)
        self.metrics.registrations.labels(event=reason).inc()
        log.info("released registration of namespace %s (pid %d): %s", registration.namespace, registration.pid,
                 reason)

    # -- leases -----------------------------------------------------------------------------------

    def lease(self) -> Lease:
        """A lease on the current registration, for a request about to use it."""
        registration = self.current
        if registration is None:
            raise NotRegistered("no cache is registered; send register first")
        return registration.lease()
