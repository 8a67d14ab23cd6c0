"""One host memory pool: the daemon's staging and its RAM tier in one arena of record slots.

Every byte a swap moves passes through a slot: swap_out gathers a block into a slot, the file
and remote writes read from it, and the slot then stays as the RAM-tier copy of the record
until the pool needs it back. A swap_in that finds the record in RAM scatters straight from
its slot into the engine's blocks: one copy, no allocation, and no checksum (the bytes were
either gathered from the engine or verified when they were read from a lower tier, once per
slot lifetime).

The arena is one anonymous mapping, reserved at its full size (4 KiB-aligned slots of one
record each, rounded up to 4 KiB; transparent hugepages asked for where the kernel offers
them), but faulted in only ahead of use: the staging share at once (as the old staging
pools did), the RAM-tier share by :meth:`HostPool.grow` on a background thread whenever the
free faulted slots run low. No page fault lands on the swap path: a slot is only handed out
once faulted, and first-touch on a VM (0.21 GiB/s measured here, against 1.6 GiB/s for a copy
into warm memory) is what made the old RAM tier, which allocated a fresh ``bytes`` per put,
4-8x slower than no RAM tier at all.

Slot states (all under one lock; ``refs`` counts holders):

=========  =====  ========  ==========================================================
state      refs   entry     where
=========  =====  ========  ==========================================================
virgin     0      None      beyond ``_faulted``: not yet faulted in, never handed out
free       0      None      ``_free``
held       >= 1   any       taken by a swap, or found by a RAM hit; never evicted
cached     0      a key     ``_idle``: evictable when a take needs room
=========  =====  ========  ==========================================================

Which cached record a take evicts is the host and file tiers' one rule, :mod:`.chains`
(issue 14): stranded records first, then the least recent record no stored record follows, so
a prefix chain loses its tail, never its head. ``_order`` knows every record in the pool,
held or not; held slots are skipped. Only when every leaf is held does a take fall back to the
longest-idle cached record (its successors are then stranded and go first next time).

A pool is replaced when a registration brings another record size (:meth:`HostPool.retire`):
from then on it hands out nothing, and once its last held slot is released (a write or read still
in flight keeps its slot valid until then) it unmaps its arena there and then, not whenever the
cyclic GC gets to it (slots and pool refer to each other; issue 22). A slot of an unmapped pool
has an empty ``view``, so a stale reference fails loudly instead of touching freed memory.

A :class:`PoolWindow` is a bounded share of the pool for one use (swap_out's write staging,
swap_in's read staging): it counts the slots it took until their last holder lets go, so
``busy`` still means "write staging is full". The RAM tier (:class:`HostPoolBackend`) is a
view of the cached slots, by namespace and key.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections import Counter, OrderedDict, deque
from typing import Any, Callable, Container, Iterable, Sequence

import numpy as np

from kvswap.protocol.errors import NoSpace
from kvswap.common.units import round_up_to_page

from .base import Backend, GetStatus, Store
from .chains import ChainOrder

log = logging.getLogger(__name__)

#: Bytes faulted in per :meth:`HostPool.grow` call on the background thread.
GROW_BYTES = 256 * 1024 * 1024
#: madvise(MADV_POPULATE_WRITE), Linux 5.14+: the kernel faults a whole range in one call,
#: measured 0.92 GiB/s here against 0.21 GiB/s for touching each page from user space.
_MADV_POPULATE_WRITE = 23
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise: Any = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # not Linux: touch the pages instead
    _madvise = None


#: What a slot's ``view`` and a pool's ``arena`` become once the pool is unmapped.
_GONE = np.empty(0, dtype=np.uint8)
_GONE.flags.writeable = False


def _fault_in(address: int, nbytes: int) -> None:
    """Fault in ``nbytes`` at ``address`` (page aligned). Either way the GIL is released: a
    ctypes call drops it for the duration."""
    if _madvise is None or _madvise(address, nbytes, _MADV_POPULATE_WRITE) != 0:
        ctypes.memset(address, 0, nbytes)


class PoolSlot:
    """One record's memory. ``view`` is exactly ``record_bytes`` long."""

    __slots__ = ("pool", "index", "view", "refs", "entry", "window")

    def __init__(self, pool: "HostPool", index: int, view: np.ndarray) -> None:
        self.pool = pool
        self.index = index
        #: Empty once the pool is unmapped (only a slot nobody holds can see that).
        self.view = view
        self.refs = 0
        #: (namespace, key) while the slot is the RAM-tier copy of that record.
        self.entry: tuple[str, str] | None = None
        #: The window that took the slot, until its last holder lets go.
        self.window: PoolWindow | None = None

    def retain(self) -> "PoolSlot":
        with self.pool._lock:
            if self.refs <= 0:
                raise RuntimeError("retain of a slot nobody holds")
            self.refs += 1
        return self

    def release(self) -> None:
        self.pool._release(self)


class HostPool:
    def __init__(self, record_bytes: int, staging_slots: int, cache_slots: int = 0, eviction: str = "chain") -> None:
        if record_bytes <= 0 or staging_slots <= 0 or cache_slots < 0:
            raise ValueError("a pool needs a record size and at least one staging slot")
        self.record_bytes = record_bytes
        self.slot_bytes = round_up_to_page(record_bytes)  # the rule staging.slot_bytes_for names
        self.staging_slots = staging_slots
        self.capacity = staging_slots + cache_slots
        # An anonymous mapping: page aligned, and reserved without being touched.
        mem = mmap.mmap(-1, self.capacity * self.slot_bytes)
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no transparent hugepages here: 4 KiB pages work the same, with more TLB misses
        self._mem: mmap.mmap | None = mem  # None once unmapped (retire)
        # A view of a view: ``arena.base`` is then an array over the whole mapping, as it was
        # for the aligned allocations staging used before (GPU pinning code looks there).
        self.arena = np.frombuffer(mem, dtype=np.uint8)[:]
        self.base = self.arena.ctypes.data
        self._slots = [PoolSlot(self, i, self.arena[i * self.slot_bytes : i * self.slot_bytes + record_bytes])
                       for i in range(self.capacity)]
        self._lock = threading.Lock()
        self._free: deque[int] = deque()
        # Cached slots nobody holds, longest idle first: what a take may evict.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._index: dict[tuple[str, str], int] = {}
        # Eviction order over every record (held or not), by (namespace, key).
        self._order: ChainOrder[tuple[str, str]] = ChainOrder(eviction)
        self._faulted = 0
        self._growing = False
        #: Slots with refs > 0; a retired pool unmaps when this reaches 0.
        self._held = 0
        self._retired = False
        self._faulting = False  # grow() is faulting in outside the lock: unmapping waits
        self._unmapped = False
        #: Called with the arena just before it is unmapped (tiers that registered it let go).
        self.before_unmap: list[Callable[[np.ndarray], None]] = []
        #: Records held per namespace, and evicted per namespace to make room.
        self.records: Counter[str] = Counter()
        self.evicted: Counter[str] = Counter()
        #: swap_out records refused per namespace because their predecessor was evicted.
        self.chain_refused: Counter[str] = Counter()
        self.grow(staging_slots)

    # -- faulting in ------------------------------------------------------------------------------

    def grow(self, count: int | None = None) -> int:
        """Fault in up to ``count`` more slots (default: ``GROW_BYTES`` worth) and make them
        free; returns how many. Runs with the GIL released, so the loop keeps answering."""
        if count is None:
            count = max(1, GROW_BYTES // self.slot_bytes)
        with self._lock:
            start = self._faulted
            stop = min(self.capacity, start + count)
            if stop <= start or self._retired:
                return 0
            self._faulting = True
        try:
            _fault_in(self.base + start * self.slot_bytes, (stop - start) * self.slot_bytes)
        finally:
            with self._lock:
                self._faulting = False
                self._faulted = stop
                self._free.extend(range(start, stop))
                due = self._unmap_due()
            if due:
                self._unmap()
        return stop - start

    def grow_all(self) -> int:
        """Fault in every slot still untouched, ``GROW_BYTES`` at a time; returns how many.
        Once the RAM tier has filled what is faulted, a daemon under load soon needs the
        rest: paying it in one background burst beats paying it again at every later burst."""
        total = 0
        while (step := self.grow()) > 0:
            total += step
        return total

    def wants_growth(self) -> bool:
        """Whether unfaulted slots remain and the free ones are down to half the staging
        share (the RAM tier has filled what is faulted; it may have more)."""
        return self._faulted < self.capacity and len(self._free) < self.staging_slots // 2 + 1

    @property
    def faulted(self) -> int:
        return self._faulted

    # -- slots ----------------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Slots a take could have now: free, or cached and held by nobody."""
        return len(self._free) + len(self._idle)

    def take(self, count: int, window: "PoolWindow | None" = None) -> list[PoolSlot] | None:
        """``count`` slots, each held once, or None when fewer are available (all or nothing).
        Free slots first, then cached records are evicted in the order of :mod:`.chains`."""
        with self._lock:
            if self._retired:
                return None
            if window is not None and window.in_use + count > window.capacity:
                return None
            if count > len(self._free) + len(self._idle):
                return None
            taken = []
            for _ in range(count):
                if self._free:
                    index = self._free.popleft()
                else:
                    index = self._victim()
                    del self._idle[index]
                    self._forget(self._slots[index], evicted=True)
                slot = self._slots[index]
                slot.refs = 1
                slot.window = window
                taken.append(slot)
            if window is not None:
                window.in_use += count
            self._held += count
        return taken

    def _release(self, slot: PoolSlot) -> None:
        with self._lock:
            slot.refs -= 1
            if slot.refs > 0:
                return
            if slot.refs < 0:
                slot.refs = 0
                raise RuntimeError("pool slot released twice")
            self._held -= 1
            due = self._unmap_due()
            if slot.window is not None:
                slot.window.in_use -= 1
                slot.window = None
            if slot.entry is not None and self._order.is_stranded(slot.entry):
                # Stranded while held (a write of its predecessor failed on another thread):
                # unreachable, so it goes now rather than take a slot until the next eviction.
                self._idle[slot.index] = None
                self._forget(slot, stranded=True)
            elif slot.entry is not None:
                self._idle[slot.index] = None  # evictable again
            else:
                self._free.append(slot.index)
        if due:
            self._unmap()

    # -- replacement --------------------------------------------------------------------------------

    def retire(self) -> None:
        """This pool is being replaced (another record size): hand out nothing more, and unmap
        the arena as soon as no slot is held (now, if none is)."""
        with self._lock:
            self._retired = True
            due = self._unmap_due()
        if due:
            self._unmap()

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def unmapped(self) -> bool:
        return self._unmapped

    def _unmap_due(self) -> bool:
        """Under the lock: whether this call should unmap (retired, nothing held, no fault-in
        running, not yet done); claims it, so exactly one caller does."""
        if not self._retired or self._held or self._faulting or self._unmapped:
            return False
        self._unmapped = True
        return True

    def _unmap(self) -> None:
        """Unmap the arena of a retired pool nobody holds a slot of (outside the lock: nothing
        can take a slot of it any more). The views into it go first, so the mapping has no
        exports left; one held elsewhere (a GPU mover still pinning it until its registration
        closes) defers the unmap to the moment that last reference goes, by reference count."""
        arena = self.arena
        for hook in self.before_unmap:
            try:
                hook(arena)
            except Exception as exc:  # a tier that cannot unregister must not keep the memory
                log.warning("letting go of the replaced host pool: %s", exc)
        self.before_unmap = []
        for slot in self._slots:
            slot.view = _GONE
        with self._lock:
            self._slots = []
            self._free.clear()
            self._idle.clear()
            self._index.clear()
            self._order.clear()
            self.records.clear()
            self._faulted = 0
        self.arena = _GONE
        del arena
        mem, self._mem = self._mem, None
        try:
            if mem is not None:
                mem.close()
        except BufferError:
            log.info("the replaced host pool is still referenced; it is unmapped when that reference goes")

    def _drop_stranded(self) -> None:
        """Under the lock: forget every stranded record nobody holds (the held ones go when
        released). A refused or released chain member strands what was stored after it, and
        with writes of one request on several threads that can be records already kept."""
        held = lambda e: self._slots[self._index[e]].refs > 0  # noqa: E731
        while self._order.stranded:
            entry = self._order.stranded_victim(skip=held)  # the stranded ones only, not the heap
            if entry is None:
                return
            self._forget(self._slots[self._index[entry]], stranded=True)

    def _victim(self) -> int:
        """Under the lock, with at least one idle cached slot: the one to evict."""
        entry = self._order.victim(skip=lambda e: self._slots[self._index[e]].refs > 0)
        if entry is not None:
            return self._index[entry]
        # Every leaf is held (a swap is reading or writing it): the longest-idle record goes,
        # stranding its successors, which the order then evicts first.
        return next(iter(self._idle))

    def slot_of(self, buffer: Any) -> PoolSlot | None:
        """The held slot whose record ``buffer`` is (same address and length), else None (always
        None for a retired pool: it keeps no new records)."""
        if self._retired:
            return None
        try:
            view = np.frombuffer(buffer, dtype=np.uint8)
        except (TypeError, ValueError):
            return None
        offset = view.ctypes.data - self.base
        if len(view) != self.record_bytes or not 0 <= offset < self.capacity * self.slot_bytes \
                or offset % self.slot_bytes:
            return None
        slot = self._slots[offset // self.slot_bytes]
        return slot if slot.refs > 0 else None

    # -- the RAM tier's records ---------------------------------------------------------------------

    def keep(self, slot: PoolSlot, namespace: str, key: str) -> None:
        """Make ``slot`` (held by the caller) the RAM copy of ``key``; an older copy goes
        (the record keeps its place in its chain, touched). Raises ``NoSpace`` for a swap_out's
        record whose predecessor was evicted: no lookup could reach it."""
        entry = (namespace, key)
        with self._lock:
            old = self._index.get(entry)
            if old == slot.index:
                self._order.add(entry)
                return
            if old is None and self._order.orphaned(entry):
                self._order.release(entry)
                self.chain_refused[namespace] += 1
                self._drop_stranded()
                raise _chain_broken(key)
            if slot.entry is not None:
                self._forget(slot)
            if old is not None:
                self._forget(self._slots[old], keep_order=True)
            slot.entry = entry
            self._index[entry] = slot.index
            self.records[namespace] += 1
            self._order.add(entry)
            if self._order.is_stranded(entry):
                # Its predecessor was evicted (to make room for it, say): nothing could reach it.
                self._forget(slot)
                self.chain_refused[namespace] += 1
                self._drop_stranded()
                raise _chain_broken(key)

    def find(self, namespace: str, key: str) -> PoolSlot | None:
        """The slot holding ``key``, held once more for the caller (release it), or None."""
        with self._lock:
            index = self._index.get((namespace, key))
            if index is None or self._retired:
                return None
            slot = self._slots[index]
            if slot.refs == 0:
                self._held += 1
            slot.refs += 1
            self._idle.pop(index, None)  # held now: not evictable until released
            self._order.add((namespace, key))  # a read makes it the most recent (then a hit prefix is touched whole)
            return slot

    def contains(self, namespace: str, key: str) -> bool:
        return (namespace, key) in self._index

    def chain(self, namespace: str, keys: Sequence[str], reserve: bool = False) -> None:
        """``keys`` are one chain, head first: :meth:`.chains.ChainOrder.chain`."""
        with self._lock:
            self._order.chain([(namespace, key) for key in keys], reserve)

    def unreachable(self, namespace: str) -> int:
        """Records of ``namespace`` no lookup can reach in this tier alone."""
        with self._lock:
            return self._order.unreachable(lambda entry: entry[0] == namespace)

    def drop(self, namespace: str, key: str) -> bool:
        with self._lock:
            index = self._index.get((namespace, key))
            if index is None:
                return False
            self._forget(self._slots[index])
            return True

    def clear(self, namespace: str) -> int:
        with self._lock:
            mine = [index for (ns, _), index in self._index.items() if ns == namespace]
            for index in mine:
                self._forget(self._slots[index])
            return len(mine)

    def _forget(self, slot: PoolSlot, evicted: bool = False, keep_order: bool = False,
                stranded: bool = False) -> None:
        """Under the lock: the slot no longer holds a record; unheld, it becomes free. With
        ``keep_order`` the record lives on in another slot (its links and stamp stay);
        ``stranded`` records dropped as unreachable count as evicted."""
        assert slot.entry is not None
        namespace = slot.entry[0]
        del self._index[slot.entry]
        if not keep_order:
            self._order.remove(slot.entry)
        slot.entry = None
        self.records[namespace] -= 1
        if stranded:
            self.evicted[namespace] += 1
        if evicted:
            self.evicted[namespace] += 1
        elif slot.refs == 0:
            del self._idle[slot.index]
            self._free.append(slot.index)

    def problems(self) -> list[str]:
        """Inconsistencies between slots, lists and index (empty when consistent). For tests."""
        out = []
        with self._lock:
            free, lru = set(self._free), set(self._idle)
            if len(free) != len(self._free):
                out.append("a slot is free twice")
            for slot in self._slots[: self._faulted]:
                where = (slot.index in free) + (slot.index in lru) + (slot.refs > 0)
                if where != 1:
                    out.append(f"slot {slot.index}: free={slot.index in free} lru={slot.index in lru} refs={slot.refs}")
                if slot.index in lru and slot.entry is None:
                    out.append(f"slot {slot.index} is cached without a record")
                if slot.entry is not None and self._index.get(slot.entry) != slot.index:
                    out.append(f"slot {slot.index} holds {slot.entry} but the index disagrees")
            if len(self._index) != sum(self.records.values()):
                out.append(f"index holds {len(self._index)} records, counted {sum(self.records.values())}")
            if len(self._order) != len(self._index) or any(e not in self._order for e in self._index):
                out.append(f"eviction order knows {len(self._order)} records, the pool holds {len(self._index)}")
        return out


class PoolWindow:
    """A bounded share of a pool for one use: at most ``capacity`` slots taken and still held.
    Offers what the swap pipeline asks of staging (``try_take``, ``free``, ``in_use``)."""

    def __init__(self, pool: HostPool, name: str, capacity: int) -> None:
        self.pool = pool
        self.name = name
        self.capacity = capacity
        self.in_use = 0  # changed under the pool's lock

    @property
    def record_bytes(self) -> int:
        return self.pool.record_bytes

    @property
    def slot_bytes(self) -> int:
        return self.pool.slot_bytes

    @property
    def arena(self) -> np.ndarray:
        return self.pool.arena

    @property
    def free(self) -> int:
        return max(0, min(self.capacity - self.in_use, self.pool.available))

    def try_take(self, count: int) -> list[PoolSlot] | None:
        return self.pool.take(count, self)

    def close(self) -> None:
        pass  # the pool's memory goes with HostPool.retire, once no slot of it is held


# -- the RAM tier -----------------------------------------------------------------------------


class HostPoolBackend(Backend):
    """The ``host`` tier: records kept in the daemon's host pool. ``capacity_bytes`` is the
    pool's RAM-tier share (cached records may also use staging slots nobody needs). The pool
    is made by the daemon's staging for the registered record size and handed over with
    :meth:`attach`; a new record size brings a new pool, and the old one's records go with it.
    """

    tier = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("host tier capacity must be a positive number of bytes")
        self.capacity_bytes = self._capacity = capacity_bytes
        self.pool: HostPool | None = None
        self._stores: dict[str, HostPoolStore] = {}
        self._lock = threading.Lock()

    def cache_slots(self, slot_bytes: int) -> int:
        return self._capacity // slot_bytes

    def attach(self, pool: HostPool) -> None:
        self.pool = pool

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> "HostPoolStore":
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = HostPoolStore(self, namespace, record_bytes)
            return store

    def problems(self) -> list[str]:
        return self.pool.problems() if self.pool is not None else []


class HostPoolStore(Store):
    """One namespace's records in the host pool. Counters: ``hits``, ``misses``,
    ``evictions`` (this namespace's records evicted for room)."""

    tier = "host"

    def __init__(self, backend: HostPoolBackend, namespace: str, record_bytes: int) -> None:
        self.backend = backend
        self.namespace = namespace
        self.record_bytes = record_bytes
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def _pool(self) -> HostPool | None:
        pool = self.backend.pool
        return pool if pool is not None and pool.record_bytes == self.record_bytes else None

    def put(self, key: str, payload: memoryview) -> int:
        """Keep the record. A payload that is a pool slot (swap_out's gathered slot, a read
        slot being promoted) is kept where it is: no copy."""
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        pool = self._pool()
        if pool is None:
            raise NoSpace("the host pool holds records of another size", record_bytes=self.record_bytes)
        slot = pool.slot_of(payload)
        if slot is not None:
            pool.keep(slot, self.namespace, key)
            return self.record_bytes
        taken = pool.take(1)
        if not taken:
            raise NoSpace("every host pool slot is in use", slots=pool.capacity)
        slot = taken[0]
        try:
            np.copyto(slot.view, np.frombuffer(payload, dtype=np.uint8))
            pool.keep(slot, self.namespace, key)
        finally:
            slot.release()
        return self.record_bytes

    def hold(self, key: str) -> PoolSlot | None:
        """The slot holding ``key``, held for the caller (who releases it), or None: what a
        swap_in scatters from directly."""
        pool = self._pool()
        slot = pool.find(self.namespace, key) if pool is not None else None
        with self._lock:
            if slot is None:
                self.misses += 1
            else:
                self.hits += 1
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
        pool = self._pool()
        return pool is not None and pool.contains(self.namespace, key)

    def cached_prefix(self, keys: Sequence[str], also_present: Container[str] = ()) -> int:
        """RAM is the whole tier, so this is :meth:`contains_prefix` (no I/O either way)."""
        pool = self._pool()
        for i, key in enumerate(keys):
            if key not in also_present and (pool is None or not pool.contains(self.namespace, key)):
                return i
        return len(keys)

    def expect_chain(self, keys: Sequence[str]) -> None:
        """A swap_out is about to write ``keys``, one chain head first: the tail gets the
        oldest stamp (see :mod:`.chains`)."""
        pool = self._pool()
        if pool is not None:
            pool.chain(self.namespace, keys, reserve=True)

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """A hit prefix, touched as a whole, head newest (RAM has nothing to persist)."""
        pool = self._pool()
        if pool is not None:
            pool.chain(self.namespace, keys)

    def unreachable(self) -> int:
        pool = self._pool()
        return pool.unreachable(self.namespace) if pool is not None else 0

    def delete(self, key: str) -> bool:
        pool = self._pool()
        return pool is not None and pool.drop(self.namespace, key)

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(1 for key in keys if self.delete(key))

    def clear(self) -> int:
        pool = self._pool()
        return pool.clear(self.namespace) if pool is not None else 0

    def usage(self) -> dict[str, int]:
        pool = self._pool()
        records = pool.records[self.namespace] if pool is not None else 0
        return {"records": records, "bytes": records * self.record_bytes}

    def stats(self) -> dict[str, Any]:
        pool = self._pool()
        out: dict[str, Any] = dict(self.usage())
        evictions = pool.evicted[self.namespace] if pool is not None else 0
        out.update(hits=self.hits, misses=self.misses, evictions=evictions, evicted_capacity=evictions, corrupt=0,
                   chain_refused=pool.chain_refused[self.namespace] if pool is not None else 0,
                   unreachable=self.unreachable(),
                   pool_slots=pool.capacity if pool is not None else 0,
                   pool_faulted=pool.faulted if pool is not None else 0)
        return out


def _chain_broken(key: str) -> NoSpace:
    return NoSpace("the record before this one in its chain was evicted; storing it would waste the space",
                   key=key, tier="host")
