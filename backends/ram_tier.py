"""The ``host`` tier: records kept in slots of the daemon's host arena, by namespace and key.

The arena (:mod:`.host_arena`) is the memory; this module is what is stored in it (diskcache's
``Cache`` over its ``Disk``):

- :class:`RamTier` is made with one arena and keeps its index (which slot holds which record)
  and the chain order records are evicted in. It is the arena's keeper: a take that needs room
  asks it which cached record to give up.
- :class:`RamStore` is one namespace's records in a tier, the :class:`~.base.Store` the daemon
  uses. A swap_in finds a record with :meth:`RamStore.hold` and scatters straight from its slot;
  a swap_out's gathered slot is kept as it is by :meth:`RamStore.put_slot`. Neither copies, and
  no checksum is needed: the bytes were either gathered from the engine or verified when they
  were read from a lower tier, once per slot lifetime.
- :class:`RamBackend` is the tier's root, a RAM budget. It makes the arena for each registered
  record size (:meth:`RamBackend.make_arena`, staging's share included) with a tier over it;
  stores opened from then on keep their records there. A new record size brings a new arena,
  and the old one's records go with it.

Which cached record a take evicts is the host and file tiers' one rule, :mod:`.chains` (issue
14): stranded records first, then the least recent record no stored record follows, so a prefix
chain loses its tail, never its head. The order knows every record in the tier, held or not;
held slots are skipped. Only when every leaf is held does a take fall back to the longest-idle
cached record (its successors are then stranded and go first next time).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Container, Iterable, Sequence

import numpy as np

from kvswap.protocol.errors import NoSpace
from kvswap.common.units import round_up_to_page

from .base import Backend, GetStatus, HeldRecord, Store
from .chains import ChainOrder, chain_broken
from .events import NO_EVENTS, RecordEvents
from .host_arena import ArenaSlot, HostArena

Entry = tuple[str, str]  # (namespace, key)


class RamTier:
    """The records kept in one arena, across namespaces: index, chain order and counters. Every
    method takes the arena's lock (the ``*_locked`` ones are the arena's calls, already in it)."""

    def __init__(self, arena: HostArena, eviction: str = "chain") -> None:
        if arena.keeper is not None:
            raise ValueError("this arena already has a RAM tier")
        self.arena = arena
        self._lock = arena.lock
        self._index: dict[Entry, ArenaSlot] = {}
        #: The keys of ``_index``, per namespace: what the loop reads for every lookup, with no
        #: lock (a set's membership test is atomic under the GIL) and no tuple built per key.
        self._keys: dict[str, set[str]] = {}
        # Eviction order over every record (held or not).
        self._order: ChainOrder[Entry] = ChainOrder(eviction)
        #: Records held per namespace, and evicted per namespace to make room.
        self.records: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter()
        #: swap_out records refused per namespace because their predecessor was evicted.
        self.chain_refused: Counter[str] = Counter()
        self._stores: dict[str, RamStore] = {}
        #: Where records arriving and leaving are reported (KV events), under the arena's lock.
        self.events: RecordEvents = NO_EVENTS
        arena.keeper = self

    def open_store(self, namespace: str, counts: "HitCounts | None" = None) -> "RamStore":
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = RamStore(self, namespace, counts or HitCounts())
            return store

    # -- records ---------------------------------------------------------------------------------

    def keep(self, slot: ArenaSlot, namespace: str, key: str) -> None:
        """Make ``slot`` (held by the caller) the RAM copy of ``key``; an older copy goes
        (the record keeps its place in its chain, touched). Raises ``NoSpace`` for a swap_out's
        record whose predecessor was evicted (no lookup could reach it) and once the arena is
        replaced."""
        entry = (namespace, key)
        with self._lock:
            if self.arena.retired:
                raise NoSpace("the host pool was replaced (a registration of another record size)",
                              key=key, tier="host")
            old = self._index.get(entry)
            if old is slot:
                self._order.add(entry)
                return
            if old is None and self._order.orphaned(entry):
                self._order.release(entry)
                self._refused_locked(namespace)
                raise chain_broken(key, "host")
            if slot.kept is not None:
                self._forget_locked(slot)
            if old is not None:
                self._forget_locked(old, keep_order=True)
            self.arena.keep_locked(slot, entry)
            self._index[entry] = slot
            self._keys.setdefault(namespace, set()).add(key)
            self.records[namespace] += 1
            self._order.add(entry)
            if self._order.is_stranded(entry):
                # Its predecessor was evicted (to make room for it, say): nothing could reach it.
                self._forget_locked(slot)
                self._refused_locked(namespace)
                raise chain_broken(key, "host")
            if old is None:
                self.events.stored("host", namespace, (key,))

    def find(self, namespace: str, key: str) -> ArenaSlot | None:
        """The slot holding ``key``, held once more for the caller (release it), or None."""
        with self._lock:
            slot = self._index.get((namespace, key))
            if slot is None:
                return None
            self._order.add((namespace, key))  # a read makes it the most recent (then a hit prefix is touched whole)
            return self.arena.hold_locked(slot)

    def contains(self, namespace: str, key: str) -> bool:
        return key in self._keys.get(namespace, ())

    def present_prefix(self, namespace: str, keys: Sequence[str], also_present: Container[str] = ()) -> int:
        """How many leading ``keys`` this tier holds in ``namespace`` or ``also_present`` has.
        On the loop, for every lookup: one C-level pass over the keys (``map`` of the set's
        membership test), Python only from the first key the tier lacks on."""
        held = self._keys.get(namespace, set())
        found = list(map(held.__contains__, keys))
        try:
            first = found.index(False)
        except ValueError:
            return len(keys)
        for i in range(first, len(keys)):
            if not found[i] and keys[i] not in also_present:
                return i
        return len(keys)

    def chain(self, namespace: str, keys: Sequence[str], reserve: bool = False) -> None:
        """``keys`` are one chain, head first: :meth:`.chains.ChainOrder.chain`."""
        entries = [(namespace, key) for key in keys]  # built before the lock: the loop waits for it
        with self._lock:
            self._order.chain(entries, reserve)

    def unreachable(self, namespace: str) -> int:
        """Records of ``namespace`` no lookup can reach in this tier alone."""
        with self._lock:
            return self._order.unreachable(lambda entry: entry[0] == namespace)

    def drop(self, namespace: str, key: str) -> bool:
        with self._lock:
            slot = self._index.get((namespace, key))
            if slot is None:
                return False
            self._forget_locked(slot)
            return True

    def clear(self, namespace: str) -> int:
        with self._lock:
            mine = [slot for (ns, _), slot in self._index.items() if ns == namespace]
            for slot in mine:
                self._forget_locked(slot, announce=False)
            self.events.cleared("host", namespace)
            return len(mine)

    # -- the arena's calls (its keeper), under the lock ----------------------------------------------

    def evict_locked(self) -> None:
        entry = self._order.victim(skip=lambda e: self._index[e].refs > 0)
        if entry is None:
            # Every leaf is held (a swap is reading or writing it): the longest-idle record goes,
            # stranding its successors, which the order then evicts first.
            entry = self.arena.longest_idle_locked().kept  # type: ignore[assignment]
            assert entry is not None
        self._forget_locked(self._index[entry])
        self.evicted[entry[0]] += 1

    def idled_locked(self, slot: ArenaSlot) -> None:
        if slot.kept is not None and self._order.is_stranded(slot.kept):  # type: ignore[arg-type]
            # Stranded while held (a write of its predecessor failed on another thread):
            # unreachable, so it goes now rather than take a slot until the next eviction.
            namespace = slot.kept[0]  # type: ignore[index]
            self._forget_locked(slot)
            self.evicted[namespace] += 1

    def retired_locked(self) -> None:
        for slot in list(self._index.values()):
            self._forget_locked(slot)
        self._order.clear()

    # -- bookkeeping -----------------------------------------------------------------------------------

    def _refused_locked(self, namespace: str) -> None:
        self.chain_refused[namespace] += 1
        self._drop_stranded_locked()

    def _drop_stranded_locked(self) -> None:
        """Forget every stranded record nobody holds (the held ones go when released). A
        refused or released chain member strands what was stored after it, and with writes of
        one request on several threads that can be records already kept."""
        held = lambda e: self._index[e].refs > 0  # noqa: E731
        while self._order.stranded:
            entry = self._order.stranded_victim(skip=held)  # the stranded ones only, not the heap
            if entry is None:
                return
            self._forget_locked(self._index[entry])
            self.evicted[entry[0]] += 1

    def _forget_locked(self, slot: ArenaSlot, keep_order: bool = False, announce: bool = True) -> None:
        """The slot no longer holds a record (nobody holding it, it is free). With
        ``keep_order`` the record lives on in another slot (its links and stamp stay); without
        ``announce`` the caller reports the removal itself (a clear)."""
        entry: Entry = slot.kept  # type: ignore[assignment]
        del self._index[entry]
        held = self._keys[entry[0]]
        held.discard(entry[1])
        if not held:
            del self._keys[entry[0]]
        if not keep_order:
            self._order.remove(entry)
            if announce:
                self.events.removed("host", entry[0], (entry[1],))
        self.records[entry[0]] -= 1
        self.arena.unkeep_locked(slot)

    def problems(self) -> list[str]:
        """Inconsistencies between arena, index and order (empty when consistent). For tests."""
        out = self.arena.problems()
        with self._lock:
            for entry, slot in self._index.items():
                if slot.kept != entry:
                    out.append(f"slot {slot.index} holds {slot.kept}, the index says {entry}")
            kept = sum(1 for slot in self.arena._slots if slot.kept is not None)
            if kept != len(self._index):
                out.append(f"{kept} slots keep a record, the index holds {len(self._index)}")
            keys = {(ns, key) for ns, held in self._keys.items() for key in held}
            if keys != set(self._index) or any(not held for held in self._keys.values()):
                out.append(f"the key sets hold {len(keys)} records, the index {len(self._index)}")
            if len(self._index) != sum(self.records.values()):
                out.append(f"index holds {len(self._index)} records, counted {sum(self.records.values())}")
            if len(self._order) != len(self._index) or any(e not in self._order for e in self._index):
                out.append(f"eviction order knows {len(self._order)} records, the tier holds {len(self._index)}")
        return out


class HitCounts:
    """A namespace's hits and misses in the RAM tier; they outlive the arena they were counted
    in (a register of another record size and back keeps counting on)."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.lock = threading.Lock()


class RamStore(Store):
    """One namespace's records in a RAM tier. Counters: ``hits``, ``misses``, ``evictions``
    (this namespace's records evicted for room)."""

    tier = "host"
    holds_records = True

    def __init__(self, ram: RamTier, namespace: str, counts: HitCounts) -> None:
        self.ram = ram
        self.namespace = namespace
        self.record_bytes = ram.arena.record_bytes
        self.counts = counts

    def watch(self, events: RecordEvents) -> None:
        self.events = self.ram.events = events  # the tier reports, under the arena's lock

    @property
    def hits(self) -> int:
        return self.counts.hits

    @property
    def misses(self) -> int:
        return self.counts.misses

    def put_slot(self, key: str, slot: HeldRecord) -> int:
        """Keep the record where it is when ``slot`` is a slot of this tier's arena (swap_out's
        gathered slot, a read slot being promoted): no copy. Any other buffer is copied."""
        if isinstance(slot, ArenaSlot) and slot.arena is self.ram.arena:
            self.ram.keep(slot, self.namespace, key)
            return self.record_bytes
        return self.put(key, slot.view.data)

    def put(self, key: str, payload: memoryview) -> int:
        """Keep a copy of ``payload`` in a slot of its own."""
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        arena = self.ram.arena
        taken = arena.take(1)
        if not taken:
            if arena.retired:
                raise NoSpace("the host pool was replaced (a registration of another record size)",
                              key=key, tier="host")
            raise NoSpace("every host pool slot is in use", slots=arena.capacity)
        slot = taken[0]
        try:
            np.copyto(slot.view, np.frombuffer(payload, dtype=np.uint8))
            self.ram.keep(slot, self.namespace, key)
        finally:
            slot.release()
        return self.record_bytes

    def hold(self, key: str) -> ArenaSlot | None:
        """The slot holding ``key``, held for the caller (who releases it), or None: what a
        swap_in scatters from directly. Counted as a hit or a miss."""
        slot = self.ram.find(self.namespace, key)
        counts = self.counts
        with counts.lock:
            if slot is None:
                counts.misses += 1
            else:
                counts.hits += 1
        return slot

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        slot = self.hold(key)
        if slot is None:
            return GetStatus.MISS
        try:
            np.copyto(np.frombuffer(out, dtype=np.uint8), slot.view)
        finally:
            slot.release()
        return GetStatus.LOADED

    def contains(self, key: str) -> bool:
        return self.ram.contains(self.namespace, key)

    def cached_prefix(self, keys: Sequence[str], also_present: Container[str] = ()) -> int:
        """RAM is the whole tier, so this is :meth:`contains_prefix` (no I/O either way): the
        tier's :meth:`RamTier.present_prefix`, with no lock."""
        return self.ram.present_prefix(self.namespace, keys, also_present)

    def expect_chain(self, keys: Sequence[str]) -> None:
        """A swap_out is about to write ``keys``, one chain head first: the tail gets the
        oldest stamp (see :mod:`.chains`)."""
        self.ram.chain(self.namespace, keys, reserve=True)

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """A hit prefix, touched as a whole, head newest (RAM has nothing to persist)."""
        self.ram.chain(self.namespace, keys)

    def unreachable(self) -> int:
        return self.ram.unreachable(self.namespace)

    def delete(self, key: str) -> bool:
        return self.ram.drop(self.namespace, key)

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(1 for key in keys if self.delete(key))

    def clear(self) -> int:
        return self.ram.clear(self.namespace)

    def usage(self) -> dict[str, int]:
        records = self.ram.records[self.namespace]
        return {"records": records, "bytes": records * self.record_bytes}

    def stats(self) -> dict[str, Any]:
        ram = self.ram
        out: dict[str, Any] = dict(self.usage())
        evictions = ram.evicted[self.namespace]
        out.update(hits=self.hits, misses=self.misses, evictions=evictions, evicted_capacity=evictions, corrupt=0,
                   chain_refused=ram.chain_refused[self.namespace], unreachable=self.unreachable(),
                   pool_slots=ram.arena.capacity, pool_faulted=ram.arena.faulted)
        return out


class RamBackend(Backend):
    """The ``host`` tier's root: a RAM budget, ``capacity_bytes`` (cached records may also use
    staging slots nobody needs). It makes the arena for each registered record size, with a
    :class:`RamTier` over it; a namespace's store keeps its records in the arena current when
    it is opened (the daemon makes the arena first, then opens the namespace's stores)."""

    tier = "host"

    def __init__(self, capacity_bytes: int, eviction: str = "chain") -> None:
        if capacity_bytes <= 0:
            raise ValueError("host tier capacity must be a positive number of bytes")
        self.capacity_bytes = self._capacity = capacity_bytes
        self.eviction = eviction
        self._ram: RamTier | None = None
        self._counts: dict[str, HitCounts] = {}
        self._lock = threading.Lock()

    def cache_slots(self, slot_bytes: int) -> int:
        return self._capacity // slot_bytes

    @property
    def ram(self) -> RamTier | None:
        """The tier over the current arena (None before the first registration)."""
        return self._ram

    def make_arena(self, record_bytes: int, staging_slots: int) -> HostArena:
        """The arena for ``record_bytes``: ``staging_slots`` plus this tier's share, and the
        RAM tier over it. Retiring the arena it replaces is its maker's (the daemon's staging,
        which knows when the writes and reads using it are done)."""
        arena = HostArena(record_bytes, staging_slots, self.cache_slots(round_up_to_page(record_bytes)))
        ram = RamTier(arena, self.eviction)
        with self._lock:
            self._ram = ram
        return arena

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> RamStore:
        """The namespace's store in the current arena. Raises ``NoSpace`` when there is none for
        ``record_bytes`` (the daemon makes the arena before it opens the stores)."""
        with self._lock:
            ram = self._ram
            counts = self._counts.setdefault(namespace, HitCounts())
        if ram is None or ram.arena.record_bytes != record_bytes:
            raise NoSpace("the host tier has no pool for records of this size", record_bytes=record_bytes,
                          pool_record_bytes=ram.arena.record_bytes if ram is not None else 0)
        return ram.open_store(namespace, counts)

    def problems(self) -> list[str]:
        ram = self._ram
        return ram.problems() if ram is not None else []


