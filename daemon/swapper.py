"""The swap pipeline: what to store and load (decided here, on the event loop) and the byte
movement it hands to threads (copies through the registration's mover, records through the
store).

All bookkeeping — the registration, the in-flight write table, staging slots — is touched only
on the event loop thread, so it needs no locks. Threads get a slot and a key, do their copy or
their I/O, and return a status.

swap_out::

    validate -> skip duplicates and keys stored or in flight -> take write slots (or busy)
    -> gather blocks into slots (thread) -> [answer "copied"] -> write records (write pool)
    -> index -> [answer "persisted"]

swap_in::

    validate -> per key: the in-flight write's slot, else a read slot filled from the store
    (read pool) -> verify -> scatter into the engine's blocks -> answer loaded prefix + statuses
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from kvswap.backends.base import Backend, GetStatus, Store
from kvswap.protocol.errors import Busy, KvswapError, NotRegistered, Timeout, TooLarge

from .config import Config
from .metrics import Metrics
from .registration import Registration
from .staging import Slot, StagingPool
from .tiers import Locations, NamespaceTiers

log = logging.getLogger(__name__)
T = TypeVar("T")


class Deadline:
    """When a request must be answered. Threads check ``live()`` before touching engine
    memory, so a swap that timed out never writes into blocks the engine has reused."""

    __slots__ = ("at", "_expired")

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s
        self._expired = False

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expire(self) -> None:
        self._expired = True

    def live(self) -> bool:
        return not self._expired and time.monotonic() < self.at


@dataclass
class InflightWrite:
    """A record being copied into staging and written. swap_in reads from ``slot`` once
    ``copied`` resolves; ``done`` resolves when the write ends, either way."""

    slot: Slot
    copied: asyncio.Future = field(repr=False)
    done: asyncio.Future = field(repr=False)


class Swapper:
    def __init__(self, config: Config, backends: dict[str, Backend], locations: Locations, metrics: Metrics) -> None:
        self.config = config
        self.backends = backends
        self.locations = locations
        self.metrics = metrics
        self.registration: Registration | None = None
        #: The registered namespace's stores, one per tier (kept after unregister so a
        #: restarting engine of the same layout finds its index warm).
        self.tiers: NamespaceTiers | None = None
        self._namespaces: dict[str, NamespaceTiers] = {}
        self._inflight: dict[str, InflightWrite] = {}
        self._write_tasks: set[asyncio.Task] = set()
        self._engine_ops = 0  # requests now touching the registered engine memory
        self._engine_idle: asyncio.Event | None = None
        self._write_staging: StagingPool | None = None
        self._read_staging: StagingPool | None = None
        self._read_slot_freed: asyncio.Condition | None = None
        self._write_pool: ThreadPoolExecutor | None = None
        self._read_pool: ThreadPoolExecutor | None = None
        self._copy_pool: ThreadPoolExecutor | None = None
        self._maintenance_pool: ThreadPoolExecutor | None = None
        self._health_pool: ThreadPoolExecutor | None = None
        self._last_health_check = 0.0

    # -- lifetime -----------------------------------------------------------------------------

    def start(self) -> None:
        self._write_pool = ThreadPoolExecutor(self.config.write_threads, thread_name_prefix="kvswap-write")
        self._read_pool = ThreadPoolExecutor(self.config.read_threads, thread_name_prefix="kvswap-read")
        # Gathers and scatters are memory copies; one thread keeps them ordered and off the loop.
        self._copy_pool = ThreadPoolExecutor(1, thread_name_prefix="kvswap-copy")
        # Scans and eviction can take seconds on big directories; they get their own thread.
        self._maintenance_pool = ThreadPoolExecutor(1, thread_name_prefix="kvswap-maintain")
        # Remote health probes can block for a connect timeout; they must not hold up eviction.
        self._health_pool = ThreadPoolExecutor(1, thread_name_prefix="kvswap-health")
        self.metrics.watch_stores(lambda: [s for ns in self._namespaces.values() for s in ns])
        self._engine_idle = asyncio.Event()
        self._engine_idle.set()
        self._read_slot_freed = asyncio.Condition()
        for tier, backend in self.backends.items():
            self.metrics.stored_records.labels(tier=tier).set_function(lambda t=tier: self._usage(t, "records"))
            self.metrics.stored_bytes.labels(tier=tier).set_function(lambda t=tier: self._usage(t, "bytes"))
            healthy = getattr(backend, "healthy", None)
            self.metrics.tier_healthy.labels(tier=tier).set_function(
                (lambda b=backend: float(b.healthy)) if healthy is not None else (lambda: 1.0))

    async def stop(self) -> None:
        await self.release_registration("shutdown")
        for pool in (self._copy_pool, self._read_pool, self._write_pool, self._maintenance_pool, self._health_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=False)
        for tiers in self._namespaces.values():
            tiers.close()
        for backend in self.backends.values():
            backend.close()

    @property
    def pending_writes(self) -> int:
        return len(self._inflight)

    async def _run(self, pool: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> T:
        assert pool is not None, "Swapper.start() was not called"
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    # -- registration ---------------------------------------------------------------------------

    async def register(self, layout: dict[str, Any], handles: Sequence[dict], regions: Sequence[dict],
                       pid: int) -> dict[str, Any]:
        registration = await self._run(self._copy_pool, Registration.attach, layout, handles, regions, pid)
        try:
            tiers = self._namespaces.get(registration.namespace)
            if tiers is None:
                tiers = await self._run(self._write_pool, self._open_namespace, registration)
                self._namespaces[registration.namespace] = tiers
                for store in tiers:
                    self._start_scan(store)
            await self._make_staging(registration.record_bytes)
            pin = getattr(registration.mover, "pin_host", None)
            if pin is not None:  # GPU movers: page-lock staging now, not on the first swap
                for pool in (self._write_staging, self._read_staging):
                    await self._run(self._copy_pool, pin, pool.arena)  # type: ignore[union-attr]
        except BaseException:
            registration.close()
            raise
        await self.release_registration("replaced")
        self.registration, self.tiers = registration, tiers
        # One namespace at a time: another layout's stores give up their eviction lock (so a
        # daemon still registered for it can take over) and their metrics. Writes still in
        # flight keep their own reference and finish.
        for namespace in [ns for ns in self._namespaces if ns != registration.namespace]:
            self._namespaces.pop(namespace).close()
        self.metrics.registered.set(1)
        self.metrics.registrations.labels(event="registered").inc()
        log.info("registered namespace %s for pid %d: %d regions, %d blocks of %d bytes", registration.namespace,
                 pid, len(registration.placements), registration.layout.num_blocks, registration.record_bytes)
        return {"namespace": registration.namespace, "record_bytes": registration.record_bytes,
                "write_slots": self._write_staging.capacity if self._write_staging else 0}

    def _open_namespace(self, registration: Registration) -> NamespaceTiers:
        stores = {tier: backend.open_store(registration.namespace, registration.layout.to_wire(),
                                           registration.record_bytes)
                  for tier, backend in self.backends.items()}
        return NamespaceTiers(stores, self.locations, self.metrics)

    def _start_scan(self, store: Store) -> None:
        scan = getattr(store, "scan", None)
        if scan is None:
            return

        def done(fut: asyncio.Future) -> None:
            if fut.exception() is not None:
                log.error("index scan of %s failed: %s", store.tier, fut.exception())
            else:
                log.info("index scan of %s found %d records", store.tier, fut.result())

        asyncio.ensure_future(self._run(self._maintenance_pool, scan)).add_done_callback(done)

    async def maintain(self) -> None:
        """Background storage upkeep (eviction, leadership, rescans) for every open store, and
        a health probe of remote tiers every ``remote_check_interval_s``: an unhealthy tier
        recovers even when no request touches it."""
        now = time.monotonic()
        if now - self._last_health_check >= self.config.remote_check_interval_s:
            self._last_health_check = now
            for backend in self.backends.values():
                check = getattr(backend, "probe", None)
                if check is not None and hasattr(backend, "healthy"):
                    asyncio.ensure_future(self._run(self._health_pool, check)).add_done_callback(_log_failure)
        for tiers in list(self._namespaces.values()):
            for store in tiers:
                maintain = getattr(store, "maintain", None)
                if maintain is not None:
                    await self._run(self._maintenance_pool, maintain)

    async def _make_staging(self, record_bytes: int) -> None:
        if self._write_staging is None or self._write_staging.record_bytes != record_bytes:
            # Old pools stay alive until their last slot is released, then go with them.
            self._write_staging = await self._run(self._copy_pool, StagingPool, record_bytes,
                                                  self.config.write_staging_bytes, "write")
            self._read_staging = await self._run(self._copy_pool, StagingPool, record_bytes,
                                                 self.config.read_staging_bytes, "read")
            self._register_with_remote(self._write_staging, self._read_staging)
            self.metrics.staging_slots.clear()
            for pool in (self._write_staging, self._read_staging):
                self.metrics.staging_slots.labels(pool=pool.name, state="free").set_function(
                    lambda p=pool: p.free)
                self.metrics.staging_slots.labels(pool=pool.name, state="used").set_function(
                    lambda p=pool: p.in_use)

    def _register_with_remote(self, *pools: StagingPool) -> None:
        """Tiers that can transfer straight from registered memory (Mooncake) get the staging
        arenas, so records move without an extra copy."""
        for backend in self.backends.values():
            register = getattr(backend, "register_buffer", None)
            if register is None:
                continue
            for pool in pools:
                try:
                    register(pool.arena)
                except Exception as exc:  # zero-copy is an optimisation; copying still works
                    log.warning("cannot register staging with the %s tier: %s", backend.tier, exc)

    def _usage(self, tier: str, what: str) -> float:
        store = self.tiers.stores.get(tier) if self.tiers is not None else None
        return store.usage()[what] if store is not None else 0

    async def release_registration(self, reason: str) -> bool:
        """Stop using the engine's memory: wait for requests copying from or into it, then unmap.
        Records already copied to staging are still written."""
        registration = self.registration
        if registration is None:
            return False
        self.registration = None
        assert self._engine_idle is not None
        await self._engine_idle.wait()
        registration.close()
        # Reported after the unmap, so a watcher that sees 0 knows the memory is let go.
        self.metrics.registered.set(0)
        self.metrics.registrations.labels(event=reason).inc()
        log.info("released registration of namespace %s (pid %d): %s", registration.namespace, registration.pid, reason)
        return True

    def _require(self) -> tuple[Registration, NamespaceTiers]:
        if self.registration is None or self.tiers is None:
            raise NotRegistered("no cache is registered; send register first")
        return self.registration, self.tiers

    async def _using_engine(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op`` while counting it as a user of the engine's memory."""
        assert self._engine_idle is not None
        self._engine_ops += 1
        self._engine_idle.clear()
        try:
            return await op()
        finally:
            self._engine_ops -= 1
            if self._engine_ops == 0:
                self._engine_idle.set()

    async def check_engine(self) -> None:
        registration = self.registration
        if registration is not None and not await self._run(self._read_pool, registration.engine_alive):
            log.warning("engine pid %d is gone; releasing its cache mapping", registration.pid)
            await self.release_registration("engine_exited")

    # -- swap_out -------------------------------------------------------------------------------

    async def swap_out(self, block_ids: Sequence[int], keys: Sequence[str], wait: str, deadline: Deadline,
                       partial: bool = False) -> dict[str, Any]:
        registration, tiers = self._require()
        registration.check_blocks(block_ids)
        status: list[str] = ["exists"] * len(keys)
        todo: list[int] = []
        seen: set[str] = set()
        for i, key in enumerate(keys):
            if key in seen or key in self._inflight:
                continue
            seen.add(key)
            todo.append(i)
        if todo:
            todo = await self._run(self._read_pool, _not_stored, tiers, keys, todo)
        slots = self._take_write_slots(len(todo), partial)
        for i in todo[len(slots):]:
            status[i] = "skipped"  # partial: no staging left for these; the engine may retry them
        todo = todo[: len(slots)]
        loop = asyncio.get_running_loop()
        entries = [(keys[i], InflightWrite(slot, loop.create_future(), loop.create_future()))
                   for i, slot in zip(todo, slots)]
        for key, entry in entries:
            self._inflight[key] = entry
        self.metrics.pending_writes.set(len(self._inflight))

        def submit(start: int, stop: int) -> Future:
            items = [(key, memoryview(entry.slot.view)) for key, entry in entries[start:stop]]
            return self._write_pool.submit(_write_chunk, tiers, items)  # type: ignore[union-attr]

        async def copy_out() -> tuple[list[tuple[int, int, Future]], BaseException | None]:
            return await self._run(self._copy_pool, _gather_and_submit, registration,
                                   [block_ids[i] for i in todo], [e.slot.view for _, e in entries], deadline, submit)

        chunks, failure = await asyncio.shield(self._using_engine(copy_out))
        copied = chunks[-1][1] if chunks else 0
        # Records not gathered (deadline passed, or a failure) are dropped; the rest are
        # readable from staging until their write ends.
        for key, entry in entries[copied:]:
            self._drop_inflight(key, entry)
        for _, entry in entries[:copied]:
            entry.copied.set_result(None)
        task = asyncio.ensure_future(self._finish_writes(entries, chunks))
        self._write_tasks.add(task)
        task.add_done_callback(self._write_tasks.discard)
        if failure is not None:
            raise failure
        if copied < len(entries):
            raise Timeout("deadline passed while copying blocks", copied=copied, blocks=len(entries))
        for i in todo:
            status[i] = "queued"
        self.metrics.bytes.labels(direction="out").inc(len(todo) * registration.record_bytes)
        if wait == "persisted":
            outcomes = await asyncio.shield(task)
            for i, outcome in zip(todo, outcomes):
                status[i] = outcome
        for s in status:
            self.metrics.blocks.labels(op="swap_out", status=s).inc()
        counts = {name: status.count(name) for name in ("queued", "stored", "exists", "skipped")}
        return {"status": status, **counts, "failed": len(status) - sum(counts.values())}

    def _take_write_slots(self, count: int, partial: bool) -> list[Slot]:
        pool = self._write_staging
        assert pool is not None
        if count > pool.capacity and not partial:
            raise TooLarge(f"swap_out of {count} new blocks exceeds the write staging of {pool.capacity} records",
                           blocks=count, limit=pool.capacity)
        slots = pool.try_take(count)
        if slots is None and partial:
            slots = pool.try_take(min(count, pool.free)) or []
        if slots is None:
            self.metrics.write_failures.labels(code="busy").inc(count)
            raise Busy("write staging is full; retry after pending writes finish", needed=count, free=pool.free,
                       pending_writes=len(self._inflight))
        return slots

    def _drop_inflight(self, key: str, entry: InflightWrite) -> None:
        if self._inflight.get(key) is entry:
            del self._inflight[key]
        self.metrics.pending_writes.set(len(self._inflight))
        if not entry.copied.done():
            entry.copied.set_exception(Timeout("the copy of this block was abandoned"))
            entry.copied.exception()  # retrieved: a reader may never look
        if not entry.done.done():
            entry.done.set_result(None)
        entry.slot.release()

    async def _finish_writes(self, entries: list[tuple[str, "InflightWrite"]],
                             chunks: list[tuple[int, int, Future]]) -> list[str]:
        """Wait for each chunk of writes; its records' in-flight entries go when it ends.
        Returns the per-record outcomes of the records copied."""

        failures: Counter[tuple[str, str, str]] = Counter()

        async def finish(start: int, stop: int, write: Future) -> list[str]:
            try:
                outcomes, chunk_failures = await asyncio.wrap_future(write)
                failures.update(chunk_failures)
            except Exception:  # _write_chunk answers per record; this is a bug
                log.exception("writes of %d records failed", stop - start)
                outcomes = ["internal"] * (stop - start)
            for (key, entry), outcome in zip(entries[start:stop], outcomes):
                if outcome != "stored":
                    self.metrics.write_failures.labels(code=outcome).inc()
                self._drop_inflight(key, entry)
            return outcomes

        results = await asyncio.gather(*(finish(start, stop, write) for start, stop, write in chunks))
        if failures:  # one line per request, not one per key
            log.warning("swap_out: %d of %d records not stored: %s", sum(failures.values()), len(entries),
                        "; ".join(f"tier {tier or '?'}: {code} x{n} ({reason})"
                                  for (tier, code, reason), n in failures.most_common(4)))
        return [outcome for chunk in results for outcome in chunk]

    # -- swap_in ----------------------------------------------------------------------------------

    async def swap_in(self, keys: Sequence[str], block_ids: Sequence[int], deadline: Deadline) -> dict[str, Any]:
        registration, tiers = self._require()
        registration.check_blocks(block_ids)
        status: list[str] = [GetStatus.MISS.value] * len(keys)
        pool = self._read_staging
        assert pool is not None
        # Waves of at most half the read staging, so concurrent swap_ins share it; each wave
        # takes its slots all at once (no two requests can each hold part and wait for more).
        wave = max(1, min(READ_WAVE, pool.capacity // 2))

        async def load(indices: list[int]) -> None:
            slots: list[Slot] = []
            try:
                # Records still being written come from their staging slot; the rest are read
                # from the tiers into read slots, in parallel.
                sources: dict[int, Slot] = {}
                to_read = []
                for i in indices:
                    entry = self._inflight.get(keys[i])
                    if entry is None:
                        to_read.append(i)
                        continue
                    slots.append(entry.slot.retain())
                    try:
                        await entry.copied
                        sources[i] = entry.slot
                    except KvswapError:
                        pass  # its copy was abandoned: a miss
                slots_read = await self._take_read_slots(pool, len(to_read))
                slots.extend(slots_read)
                # The host mover scatters each record on its read thread as soon as it is read
                # (reads and copies overlap); GPU movers want the wave in one call (one upload,
                # one kernel), after the reads.
                per_record = not getattr(registration.mover, "batches_scatter", False)
                results = await asyncio.gather(*(
                    self._run(self._read_pool, _read_record, tiers, keys[i], slot.view,
                              (registration, block_ids[i], deadline) if per_record else None)
                    for i, slot in zip(to_read, slots_read)))
                for i, slot, result in zip(to_read, slots_read, results):
                    status[i] = result
                    if result == "loaded" and not per_record:
                        sources[i] = slot
                order = sorted(sources)
                ok = await self._run(self._copy_pool, _scatter_many, registration, [block_ids[i] for i in order],
                                     [sources[i].view for i in order], deadline)
                for i in order:
                    status[i] = "loaded" if ok else "error"
            finally:
                for slot in slots:
                    slot.release()
                async with self._read_slot_freed:  # type: ignore[union-attr]
                    self._read_slot_freed.notify_all()  # type: ignore[union-attr]

        async def load_all() -> None:
            for start in range(0, len(keys), wave):
                await load(list(range(start, min(start + wave, len(keys)))))

        await self._using_engine(load_all)
        loaded = 0
        for s in status:
            if s != "loaded":
                break
            loaded += 1
        if loaded:
            self._read_pool.submit(tiers.touch_chain, keys[:loaded], True).add_done_callback(_log_failure)  # type: ignore[union-attr]
        for s in status:
            self.metrics.blocks.labels(op="swap_in", status=s).inc()
        self.metrics.bytes.labels(direction="in").inc(status.count("loaded") * registration.record_bytes)
        return {"loaded": loaded, "status": status}

    async def _take_read_slots(self, pool: StagingPool, count: int) -> list[Slot]:
        if count == 0:
            return []
        assert self._read_slot_freed is not None
        async with self._read_slot_freed:
            while True:
                taken = pool.try_take(count)
                if taken is not None:
                    return taken
                await self._read_slot_freed.wait()

    # -- lookup, delete, clear, flush ---------------------------------------------------------------

    async def lookup(self, keys: Sequence[str]) -> dict[str, Any]:
        _, tiers = self._require()
        # In-flight writes count as stored: a swap_in after this lookup will find them. The
        # in-memory answer covers the common case on the loop itself (no thread hop); only a
        # key no tier's index knows goes to the tiers themselves, on a read thread.
        hits = tiers.cached_prefix(keys, self._inflight)
        if hits < len(keys):
            inflight = set(self._inflight)
            hits += await self._run(self._read_pool, tiers.prefix, keys[hits:], inflight)
        if hits:
            self._read_pool.submit(tiers.touch_chain, keys[:hits]).add_done_callback(_log_failure)  # type: ignore[union-attr]
        self.metrics.lookup_keys.labels(result="hit").inc(hits)
        self.metrics.lookup_keys.labels(result="miss").inc(len(keys) - hits)
        return {"hits": hits}

    async def delete(self, keys: Sequence[str]) -> dict[str, Any]:
        _, tiers = self._require()
        # A delete must not be undone by a write still landing: wait for those first.
        pending = [self._inflight[k].done for k in keys if k in self._inflight]
        if pending:
            await asyncio.gather(*pending)
        deleted = await self._run(self._write_pool, _in_every_tier, tiers, lambda s: s.delete_many(list(keys)))
        return {"deleted": deleted}

    async def clear(self) -> dict[str, Any]:
        _, tiers = self._require()
        await self.flush()
        deleted = await self._run(self._write_pool, _in_every_tier, tiers, lambda s: s.clear())
        return {"deleted": deleted}

    async def flush(self) -> dict[str, Any]:
        """Wait until every record copied so far has been written (or failed)."""
        tasks = list(self._write_tasks)
        if tasks:
            # wait(), not gather(): a caller that gives up (a timed-out flush, the drain) must
            # not cancel the writes, whose slots a write thread may still be reading.
            await asyncio.wait(tasks)
        return {"flushed": len(tasks)}

    def stats(self) -> dict[str, Any]:
        registration = self.registration
        out: dict[str, Any] = {
            "registered": registration is not None,
            "pending_writes": len(self._inflight),
            "write_tasks": len(self._write_tasks),
        }
        if registration is not None:
            out["registration"] = registration.describe()
        if self.tiers is not None:
            out["tiers"] = {tier: _tier_stats(store, self.backends[tier]) for tier, store in self.tiers.stores.items()}
            out["locations"] = {"store": list(self.locations.store), "retrieve": list(self.locations.retrieve),
                                "promote_to_host": self.locations.promote}
        for pool in (self._write_staging, self._read_staging):
            if pool is not None:
                out[f"{pool.name}_staging"] = {"slots": pool.capacity, "free": pool.free,
                                               "slot_bytes": pool.slot_bytes}
        return out


# -- thread-side work: pure byte movement, no daemon state --------------------------------------


def _not_stored(tiers: NamespaceTiers, keys: Sequence[str], todo: list[int]) -> list[int]:
    tiers.expect_chain(keys)  # first: a chain's stamps make its tail older than its head
    return [i for i in todo if not tiers.stored_everywhere(keys[i])]


def _in_every_tier(tiers: NamespaceTiers, op: Callable[[Store], int]) -> int:
    """Run a delete or clear on every tier; the count is the largest any tier reports (the
    same record in two tiers is one record to the engine). An unreachable tier is skipped."""
    counts = [0]
    for store in tiers:
        try:
            counts.append(op(store))
        except KvswapError as exc:
            log.warning("%s tier: %s", store.tier, exc.message)
    return max(counts)


def _tier_stats(store: Store, backend: Backend) -> dict[str, Any]:
    stats = getattr(store, "stats", None)
    out: dict[str, Any] = dict(stats() if stats is not None else store.usage())
    for name in ("healthy", "failures", "reconnects", "corrupt", "hits", "misses", "evictions"):
        value = getattr(store, name, None)
        if isinstance(value, (bool, int)) and name not in out:
            out[name] = value
    if hasattr(backend, "capacity_bytes"):
        out["capacity_bytes"] = backend.capacity_bytes
    if hasattr(backend, "url"):
        out["url"] = backend.url
    return out


def _log_failure(fut: "asyncio.Future") -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("background task failed: %s", fut.exception())


#: Blocks gathered per mover call before their writes are submitted: small enough that the
#: first writes start while later blocks are still being copied, large enough for GPU movers
#: to batch their device copies.
GATHER_CHUNK = 4
#: Keys of one swap_in read and scattered together (bounded further by the read staging).
READ_WAVE = 64


def _gather_and_submit(registration: Registration, block_ids: list[int], slots: list[Any], deadline: Deadline,
                       submit: Callable[[int, int], Future]) -> tuple[list[tuple[int, int, Future]],
                                                                       BaseException | None]:
    """Gather blocks into their slots a chunk at a time and submit the chunk's writes as soon
    as it is copied, so copying block N+1 overlaps writing block N. Returns the chunks
    submitted as ``(start, stop, future)`` (fewer records than blocks when the deadline passed
    or a copy failed) and the failure. Never raises: submitted writes must stay accounted for,
    since their slots may only be reused once they finish."""
    chunks: list[tuple[int, int, Future]] = []
    try:
        for start in range(0, len(block_ids), GATHER_CHUNK):
            stop = min(start + GATHER_CHUNK, len(block_ids))
            if not registration.mover.gather_blocks(block_ids[start:stop], slots[start:stop], deadline.live):
                break
            chunks.append((start, stop, submit(start, stop)))
    except BaseException as exc:  # handed back to the loop, which answers with it
        return chunks, exc
    return chunks, None


def _write_chunk(tiers: NamespaceTiers, items: list[tuple[str, memoryview]]) -> tuple[list[str], Counter]:
    """Write a few records on one write thread: one loop wake-up per chunk, not per record.
    Each record's outcome is its own ("stored" or an error code); failures are counted by
    (tier, code, reason) for the request's one log line."""
    outcomes = []
    failures: Counter[tuple[str, str, str]] = Counter()
    for key, payload in items:
        try:
            outcomes.append(tiers.write(key, payload))
        except KvswapError as exc:
            failures[(str(exc.details.get("tier", "")), exc.code, str(exc.details.get("reason", exc.message)))] += 1
            outcomes.append(exc.code)
        except Exception:
            log.exception("write of %s failed", key)
            outcomes.append("internal")
    return outcomes, failures


def _scatter_many(registration: Registration, block_ids: list[int], slots: list[Any], deadline: Deadline) -> bool:
    if not block_ids:
        return True
    return registration.mover.scatter_blocks(block_ids, slots, deadline.live)


def _read_record(tiers: NamespaceTiers, key: str, slot: Any,
                 scatter_to: tuple[Registration, int, Deadline] | None = None) -> str:
    """Read one record into ``slot``; with ``scatter_to``, also copy it into its engine block
    right here on the read thread."""
    status, _ = tiers.read(key, memoryview(slot))
    if status != "loaded" or scatter_to is None:
        return status
    registration, block_id, deadline = scatter_to
    return "loaded" if _scatter_many(registration, [block_id], [slot], deadline) else "error"
