"""Storage tiers and where swaps go: which tiers exist, where swap_out stores, in which order
swap_in and lookup retrieve, and the per-record work across tiers (run on I/O threads).

Tiers, in their fixed order: ``host`` (RAM, configured by ``--host-tier-bytes``), ``file``
(the directory, always), ``remote`` (``--remote-url``). ``store`` is a set of tier names;
``retrieve`` an ordered list. They are independent, so a decode node can store to ``remote``
while a prefill node retrieves from ``host,remote``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Final, Iterable, Sequence

from kvswap.backends.base import Backend, GetStatus, HeldRecord, Store
from kvswap.protocol.errors import IOFailure, KvswapError, Unavailable

from .metrics import Metrics

log = logging.getLogger(__name__)

TIER_ORDER = ("host", "file", "remote")

#: Keys of a chain stamped under one hold of a store's lock. A lookup's touch of a 1,000-key
#: hit prefix held the host pool's lock (and the file index's) for the whole chain, on a data
#: thread below the loop's priority; the loop, releasing a write's slot or reading the index
#: for the next lookup, waited for all of it (py-spy, a swap_out stream on 2 cores: 17% of the
#: loop's wall time in those two lock waits). 64 keys are about 0.1 ms of bookkeeping.
TOUCH_PIECE: Final = 64
#: A data thread touching a chain lets go of the GIL for this long after each piece: a
#: ``sleep(0)`` hands it back to the same thread before a waiting loop wakes up.
TOUCH_YIELD_S: Final = 50e-6
#: Keys of hit prefixes waiting for their touch (ChainTouches); past it the oldest prefix is
#: dropped, counted. The waiting prefixes hold their keys (8 MiB at 128-character keys).
TOUCH_QUEUE_KEYS: Final = 65_536
#: A lookup's prefix touched this recently (the same keys, the same tiers) is not touched
#: again. An engine asks for the same prefix at every scheduler step while its request waits
#: (kvswap bench: 1,000 keys, about 100 times a second), and a touch of 1,000 keys costs the
#: data threads about 5 ms of GIL (2.1 ms of ChainOrder.chain per tier). A chain touched at
#: time t is evicted only after everything stamped before t, so a prefix looked up at least
#: this often is evicted only by a tier whose whole content turns over faster than that.
TOUCH_REPEAT_S: Final = 1.0
#: How many recent touches are remembered for that (their hashes only).
TOUCH_RECENT: Final = 1024


def touch_pieces(keys: Sequence[str], piece: int = TOUCH_PIECE) -> list[Sequence[str]]:
    """``keys`` (one chain, head first) as pieces of at most ``piece`` keys, tail first, each
    overlapping the next by one key. Stamping them in this order gives what one stamp of the
    whole chain gives: every piece newer than the one before, its own head newest, so the head
    ends newest and the tail oldest; the shared keys carry the links between pieces.

    Worked example: ``a, b, c, d, e`` in pieces of 2 are ``[d, e], [c, d], [b, c], [a, b]``;
    stamped in that order, e < d < c < b < a, and the links e->d, d->c, c->b, b->a are all
    learned. A chain of at most ``piece`` keys is one piece.
    """
    if len(keys) <= piece:
        return [keys]
    pieces = []
    stop = len(keys)
    while True:
        start = max(0, stop - piece)
        pieces.append(keys[start:stop])
        if start == 0:
            return pieces
        stop = start + 1


def _in_pieces(stores: Iterable[Store], keys: Sequence[str], apply: Callable[[Store, Sequence[str]], None],
               pause_s: float = 0.0) -> None:
    """``apply(store, piece)`` for each store and each of :func:`touch_pieces` of ``keys`` (cut
    once), sleeping ``pause_s`` between a store's pieces."""
    pieces = touch_pieces(keys)
    for store in stores:
        for n, piece in enumerate(pieces):
            if n and pause_s:
                time.sleep(pause_s)
            apply(store, piece)


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
        """Before a swap_out writes: ``keys`` are one chain, head first (see backends/chains.py),
        told to each store in :func:`touch_pieces`."""
        _in_pieces(self.store_to, keys, lambda store, piece: store.expect_chain(piece))

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """A hit prefix (lookup; swap_in with ``persist``), touched as a whole in every tier, in
        :func:`touch_pieces` (a store's lock is held for one piece at a time), the GIL let go
        between pieces: the loop may be waiting for it."""
        _in_pieces(self.stores.values(), keys, lambda store, piece: store.touch_chain(piece, persist),
                   pause_s=TOUCH_YIELD_S)

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
            _in_pieces(self.hold_from, keys, lambda store, piece: store.touch_chain(piece))
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
            m.child(m.tier_ops, store.tier, "get", "hit").inc(hits)
            m.child(m.tier_bytes, store.tier, "read").inc(nbytes)
        if misses:
            m.child(m.tier_ops, store.tier, "get", "miss").inc(misses)

    def _count(self, store: Store, op: str, result: str, started: float, nbytes: int = 0,
               direction: str | None = None) -> None:
        m = self.metrics
        m.child(m.tier_ops, store.tier, op, result).inc()
        m.child(m.tier_latency, store.tier, op).observe(time.perf_counter() - started)
        if direction:
            m.child(m.tier_bytes, store.tier, direction).inc(nbytes)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


class ChainTouches:
    """Lookups' hit prefixes waiting to be touched as chains, applied by one job at a time on a
    data thread, never on the loop.

    A lookup only adds its prefix here (a dict entry); :meth:`add` says when no job is
    draining, so the caller starts one (:meth:`drain`). Two rules keep the touches from
    costing the loop its GIL (py-spy, 1,000-key lookups with no other load: ping p99 4.8-7.0
    ms with a touch per lookup, 1.5-1.8 ms without):

    - a prefix already waiting (the same keys for the same tiers) is not queued twice: it
      moves to the end of the queue, where a second touch would have put it (``coalesced``);
    - a prefix touched less than ``repeat_s`` ago is not touched again (``repeated``): its
      stamp is at most that old, which is all an eviction order needs.

    Past ``limit_keys`` waiting keys the oldest prefix is dropped (``dropped``): a touch only
    orders eviction, and a lookup must not wait for one."""

    def __init__(self, limit_keys: int = TOUCH_QUEUE_KEYS, repeat_s: float = TOUCH_REPEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_keys = limit_keys
        self.repeat_s = repeat_s
        self._clock = clock
        self._waiting: OrderedDict[tuple[int, tuple[str, ...]], NamespaceTiers] = OrderedDict()
        self._waiting_keys = 0
        #: hash of (tiers, keys) -> when that prefix was last queued; the newest last.
        self._recent: OrderedDict[int, float] = OrderedDict()
        self._lock = threading.Lock()
        self._draining = False
        self.coalesced = self.repeated = self.dropped = self.applied = 0

    def add(self, tiers: NamespaceTiers, keys: Sequence[str]) -> bool:
        """Queue ``keys`` (a hit prefix) for ``tiers``; True when the caller must start
        :meth:`drain` (none is running)."""
        # The tiers are held by a waiting entry, so their id names them while it waits; a
        # recent touch is remembered by hash alone (a collision skips one touch, harmlessly).
        entry = (id(tiers), tuple(keys))
        digest, now = hash(entry), self._clock()
        with self._lock:
            if entry in self._waiting:
                self._waiting.move_to_end(entry)
                self.coalesced += 1
                return False
            last = self._recent.get(digest)
            if last is not None and now - last < self.repeat_s:
                self.repeated += 1
                return False
            self._recent[digest] = now
            self._recent.move_to_end(digest)
            if len(self._recent) > TOUCH_RECENT:
                self._recent.popitem(last=False)
            self._waiting[entry] = tiers
            self._waiting_keys += len(keys)
            while self._waiting_keys > self.limit_keys and len(self._waiting) > 1:
                (_, old), _ = self._waiting.popitem(last=False)
                self._waiting_keys -= len(old)
                self.dropped += 1
            if self._draining:
                return False
            self._draining = True
            return True

    def drain(self) -> int:
        """Touch every waiting prefix, oldest first, until none waits (on a data thread);
        returns how many were touched. A touch that fails does not stop the others; the first
        failure is raised once the queue is empty, for its owner to log."""
        done = 0
        failure: BaseException | None = None
        while True:
            with self._lock:
                if not self._waiting:
                    self._draining = False
                    break
                (_, keys), tiers = self._waiting.popitem(last=False)
                self._waiting_keys -= len(keys)
            try:
                tiers.touch_chain(keys)
            except Exception as exc:
                failure = failure or exc
            done += 1
            with self._lock:
                self.applied += 1
        if failure is not None:
            raise failure
        return done

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"waiting": len(self._waiting), "applied": self.applied, "coalesced": self.coalesced,
                    "repeated": self.repeated, "dropped": self.dropped}


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
