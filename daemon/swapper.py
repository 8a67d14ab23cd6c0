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

(Just over 500 lines on purpose: swap_out and swap_in read best whole, each with the
thread-side functions it hands bytes to; registrations, staging, upkeep and the in-flight table
already live in their own modules.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import KeysView
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from kvswap.backends.base import Backend, GetStatus, HeldRecord, Store
from kvswap.backends.events import NO_EVENTS, RecordEvents
from kvswap.protocol.kv_events import BlockMeta
from kvswap.protocol.errors import KvswapError, NotRegistered, Timeout
from kvswap.protocol.results import SwapInResult, SwapOutResult

from .background import Background
from .config import Config
from .data_threads import DataThreads, run, spread
from .deadline import CopyGuard, Deadline
from .inflight import InflightTable, InflightWrite
from .metrics import Metrics
from .movers.segment import SegmentShrunk
from .peer_arrivals import Arrivals
from .registrar import ANONYMOUS, Caller, Registrar
from .registration import Lease, Registration
from .staging import Slot, Staging
from .tiers import ChainTouches, Locations, NamespaceTiers
from .upkeep import Upkeep

log = logging.getLogger(__name__)
T = TypeVar("T")


class Swapper:
    """The swap pipeline. Its parts: the :class:`~.registrar.Registrar` (whose cache, and the
    leases on it), :class:`~.staging.Staging` (slots) and :class:`~.upkeep.Upkeep` (background
    work); the swapper itself runs swap_out, swap_in, lookup, delete, clear and flush."""

    def __init__(self, config: Config, backends: dict[str, Backend], locations: Locations, metrics: Metrics,
                 events: RecordEvents = NO_EVENTS) -> None:
        self.config = config
        #: Where stores report what they hold (KV events), and where swap_out names its keys.
        self.events = events
        self.backends = backends
        self.locations = locations
        self.metrics = metrics
        #: Every thread pool, below the loop's priority where they move bytes (data_threads.py).
        self.threads = DataThreads(config.write_threads, config.read_threads, config.data_thread_nice)
        self.staging = Staging(config.write_staging_bytes, config.read_staging_bytes, backends.values(), metrics,
                               self.threads)
        self.upkeep = Upkeep(backends.values(), self.threads, config.remote_check_interval_s)
        self.registrar = Registrar(backends, locations, self.staging, metrics, self.threads,
                                   on_open_store=self.upkeep.start_scan, events=events)
        self._inflight = InflightTable()
        #: The writes of each swap_out (``flush`` waits for them); never cancelled.
        self._writes = Background("writes")
        #: Chain touches after a lookup or swap_in.
        self._background = Background("swapper")
        #: Lookups' hit prefixes waiting for their chain touch, merged and drained off the loop.
        self.touches = ChainTouches()
        #: Woken whenever records become readable here (a swap_out's copy, a pull from a peer),
        #: for lookups and peer exports waiting for keys on their way (peer_records.py).
        self.arrivals = Arrivals()

    # -- lifetime -----------------------------------------------------------------------------

    def start(self) -> None:
        self.metrics.watch_stores(lambda: list(self.registrar.open_stores()))
        for tier, backend in self.backends.items():
            self.metrics.stored_records.labels(tier=tier).set_function(functools.partial(self._usage, tier, "records"))
            self.metrics.stored_bytes.labels(tier=tier).set_function(functools.partial(self._usage, tier, "bytes"))
            self.metrics.tier_healthy.labels(tier=tier).set_function(functools.partial(_healthy, backend))

    async def stop(self) -> None:
        """Release the registration, wait for every write and all background work, then end the
        threads and close the stores. (A forced exit never calls it: see server.run.)"""
        await self.registrar.stop()
        await self._writes.stop()
        await self._background.stop()
        await self.upkeep.stop()
        await self.staging.stop()
        self.threads.shutdown()
        self.registrar.close_stores()
        for backend in self.backends.values():
            backend.close()

    @property
    def registration(self) -> Registration | None:
        return self.registrar.current

    @property
    def pending_writes(self) -> int:
        return len(self._inflight)

    @property
    def inflight(self) -> InflightTable:
        """Records copied or being copied and not yet written: readable from their slots."""
        return self._inflight

    async def check_engine(self) -> None:
        """Release the registration of an engine whose process is gone."""
        registration = self.registrar.current
        if registration is not None and not await self.upkeep.engine_alive(registration):
            log.warning("engine pid %d is gone; releasing its cache mapping", registration.pid)
            await self.registrar.release(registration, "engine_exited")

    async def maintain(self) -> None:
        await self.upkeep.maintain(self.registrar.open_stores())

    async def register(self, layout: dict[str, Any], handles: Sequence[dict], regions: Sequence[dict],
                       pid: int) -> dict[str, Any]:
        return await self.registrar.register(layout, handles, regions, pid)

    async def unregister(self, caller: Caller) -> bool:
        return await self.registrar.unregister(caller)

    def _usage(self, tier: str, what: str) -> float:
        registration = self.registrar.current
        store = registration.tiers.stores.get(tier) if registration is not None and registration.tiers else None
        return store.usage()[what] if store is not None else 0

    async def _holding(self, lease: Lease, work: Awaitable[T]) -> T:
        """Run ``work``, then let go of ``lease``: the registration stays mapped until the
        work's last copy has returned."""
        try:
            return await work
        finally:
            lease.release()

    # -- swap_out -------------------------------------------------------------------------------

    async def swap_out(self, block_ids: Sequence[int], keys: Sequence[str], wait: str, deadline: Deadline,
                       partial: bool = False, caller: Caller = ANONYMOUS,
                       metas: Sequence[BlockMeta | None] = ()) -> SwapOutResult:
        lease = self.registrar.lease(caller)
        # Shielded with its lease: a caller that gives up must not let the registration be
        # unmapped while a copy thread still reads from it.
        return await asyncio.shield(self._holding(lease, self._swap_out(lease, block_ids, keys, wait, deadline,
                                                                         partial, metas)))

    async def _swap_out(self, lease: Lease, block_ids: Sequence[int], keys: Sequence[str], wait: str,
                        deadline: Deadline, partial: bool, metas: Sequence[BlockMeta | None]) -> SwapOutResult:
        registration, tiers = lease.registration, lease.tiers
        registration.check_blocks(block_ids)
        namespace = registration.namespace
        if self.events.enabled:
            self.events.expect(namespace, keys, metas)
        status: list[str] = ["exists"] * len(keys)
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)  # a key repeated in the request is written once
        todo = await self._new(namespace, tiers, keys, list(first.values()))
        if wait == "persisted" and not partial and todo:
            # The engine waits for "persisted" anyway: room in write staging is waited for
            # too, up to the deadline, rather than answered busy (docs/protocol.md, swap_out).
            slots, waited = await self.staging.wait_write(len(todo), deadline.at, len(self._inflight),
                                                          functools.partial(_stop_waiting, registration, deadline))
            if waited:
                todo, slots = await self._still_new(namespace, tiers, keys, todo, slots)
                given_up = _stop_waiting(registration, deadline)
                if given_up is not None:  # answered while it waited: nothing is copied, nothing in flight
                    await self.staging.release(slots)
                    raise given_up
        else:
            slots = self.staging.take_write(len(todo), partial, len(self._inflight))
        for i in todo[len(slots):]:
            status[i] = "skipped"  # partial: no staging left for these; the engine may retry them
        todo = todo[: len(slots)]
        loop = asyncio.get_running_loop()
        entries = [(keys[i], InflightWrite(slot, loop.create_future(), loop.create_future()))
                   for i, slot in zip(todo, slots)]
        for key, entry in entries:
            self._inflight.add(namespace, key, entry)
        self.metrics.pending_writes.set(len(self._inflight))

        def submit(start: int, stop: int) -> Future:
            return _submit_writes(self.threads, tiers, [(key, entry.slot) for key, entry in entries[start:stop]])

        # The writes are owned before the copy starts: this request may be answered (at its
        # deadline) before the gather is back on the loop, and a flush or drain that follows the
        # answer must wait for the records copied before it.
        gathered: asyncio.Future[list[tuple[int, int, Future]]] = loop.create_future()
        task = self._writes.spawn(self._finish_writes(namespace, entries, gathered), "writes of a swap_out")
        try:
            chunks, failure = await run(self.threads.copy, _gather_and_submit, registration,
                                        [block_ids[i] for i in todo], [e.slot.view for _, e in entries],
                                        _guard(registration, deadline), submit)
        except BaseException:
            gathered.set_result([])  # never raises in practice (_gather_and_submit returns failures)
            raise
        gathered.set_result(chunks)
        # The engine's memory is no longer needed (the writes read staging): a release need
        # not wait for them.
        lease.release()
        copied = chunks[-1][1] if chunks else 0
        # Records not gathered (deadline passed, release, or a failure) are dropped; the rest
        # are readable from staging until their write ends.
        for key, entry in entries[copied:]:
            self._drop_inflight(namespace, key, entry)
        for _, entry in entries[:copied]:
            entry.copied.set_result(None)
        if copied:
            self.arrivals.notify()
        if failure is not None:
            self._failed(registration, failure)
            raise failure
        if copied < len(entries):
            if registration.closing:
                raise NotRegistered("the registration was released while this swap_out copied its blocks",
                                    copied=copied, blocks=len(entries))
            raise Timeout("deadline passed while copying blocks", copied=copied, blocks=len(entries))
        for i in todo:
            status[i] = "queued"
        self.metrics.bytes.labels(direction="out").inc(len(todo) * registration.record_bytes)
        if wait == "persisted":
            outcomes = await asyncio.shield(task)
            for i, outcome in zip(todo, outcomes):
                status[i] = outcome
        self.metrics.count_blocks("swap_out", status)
        return SwapOutResult.of(status)

    async def _new(self, namespace: str, tiers: NamespaceTiers, keys: Sequence[str], todo: list[int]) -> list[int]:
        """The indices of ``todo`` whose keys are neither being written nor stored in every
        store location: what a swap_out writes."""
        inflight = self._inflight.keys(namespace)
        todo = [i for i in todo if keys[i] not in inflight]
        if todo:
            todo = await run(self.threads.read, _not_stored, tiers, keys, todo)
        return todo

    async def _still_new(self, namespace: str, tiers: NamespaceTiers, keys: Sequence[str], todo: list[int],
                         slots: list[Slot]) -> tuple[list[int], list[Slot]]:
        """After a wait for write staging: the keys other requests stored or started meanwhile
        are ``exists`` now, and their slots go back."""
        try:
            keep = await self._new(namespace, tiers, keys, todo)
        except BaseException:
            await self.staging.release(slots)
            raise
        if len(keep) < len(slots):
            await self.staging.release(slots[len(keep):])
        return keep, slots[:len(keep)]

    def _failed(self, registration: Registration, failure: BaseException) -> None:
        """A request found the engine's memory unusable: release the registration."""
        if isinstance(failure, SegmentShrunk):
            log.warning("pid %d: %s; releasing its registration", registration.pid, failure.message)
            self.registrar.fail(registration, "segment_shrunk")

    def _drop_inflight(self, namespace: str, key: str, entry: InflightWrite) -> None:
        self._inflight.drop(namespace, key, entry)
        self.metrics.pending_writes.set(len(self._inflight))
        if not entry.copied.done():
            entry.copied.set_exception(Timeout("the copy of this block was abandoned"))
            entry.copied.exception()  # retrieved: a reader may never look
        if not entry.done.done():
            entry.done.set_result(None)
        entry.slot.release()
        self.staging.writes_released()

    async def _finish_writes(self, namespace: str, entries: list[tuple[str, InflightWrite]],
                             gathered: "asyncio.Future[list[tuple[int, int, Future]]]") -> list[str]:
        """Wait for the gather's chunks of writes, then for each; its records' in-flight
        entries go when it ends. Returns the per-record outcomes of the records copied."""
        chunks = await gathered

        failures: Counter[tuple[str, str, str]] = Counter()

        async def finish(start: int, stop: int, write: Future) -> list[str]:
            try:
                written: list[tuple[str, tuple[str, str, str] | None]] = await asyncio.wrap_future(write)
                outcomes = [outcome for outcome, _ in written]
                failures.update(failure for _, failure in written if failure is not None)
            except Exception:  # _write_record answers per record; this is a bug
                log.exception("writes of %d records failed", stop - start)
                outcomes = ["internal"] * (stop - start)
            for (key, entry), outcome in zip(entries[start:stop], outcomes):
                if outcome != "stored":
                    self.metrics.write_failures.labels(code=outcome).inc()
                self._drop_inflight(namespace, key, entry)
            return outcomes

        results = await asyncio.gather(*(finish(start, stop, write) for start, stop, write in chunks))
        if failures:  # one line per request, not one per key
            log.warning("swap_out: %d of %d records not stored: %s", sum(failures.values()), len(entries),
                        "; ".join(f"tier {tier or '?'}: {code} x{n} ({reason})"
                                  for (tier, code, reason), n in failures.most_common(4)))
        return [outcome for chunk in results for outcome in chunk]

    async def ingest(self, namespace: str, keys: Sequence[str], payloads: Sequence[Any]) -> int:
        """Store records pulled from a peer daemon, already verified (peer_import.py), the way
        swap_out stores gathered blocks: each is copied into a write slot, readable from there at
        once (lookup counts it, swap_in loads it), and written to the tiers' ``pull_to``
        locations in the background. Returns how many leading keys are now here; a key already
        in flight counts, one that finds no free write slot ends the prefix."""
        registration = self.registrar.current
        if registration is None or registration.tiers is None or registration.namespace != namespace:
            return 0
        tiers = registration.tiers
        inflight = self._inflight.keys(namespace)
        todo = [i for i, key in enumerate(keys) if key not in inflight]
        slots = self.staging.take_write(len(todo), True, len(self._inflight))
        accepted = todo[len(slots)] if len(slots) < len(todo) else len(keys)
        todo = todo[:len(slots)]
        if not todo:
            return accepted
        await run(self.threads.copy, _fill_slots, [s.view for s in slots], [payloads[i] for i in todo])
        await run(self.threads.read, tiers.expect_chain, [keys[i] for i in todo])
        loop = asyncio.get_running_loop()
        entries = []
        for i, slot in zip(todo, slots):
            entry = InflightWrite(slot, loop.create_future(), loop.create_future())
            entry.copied.set_result(None)
            entries.append((keys[i], entry))
            self._inflight.add(namespace, keys[i], entry)
        self.metrics.pending_writes.set(len(self._inflight))
        chunks = [(start, min(start + GATHER_CHUNK, len(entries)),
                   _submit_writes(self.threads, tiers, [(k, e.slot) for k, e in entries[start:start + GATHER_CHUNK]],
                                  pulled=True))
                  for start in range(0, len(entries), GATHER_CHUNK)]
        gathered: asyncio.Future[list[tuple[int, int, Future]]] = loop.create_future()
        gathered.set_result(chunks)
        self._writes.spawn(self._finish_writes(namespace, entries, gathered), "writes of pulled records")
        self.arrivals.notify()
        return accepted

    # -- swap_in ----------------------------------------------------------------------------------

    async def swap_in(self, keys: Sequence[str], block_ids: Sequence[int], deadline: Deadline,
                      caller: Caller = ANONYMOUS) -> SwapInResult:
        started = time.perf_counter()
        lease = self.registrar.lease(caller)
        result = await asyncio.shield(self._holding(lease, self._swap_in(lease, keys, block_ids, deadline)))
        return dataclasses.replace(result, elapsed_s=time.perf_counter() - started)

    async def _swap_in(self, lease: Lease, keys: Sequence[str], block_ids: Sequence[int],
                       deadline: Deadline) -> SwapInResult:
        registration, tiers = lease.registration, lease.tiers
        registration.check_blocks(block_ids)
        status: list[str] = [GetStatus.MISS.value] * len(keys)
        # The host mover scatters each record on its read thread as soon as it is read (reads
        # and copies overlap); GPU movers want the wave in one call (one upload, one kernel).
        per_record = not registration.mover.batches_scatter
        # Waves of at most half the read staging, so concurrent swap_ins share it; each wave
        # takes its slots all at once (no two requests can each hold part and wait for more).
        # Scattered per record and not kept in RAM (no host tier to promote into), a record is
        # out of its slot before the next is read into it: a wave needs one read slot per read
        # thread, whatever its length, so it can be long. A promoted record keeps its slot.
        reuse = per_record and tiers.host is None
        wave = READ_WAVE if reuse else min(READ_WAVE, self.staging.read_wave)
        threads = self.config.read_threads
        live = _guard(registration, deadline)
        read = [False] * len(keys)  # read from a tier below RAM (then its file is touched)

        async def load(indices: list[int]) -> None:
            slots: list[HeldRecord] = []
            try:
                # Records still being written come from their staging slot, records the tiers
                # hold in memory (a RAM hit) from where they lie: one copy each. The rest are
                # read from the tiers into read slots, in parallel.
                sources: dict[int, HeldRecord] = {}
                to_read = []
                writing: list[tuple[int, InflightWrite]] = []
                stored: list[int] = []
                stored_keys: list[str] = []
                for i in indices:
                    entry = self._inflight.get(registration.namespace, keys[i])
                    if entry is None:
                        stored.append(i)
                        stored_keys.append(keys[i])
                    else:
                        writing.append((i, entry))
                for i, held in zip(stored, tiers.hold(stored_keys)):
                    if held is None:
                        to_read.append(i)
                    else:
                        slots.append(held)
                        sources[i] = held
                # Every slot held before the first wait: while this swap_in waits for one copy,
                # its swap_out may drop another key's write and free that slot.
                slots.extend(entry.slot.retain() for _, entry in writing)
                for i, entry in writing:
                    try:
                        await entry.copied
                        sources[i] = entry.slot
                    except KvswapError:
                        pass  # its copy was abandoned: a miss
                # One read thread task per group of records, not per record: every task's end
                # wakes the loop, and under py-spy those wake-ups were 60% of the GIL held
                # during cold swap_ins. The groups still keep every read thread busy. With
                # ``reuse``, a group reads each of its records into the same slot, so no read
                # waits for the wave's slowest one (py-spy, warm reads: the read threads were
                # idle over half the time at the waves' ends).
                if reuse:
                    slots_read = await self.staging.take_read(min(len(to_read), threads, self.staging.read_wave))
                    pairs = [(i, slots_read[n % len(slots_read)]) for n, i in enumerate(to_read)]
                    groups = [pairs[g::len(slots_read)] for g in range(len(slots_read))]
                else:
                    slots_read = await self.staging.take_read(len(to_read))
                    pairs = list(zip(to_read, slots_read))
                    groups = [pairs[g::threads] for g in range(min(len(pairs), threads))]
                slots.extend(slots_read)
                # Every read ends before the slots go back, even when one fails: a read thread
                # must never write into a slot another request has taken.
                grouped = await asyncio.gather(*(
                    run(self.threads.read, _read_records, tiers,
                              [(keys[i], slot, (registration, block_ids[i], live) if per_record else None)
                               for i, slot in group])
                    for group in groups), return_exceptions=True)
                read_groups: list[list[str]] = []
                for result in grouped:
                    if isinstance(result, BaseException):
                        raise result
                    read_groups.append(result)
                by_index = {i: outcome for group, outcomes in zip(groups, read_groups)
                            for (i, _), outcome in zip(group, outcomes)}
                for i, slot in pairs:
                    status[i] = by_index[i]
                    if status[i] == "loaded":
                        read[i] = True
                        if not per_record:
                            sources[i] = slot
                order = sorted(sources)
                ok = await run(self.threads.copy, _scatter_many, registration, [block_ids[i] for i in order],
                                     [sources[i].view for i in order], live)
                for i in order:
                    status[i] = "loaded" if ok else "error"
            finally:
                await self.staging.release(slots)

        try:
            for start in range(0, len(keys), wave):
                await load(list(range(start, min(start + wave, len(keys)))))
        except BaseException as exc:
            self._failed(registration, exc)
            raise
        if registration.closing:
            raise NotRegistered("the registration was released while this swap_in copied its blocks")
        result = SwapInResult.of(status)
        loaded = result.loaded
        if loaded:
            persist = loaded  # on disk through the last record read from a tier below RAM (touch_hit)
            while persist and not read[persist - 1]:
                persist -= 1
            self._background.submit(self.threads.read, tiers.touch_hit, keys[:loaded], persist, what="touch_hit")
        self.metrics.count_blocks("swap_in", status)
        self.metrics.bytes.labels(direction="in").inc(status.count("loaded") * registration.record_bytes)
        return result

    # -- lookup, delete, clear, flush ---------------------------------------------------------------

    def _registered(self) -> Registration:
        """The current registration, for requests that use its namespace but not its memory."""
        registration = self.registrar.current
        if registration is None or registration.tiers is None:
            raise NotRegistered("no cache is registered; send register first")
        return registration

    async def lookup(self, keys: Sequence[str]) -> dict[str, Any]:
        tiers, inflight, hits = self._cached_hits(keys)
        if hits < len(keys):
            # A key no tier's index knows goes to the tiers themselves, on a read thread.
            hits += await run(self.threads.read, tiers.prefix, keys[hits:], set(inflight))
        return self._looked_up(tiers, keys, hits)

    def lookup_now(self, keys: Sequence[str]) -> dict[str, Any] | None:
        """The lookup's answer where the tiers' in-memory indexes give it whole (every key a
        hit), at once on the loop; None where a key past the hits must be asked of the tiers
        (I/O: :meth:`lookup`)."""
        tiers, _, hits = self._cached_hits(keys)
        return self._looked_up(tiers, keys, hits) if hits == len(keys) else None

    def _cached_hits(self, keys: Sequence[str]) -> tuple[NamespaceTiers, KeysView[str], int]:
        """The tiers, the keys of this namespace in flight, and how many leading keys the
        tiers' indexes in memory know, in-flight writes counted as stored (a swap_in after the
        lookup finds them in staging)."""
        registration = self._registered()
        tiers = registration.tiers
        assert tiers is not None
        inflight = self._inflight.keys(registration.namespace)
        return tiers, inflight, tiers.cached_prefix(keys, inflight)

    def _looked_up(self, tiers: NamespaceTiers, keys: Sequence[str], hits: int) -> dict[str, Any]:
        if hits and self.touches.add(tiers, keys[:hits]):
            self._background.submit(self.threads.read, self.touches.drain, what="touch_chain")
        m = self.metrics
        m.child(m.lookup_keys, "hit").inc(hits)
        m.child(m.lookup_keys, "miss").inc(len(keys) - hits)
        return {"hits": hits}

    async def delete(self, keys: Sequence[str]) -> dict[str, Any]:
        registration = self._registered()
        tiers = registration.tiers
        # A delete must not be undone by a write still landing: wait for those first.
        entries = (self._inflight.get(registration.namespace, k) for k in keys)
        pending = [entry.done for entry in entries if entry is not None]
        if pending:
            await asyncio.gather(*pending)
        deleted = await run(self.threads.write, _in_every_tier, tiers, lambda s: s.delete_many(list(keys)))
        return {"deleted": deleted}

    async def clear(self) -> dict[str, Any]:
        tiers = self._registered().tiers
        await self.flush()
        deleted = await run(self.threads.write, _in_every_tier, tiers, lambda s: s.clear())
        return {"deleted": deleted}

    async def flush(self) -> dict[str, Any]:
        """Wait until every record copied so far has been written (or failed)."""
        tasks = self._writes.tasks
        if tasks:
            # wait(), not gather(): a caller that gives up (a timed-out flush, the drain) must
            # not cancel the writes, whose slots a write thread may still be reading.
            await asyncio.wait(tasks)
        return {"flushed": len(tasks)}

    def stats(self) -> dict[str, Any]:
        registration = self.registrar.current
        out: dict[str, Any] = {
            "registered": registration is not None,
            "pending_writes": len(self._inflight),
            "write_tasks": len(self._writes.tasks),
            # Lookups with wait_ms and peer exports waiting for records on their way, and the
            # waits refused at the cap (peer_arrivals.py).
            "waiting": {"now": self.arrivals.waiters, "refused": self.arrivals.refused},
            # Lookups' chain touches: waiting, applied, merged, skipped as repeated, dropped (tiers.py).
            "touches": self.touches.stats(),
        }
        if registration is not None:
            out["registration"] = registration.describe()
            if registration.tiers is not None:
                out["tiers"] = {tier: _tier_stats(store, self.backends[tier])
                                for tier, store in registration.tiers.stores.items()}
            out["locations"] = {"store": list(self.locations.store), "retrieve": list(self.locations.retrieve),
                                "promote_to_host": self.locations.promote}
        out.update(self.staging.stats())
        return out


# -- thread-side work: pure byte movement, no daemon state --------------------------------------


def _not_stored(tiers: NamespaceTiers, keys: Sequence[str], todo: list[int]) -> list[int]:
    tiers.expect_chain(keys)  # first: a chain's stamps make its tail older than its head
    return [i for i in todo if not tiers.stored_everywhere(keys[i])]


def _stop_waiting(registration: Registration, deadline: Deadline) -> KvswapError | None:
    """Why a swap_out waiting for write staging must give up now, or None."""
    if registration.closing:
        return NotRegistered("the registration was released while this swap_out waited for write staging")
    if deadline.stopped:  # answered already (its deadline, a shutdown): it must not copy now
        return Timeout("the request was answered while it waited for write staging")
    return None


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


def _healthy(backend: Backend) -> float:
    return float(backend.healthy)


def _tier_stats(store: Store, backend: Backend) -> dict[str, Any]:
    out: dict[str, Any] = dict(store.stats())
    if backend.capacity_bytes is not None:
        out["capacity_bytes"] = backend.capacity_bytes
    if backend.url is not None:
        out["url"] = backend.url
    return out


#: Blocks gathered per mover call before their writes are submitted (after a first call of
#: one block: :func:`gather_chunks`): small enough that writes start while later blocks are
#: still being copied, large enough for GPU movers to batch their device copies.
GATHER_CHUNK = 4
#: Keys of one swap_in read and scattered together (bounded further by the read staging).
READ_WAVE = 64


def _guard(registration: Registration, deadline: Deadline) -> CopyGuard:
    """Whether a copy may go on touching the engine's memory: the request is within its
    deadline (and not being answered) and its registration is not being released."""
    return CopyGuard(deadline, lambda: registration.closing)


def _gather_and_submit(registration: Registration, block_ids: list[int], slots: list[Any],
                       guard: CopyGuard, submit: Callable[[int, int], Future]) -> tuple[list[tuple[int, int, Future]],
                                                                  BaseException | None]:
    """Gather blocks into their slots a chunk at a time (:func:`gather_chunks`) and submit the
    chunk's writes as soon as it is copied, so copying block N+1 overlaps writing block N.
    Returns the chunks submitted as ``(start, stop, future)`` (fewer records than blocks when
    the deadline passed or a copy failed) and the failure. Never raises: submitted writes must
    stay accounted for, since their slots may only be reused once they finish.

    Each chunk is copied inside ``guard.copying()``, so the request's answer waits for it; a
    chunk the deadline cut short is not submitted (its records are torn), and a chunk is
    submitted only when its whole copy ended before the answer."""
    chunks: list[tuple[int, int, Future]] = []
    try:
        for start, stop in gather_chunks(len(block_ids)):
            with guard.copying() as allowed:
                if not allowed or not registration.mover.gather_blocks(block_ids[start:stop], slots[start:stop],
                                                                       guard):
                    break
            chunks.append((start, stop, submit(start, stop)))
    except BaseException as exc:  # handed back to the loop, which answers with it
        return chunks, exc
    return chunks, None


def gather_chunks(count: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each mover call of a swap_out of ``count`` blocks: the first
    block alone, so that the disk gets its first write after one block's copy rather than
    :data:`GATHER_CHUNK` blocks' (a ``wait="persisted"`` request's writes cannot start before
    it; measured 1.3-2.4 ms to the first write with a first chunk of 4 records of 2 MiB, 0.7-1.1
    ms with one), then chunks of ``GATHER_CHUNK`` on its boundaries.
    ``gather_chunks(10) == [(0, 1), (1, 4), (4, 8), (8, 10)]``."""
    starts = [s for s in sorted({0, 1, *range(GATHER_CHUNK, count, GATHER_CHUNK)}) if s < count]
    return list(zip(starts, [*starts[1:], count]))


def _fill_slots(views: list[Any], payloads: list[Any]) -> None:
    for view, payload in zip(views, payloads):
        view[:] = payload


def _submit_writes(threads: DataThreads, tiers: NamespaceTiers, items: list[tuple[str, Slot]],
                   pulled: bool = False) -> Future:
    """Write a chunk's records, each on a write job of its own (every idle write thread takes
    one: data_threads.spread), with one loop wake-up for the chunk when its last record is
    written. The future's result: ``(outcome, failure)`` per record (``_write_record``)."""
    return spread(threads.write, functools.partial(_write_record, tiers, pulled), items)


def _write_record(tiers: NamespaceTiers, pulled: bool,
                  item: tuple[str, Slot]) -> tuple[str, tuple[str, str, str] | None]:
    """Write one record on a write thread. Its outcome is "stored" or an error code; a failure
    also says (tier, code, reason), counted for the request's one log line. ``pulled``: a record
    from a peer daemon, written to ``tiers.pull_to``."""
    key, payload = item
    try:
        return (tiers.write_pulled(key, payload) if pulled else tiers.write(key, payload)), None
    except KvswapError as exc:
        return exc.code, (str(exc.details.get("tier", "")), exc.code, str(exc.details.get("reason", exc.message)))
    except Exception:
        log.exception("write of %s failed", key)
        return "internal", None


def _scatter_many(registration: Registration, block_ids: list[int], slots: list[Any], guard: CopyGuard) -> bool:
    """Scatter records into engine blocks inside ``guard.copying()`` (the answer waits for it).
    False if the copy was refused or cut short: the blocks' contents are then undefined."""
    if not block_ids:
        return True
    with guard.copying() as allowed:
        return allowed and registration.mover.scatter_blocks(block_ids, slots, guard)


def _read_records(tiers: NamespaceTiers, items: list[tuple[str, Slot, Any]]) -> list[str]:
    """Read a group of records on one read thread: ``_read_record`` for each."""
    return [_read_record(tiers, key, slot, scatter_to) for key, slot, scatter_to in items]


def _read_record(tiers: NamespaceTiers, key: str, slot: Slot,
                 scatter_to: tuple[Registration, int, CopyGuard] | None = None) -> str:
    """Read one record into ``slot`` (a read slot); with ``scatter_to``, also copy it into its
    engine block right here on the read thread."""
    status, _ = tiers.read(key, slot)
    if status != "loaded" or scatter_to is None:
        return status
    registration, block_id, live = scatter_to
    return "loaded" if _scatter_many(registration, [block_id], [slot.view], live) else "error"
