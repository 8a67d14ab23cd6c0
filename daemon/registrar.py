"""Which engine's cache the daemon serves: registering it, handing out leases on it, and
releasing it (unregister, replacement, engine death, a shrunk segment, shutdown).

Ownership (docs/protocol.md, "Registration ownership"): a registration belongs to the engine
process that sent it (``pid``). While that process lives, a ``register`` from another process
is refused with ``registration_held`` naming the holder; the same process registering again
replaces its registration; a holder whose process is gone is released on the spot.

A request that touches the engine's memory says who sends it (the token its client got from
``register``, and its pid) and holds a :class:`~.registration.Lease` on the registration it
was validated against, from validation to its last copy. Releasing a registration marks it
closing (no new leases; copies in progress stop at their next block and answer
``not_registered``), waits for the leases held, then closes the engine's memory.

The stores of each namespace opened so far are kept here too: a restarting engine of the
same layout finds its index warm.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from kvswap.backends.base import Backend, Store
from kvswap.backends.events import NO_EVENTS, RecordEvents
from kvswap.protocol.errors import NotRegistered, RegistrationHeld

from .background import Background
from .data_threads import DataThreads, run
from .metrics import Metrics
from .registration import Lease, Registration
from .staging import Staging
from .tiers import Locations, NamespaceTiers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who sends a request: the registration token its client holds ("" if none) and its
    process id (0 if it did not say)."""

    token: str = ""
    pid: int = 0


#: A caller that says nothing about itself (a protocol client that sends neither field).
ANONYMOUS = Caller()


class Registrar:
    """``on_open_store`` is called with each store when its namespace is first opened (the
    upkeep's index scan). Mapping an engine's memory, opening stores and making staging run on
    the register thread (``threads.register``), one registration at a time."""

    def __init__(self, backends: dict[str, Backend], locations: Locations, staging: Staging, metrics: Metrics,
                 threads: DataThreads, on_open_store: Callable[[Store], None] = lambda store: None,
                 events: RecordEvents = NO_EVENTS) -> None:
        self.backends = backends
        self.events = events
        self.locations = locations
        self.staging = staging
        self.metrics = metrics
        self.threads = threads
        self.on_open_store = on_open_store
        self.current: Registration | None = None
        #: Stores per namespace; see the module doc.
        self.namespaces: dict[str, NamespaceTiers] = {}
        #: Releases started by ``fail``, awaited by ``stop``.
        self._background = Background("registrar")
        self._lock: asyncio.Lock | None = None

    async def stop(self) -> None:
        """Finish the releases in progress, then release the current registration."""
        await self._background.stop()
        if self.current is not None:
            await self.release(self.current, "shutdown")

    def close_stores(self) -> None:
        """Close every namespace's stores (after the writes to them have finished)."""
        for tiers in self.namespaces.values():
            tiers.close()
        self.namespaces.clear()

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
            # Validated and opened first, so bad input gets its own error whoever holds the
            # registration; a refused engine's memory is closed again below.
            registration = await run(self.threads.register, Registration.attach, layout, handles, regions, pid)
            try:
                await self._check_holder(pid)
                # Staging's arena first: the RAM tier's stores keep their records in it.
                await run(self.threads.register, self.staging.prepare, registration.record_bytes)
                cached = self.namespaces.get(registration.namespace)
                tiers = await run(self.threads.register, self._open_namespace, registration, cached)
                if tiers is not cached:
                    self.namespaces[registration.namespace] = tiers
                    for store in tiers:
                        if cached is None or store not in cached.stores.values():
                            self.on_open_store(store)
                await run(self.threads.register, self.staging.pin, registration.mover)
            except BaseException:
                await run(self.threads.register, registration.close)
                await self._restore_staging()
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
                self.events.closed(namespace)  # no longer served here: routers should not send it
        self.metrics.registered.set(1)
        self.metrics.registrations.labels(event="registered").inc()
        mover = registration.mover.describe()
        log.info("registered namespace %s for pid %d: %d regions, %d blocks of %d bytes, %s mover (copy: %s)",
                 registration.namespace, pid, len(registration.placements), registration.layout.num_blocks,
                 registration.record_bytes, mover["mover"], mover.get("copy", "-"))
        assert self.staging.write is not None
        return {"namespace": registration.namespace, "record_bytes": registration.record_bytes,
                "write_slots": self.staging.write.capacity, "token": registration.token}

    async def _restore_staging(self) -> None:
        """A register that failed after making an arena of its record size leaves staging at
        a size the current registration (if any) cannot use: its swaps would fail until it
        registered again. Make its own size again, and reopen its RAM-tier store in that arena
        (the records the replaced arena held are gone with it, as at any change of size)."""
        current = self.current
        if current is None or self.staging.arena is None or self.staging.arena.record_bytes == current.record_bytes:
            return
        log.warning("a failed register changed the staging record size; restoring %d-byte staging for the "
                    "registration of pid %d", current.record_bytes, current.pid)
        await run(self.threads.register, self.staging.prepare, current.record_bytes)
        cached = self.namespaces.get(current.namespace)
        tiers = await run(self.threads.register, self._open_namespace, current, cached)
        if tiers is not cached:
            self.namespaces[current.namespace] = current.tiers = tiers
            for store in tiers:
                if cached is None or store not in cached.stores.values():
                    self.on_open_store(store)
        await run(self.threads.register, self.staging.pin, current.mover)

    async def _check_holder(self, pid: int) -> None:
        """Refuse a register while another live engine holds the registration; release a holder
        whose process is gone. The same pid (or a holder that gave none) is replaced later."""
        holder = self.current
        if holder is None or holder.pid == 0 or holder.pid == pid:
            return
        if await run(self.threads.register, holder.engine_alive):
            log.warning("register from pid %d refused: pid %d holds the registration", pid, holder.pid)
            raise RegistrationHeld(f"this daemon's cache registration belongs to pid {holder.pid}, which is alive; "
                                   "one daemon serves one engine (check the cache-queue port of this engine)",
                                   holder_pid=holder.pid, namespace=holder.namespace, pid=pid)
        log.warning("engine pid %d is gone; releasing its registration for pid %d", holder.pid, pid)
        await self._release(holder, "engine_exited")

    def _open_namespace(self, registration: Registration, cached: NamespaceTiers | None = None) -> NamespaceTiers:
        """The namespace's stores, one per tier. Those of ``cached`` are kept (a warm index),
        except the ones keeping records in host memory: those are asked for again, since the arena
        they keep records in may have been replaced since (a register of another record size that
        failed after making its arena); ``cached`` itself when nothing changed."""
        old = cached.stores if cached is not None else {}
        stores = {tier: old[tier] if tier in old and not old[tier].holds_records else
                  backend.open_store(registration.namespace, registration.layout.to_wire(), registration.record_bytes)
                  for tier, backend in self.backends.items()}
        if cached is not None and all(stores[tier] is old.get(tier) for tier in stores):
            return cached
        self.events.describe(registration.namespace, registration.layout.block_size)
        for tier, store in stores.items():
            if store is not old.get(tier):
                store.watch(self.events)  # before its scan (on_open_store) announces what it finds
        return NamespaceTiers(stores, self.locations, self.metrics)

    async def unregister(self, caller: Caller) -> bool:
        async with self._serialised():
            if self.current is None:
                return False
            self.check_caller(self.current, caller)
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
        await run(self.threads.register, registration.close)
        # Reported after the unmap, so a watcher that sees 0 knows the memory is let go.
        self.metrics.registered.set(0)
        self.metrics.registrations.labels(event=reason).inc()
        log.info("released registration of namespace %s (pid %d): %s", registration.namespace, registration.pid,
                 reason)

    # -- leases -----------------------------------------------------------------------------------

    def lease(self, caller: Caller) -> Lease:
        """A lease on the registration ``caller`` is entitled to, for a request about to use it
        (taken on the loop, with no await between the check and the lease)."""
        registration = self.current
        if registration is None:
            raise NotRegistered("no cache is registered; send register first")
        self.check_caller(registration, caller)
        return registration.lease()

    @staticmethod
    def check_caller(registration: Registration, caller: Caller) -> None:
        """The request's token must name this registration; without one, its pid must be the
        holder's. A request that says neither is taken as the holder's, as protocol clients
        that predate these fields expect (the shipped clients always send both)."""
        if caller.token:
            if caller.token != registration.token:
                raise NotRegistered("the registration this client made was released or replaced; register again",
                                    reason="replaced")
            return
        if caller.pid and caller.pid != registration.pid:
            raise RegistrationHeld(f"this daemon's cache registration belongs to pid {registration.pid}; this "
                                   f"request comes from pid {caller.pid}", holder_pid=registration.pid,
                                   pid=caller.pid)

    def fail(self, registration: Registration, reason: str) -> None:
        """Stop new requests on ``registration`` now and release it in the background (a
        request that found its memory unusable; it must answer, not wait for the release)."""
        registration.close_soon()
        # Not cancelled on stop: the release may be unmapping the engine's memory on a thread.
        self._background.spawn(self.release(registration, reason),
                               f"releasing the registration of pid {registration.pid}")
