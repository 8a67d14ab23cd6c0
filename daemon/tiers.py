"""Storage tiers and where swaps go: which tiers exist, where swap_out stores, in which order
swap_in and lookup retrieve, and the per-record work across tiers (run on I/O threads).

Tiers, in their fixed order: ``host`` (RAM, configured by ``--host-tier-bytes``), ``file``
(the directory, always), ``remote`` (``--remote-url``). ``store`` is a set of tier names;
``retrieve`` an ordered list. They are independent, so a decode node can store to ``remote``
while a prefill node retrieves from ``host,remote``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from kvswap.backends.base import Backend, GetStatus, HeldRecord, Store
from kvswap.protocol.errors import IOFailure, KvswapError, Unavailable

from .metrics import Metrics

log = logging.getLogger(__name__)

TIER_ORDER = ("host", "file", "remote")


def parse_location_list(value: str) -> list[str]:
    """``"host, remote"`` -> ``["host", "remote"]``; empty items are an error, not skipped
    (``"host,,file"`` is a typo to report, not to guess at)."""
    items = [item.strip().lower() for item in value.split(",")]
    if value.strip() and any(not item for item in items):
        raise ValueError(f"empty name in location list {value!r}")
    return [item for item in items if item]


@dataclass(frozen=True)
class Locations:
    store: tuple[str, ...]
    retrieve: tuple[str, ...]
    #: Copy records found in a lower tier into host (when host is a retrieve location).
    promote: bool

    @classmethod
    def resolve(cls, configured: Sequence[str], store: str, retrieve: str, promote: bool) -> "Locations":
        """Check the requested locations against the tiers actually configured. ``""`` means
        the default: store to every configured tier, retrieve from all in tier order. Raises
        ``ValueError`` naming the valid choices."""
        configured = [t for t in TIER_ORDER if t in configured]
        valid = ", ".join(configured)

        def check(kind: str, names: list[str]) -> tuple[str, ...]:
            for name in names:
                if name not in TIER_ORDER:
                    raise ValueError(f"unknown tier {name!r} in --{kind}-locations; valid: {valid}")
                if name not in configured:
                    hint = {"host": "set --host-tier-bytes", "remote": "set --remote-url"}.get(name, "")
                    raise ValueError(f"tier {name!r} in --{kind}-locations is not configured ({hint}); "
                                     f"configured: {valid}")
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"--{kind}-locations names {', '.join(dupes)} more than once")
            return tuple(names)

        stores = check("store", parse_location_list(store)) if store.strip() else tuple(configured)
        retrieves = check("retrieve", parse_location_list(retrieve)) if retrieve.strip() else tuple(configured)
        if not stores:
            raise ValueError(f"--store-locations is empty; valid: {valid}")
        if not retrieves:
            raise ValueError(f"--retrieve-locations is empty; valid: {valid}")
        return cls(stores, retrieves, promote and "host" in retrieves)


class NamespaceTiers:
    """The stores of one namespace, one per configured tier, and the record-level work that
    spans them. Methods run on I/O threads, except :meth:`hold` and :meth:`cached_prefix`
    (memory only, on the loop).

    A swap_in finds each record in the retrieve locations, in order, asking each tier once: the
    leading ones that keep records in memory (the RAM tier, where it comes first) are asked by
    :meth:`hold`, which returns the record where it lies, held for a copy straight from it; a
    record they lack is read into a staging slot from the tiers after them by :meth:`read`."""

    def __init__(self, stores: dict[str, Store], locations: Locations, metrics: Metrics) -> None:
        self.stores = stores
        self.locations = locations
        self.metrics = metrics
        self.store_to = [stores[t] for t in locations.store]
        self.retrieve_from = [stores[t] for t in locations.retrieve]
        held = 0
        while held < len(self.retrieve_from) and self.retrieve_from[held].holds_records:
            held += 1
        #: The retrieve tiers :meth:`hold` asks, and those :meth:`read` goes on with.
        self.hold_from, self.read_from = self.retrieve_from[:held], self.retrieve_from[held:]
        self.host = stores.get("host") if locations.promote else None
        #: Where records pulled from a peer daemon go (peer_import.py): every store location, and
        #: the first retrieve location where none of them is one, so the records are loadable
        #: here as well as stored where this node stores (a decode node: the pool). Local tiers
        #: first, so a slow pool is written last.
        targets = set(locations.store)
        if not targets & set(locations.retrieve):
            targets.add(locations.retrieve[0])
        self.pull_to = [stores[t] for t in TIER_ORDER if t in targets]

    def __iter__(self):
        return iter(self.stores.values())

    @property
    def file(self) -> Store | None:
        return self.stores.get("file")

    # -- what swap_out and lookup need ----------------------------------------------------------

    def stored_everywhere(self, key: str) -> bool:
        """Whether every store location already has ``key`` (then swap_out skips it). An
        unreachable tier counts as not having it."""
        for store in self.store_to:
            try:
                if not store.contains(key):
                    return False
            except KvswapError:
                return False
        return True

    def cached_prefix(self, keys: Sequence[str], inflight: Any) -> int:
        """Leading keys known present in some retrieve tier from memory alone (no I/O).

        It runs on the event loop for every lookup, so each tier is asked for a run of keys
        at once (one call, one lock) rather than key by key (which was most of the loop's time
        under a swap_out stream, by py-spy): the runs are joined forward while some tier
        extends them. Keys a, b, c with a and b in host and c only in file: asked from a, host
        answers 2; asked from c, host answers 0 and file 1: 3 hits."""
        pos, total = 0, len(keys)
        while pos < total:
            step = 0
            for store in self.retrieve_from:
                step = max(step, store.cached_prefix(keys[pos:], inflight))
                if step == total - pos:
                    break
            if step == 0:
                break
            pos += step
        return pos

    def prefix(self, keys: Sequence[str], inflight: Any) -> int:
        """Leading keys present in some retrieve tier, asking the tiers (I/O)."""
        for i, key in enumerate(keys):
            if key not in inflight and not any(self._contains(s, key) for s in self.retrieve_from):
                return i
        return len(keys)

    def expect_chain(self, keys: Sequence[str]) -> None:
        """Before a swap_out writes: ``keys`` are one chain, head first (see backends/chains.py)."""
        for store in self.store_to:
            store.expect_chain(keys)

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """A hit prefix (lookup; swap_in with ``persist``), touched as a whole in every tier."""
        for store in self.stores.values():
            store.touch_chain(keys, persist)

    def touch_hit(self, keys: Sequence[str], persist: int) -> None:
        """A swap_in's hit prefix, touched as a whole; the first ``persist`` records also on
        disk (their files' mtimes), so that order survives a restart.

        The swapper passes the records up to the last one it read from a tier below RAM: a
        record served from RAM needs no ``utime`` of its own (its file keeps an older mtime than
        the records before it, so on disk a chain's tail stays older than its head either way).
        A swap_in served from memory alone touches only the tiers that held it: the lookup
        before it touched every tier's order (see docs/operations.md, "Prefix chains and
        eviction")."""
        if not persist:
            for store in self.hold_from:
                store.touch_chain(keys)
            return
        if persist < len(keys):
            self.touch_chain(keys)  # in memory, in every tier: no I/O
        self.touch_chain(keys[:persist], persist=True)  # then newest, and on disk

    def _contains(self, store: Store, key: str) -> bool:
        try:
            return store.contains(key)
        except KvswapError:
            return False  # an unreachable tier has nothing to offer; counted by its health

    # -- records ------------------------------------------------------------------------------

    def write(self, key: str, slot: HeldRecord) -> str:
        """Store one record, gathered into ``slot``, in every store location (the RAM tier keeps
        the slot itself). "stored" only when all have it; else the first failure's code (the
        record may be in the other tiers)."""
        return self._write(key, slot, self.store_to)

    def write_pulled(self, key: str, slot: HeldRecord) -> str:
        """Store a record pulled from a peer daemon, in :attr:`pull_to`, as :meth:`write` does."""
        return self._write(key, slot, self.pull_to)

    def _write(self, key: str, slot: HeldRecord, stores: Sequence[Store]) -> str:
        failure: KvswapError | None = None
        for store in stores:
            started = time.perf_counter()
            try:
                store.put_slot(key, slot)
                self._count(store, "put", "ok", started, slot.view.nbytes, "write")
            except KvswapError as exc:
                self._count(store, "put", exc.code, started)
                if failure is None:
                    failure = exc
                    failure.details.setdefault("tier", store.tier)
        if failure is not None:
            raise _failure(failure, key)
        return "stored"

    def hold(self, keys: Sequence[str]) -> list[HeldRecord | None]:
        """Each record held where it lies in the first of :attr:`hold_from` that has it (the
        caller releases it), or None. Memory only: the loop calls it, once per swap_in wave, so
        each tier's hits and misses are counted in one step (not timed: a look-up under a lock)."""
        found: list[HeldRecord | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for store in self.hold_from:
            missed, nbytes = [], 0
            for i in todo:
                held = found[i] = store.hold(keys[i])
                if held is None:
                    missed.append(i)
                else:
                    nbytes += held.view.nbytes
            self._tally(store, len(todo) - len(missed), len(missed), nbytes)
            todo = missed
            if not todo:
                break
        return found

    def read(self, key: str, slot: HeldRecord) -> tuple[str, str | None]:
        """Load one record into ``slot`` from the first of :attr:`read_from` (the retrieve tiers
        after those :meth:`hold` asked) that has a good copy. Returns (status, tier). A corrupt
        copy in one tier does not stop the search."""
        status = GetStatus.MISS.value
        out = slot.view.data
        for store in self.read_from:
            started = time.perf_counter()
            try:
                result = store.get_into(key, out)
            except Unavailable:
                self._count(store, "get", "unavailable", started)
                continue  # an unreachable tier is skipped, like a miss, and counted
            except IOFailure:
                self._count(store, "get", "error", started)
                status = "error" if status == "miss" else status
                continue
            if result is GetStatus.LOADED:
                self._count(store, "get", "hit", started, len(out), "read")
                self._promote(store, key, slot)
                return "loaded", store.tier
            self._count(store, "get", result.value, started)
            if result is GetStatus.CORRUPT:
                self.metrics.corrupt.labels(tier=store.tier).inc()
                status = "corrupt"
        return status, None

    def _promote(self, source: Store, key: str, slot: HeldRecord) -> None:
        """Keep a record read from a lower tier in RAM too: the read slot itself is kept."""
        if self.host is None or source is self.host:
            return
        started = time.perf_counter()
        try:
            self.host.put_slot(key, slot)
            self._count(self.host, "promote", "ok", started, slot.view.nbytes, "write")
        except KvswapError as exc:
            self._count(self.host, "promote", exc.code, started)

    def _tally(self, store: Store, hits: int, misses: int, nbytes: int) -> None:
        m = self.metrics
        if hits:
            m.tier_ops.labels(tier=store.tier, op="get", result="hit").inc(hits)
            m.tier_bytes.labels(tier=store.tier, direction="read").inc(nbytes)
        if misses:
            m.tier_ops.labels(tier=store.tier, op="get", result="miss").inc(misses)

    def _count(self, store: Store, op: str, result: str, started: float, nbytes: int = 0,
               direction: str | None = None) -> None:
        m = self.metrics
        m.tier_ops.labels(tier=store.tier, op=op, result=result).inc()
        m.tier_latency.labels(tier=store.tier, op=op).observe(time.perf_counter() - started)
        if direction:
            m.tier_bytes.labels(tier=store.tier, direction=direction).inc(nbytes)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


def _failure(cause: KvswapError, key: str) -> KvswapError:
    """The error of a record missing from a store location: the first tier's code, and that
    tier and its reason in the details (the swapper logs them once per request)."""
    from kvswap.protocol.errors import ERRORS_BY_CODE

    cls = ERRORS_BY_CODE.get(cause.code, IOFailure)
    return cls(f"the record of {key} was not stored in every store location", key=key,
               tier=cause.details.get("tier", ""), reason=cause.message)


def unready_locations(backends: dict[str, Backend], locations: Locations) -> list[str]:
    """The store and retrieve locations whose tier cannot serve now (what /readyz reports)."""
    return [tier for tier in dict.fromkeys(locations.store + locations.retrieve) if not backends[tier].healthy]


def open_backends(config: Any) -> dict[str, Backend]:
    """The configured tiers' backends, in tier order. Connects nothing yet."""
    from kvswap.backends.file_backend import Capacity, FileBackend

    backends: dict[str, Backend] = {}
    if config.host_tier_bytes:
        from kvswap.backends.ram_tier import RamBackend

        # The RAM tier makes the daemon's host arena and keeps records in it, beside staging
        # (one copy on a hit).
        backends["host"] = RamBackend(config.host_tier_bytes)
    backends["file"] = FileBackend(
        config.storage_dir, fsync=config.fsync, direct_io=config.direct_io, layout=config.file_layout,
        capacity=Capacity(config.storage_max_bytes, config.storage_min_free_bytes),
        rescan_interval_s=config.storage_rescan_interval_s)
    if config.remote_url:
        from kvswap.backends.remote import open_remote

        backends["remote"] = open_remote(config.remote_url)
    return backends
