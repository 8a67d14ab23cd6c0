"""The daemon's host memory: one arena of record-sized slots, shared by staging and the RAM tier.

Every byte a swap moves passes through a slot: swap_out gathers a block into a slot, the file
and remote writes read from it, and the slot may then stay as the RAM tier's copy of the record
until the arena needs it back. A swap_in that finds the record in RAM scatters straight from
its slot into the engine's blocks: one copy, no allocation.

This module is the memory alone, with no keys (diskcache's ``Disk`` to the RAM tier's
``Cache``): the mapping and its fault-in, slots and their reference counts, the windows that
bound staging's share. Which record a kept slot holds, and which kept slot to give up for room,
is the RAM tier's (:mod:`.ram_tier`), made with the arena and registered as its *keeper*.

The arena is one anonymous mapping, reserved at its full size (4 KiB-aligned slots of one
record each, rounded up to 4 KiB; transparent hugepages asked for where the kernel offers
them), but faulted in only ahead of use: the staging share at once, the RAM tier's share by
:meth:`HostArena.grow` on a background thread whenever the free faulted slots run low. No page
fault lands on the swap path: a slot is only handed out once faulted, and first-touch on a VM
(0.21 GiB/s measured here, against 1.6 GiB/s for a copy into warm memory) is what made the old
RAM tier, which allocated a fresh ``bytes`` per put, 4-8x slower than no RAM tier at all.

Slot states (all under the arena's lock, which the keeper shares; ``refs`` counts holders):

=========  =====  ========  ==========================================================
state      refs   kept      where
=========  =====  ========  ==========================================================
virgin     0      None      beyond ``faulted``: not yet faulted in, never handed out
free       0      None      ``_free``
held       >= 1   any       taken by a swap, or found by a RAM hit; never given up
cached     0      a tag     ``_idle``: the keeper may give it up when a take needs room
=========  =====  ========  ==========================================================

An arena is replaced when a registration brings another record size (:meth:`HostArena.retire`):
from then on it hands out nothing and its keeper forgets every record; once its last held slot
is released (a write or read still in flight keeps its slot valid until then) it unmaps its
memory there and then, not whenever the cyclic GC gets to it (slots and arena refer to each
other; issue 22). A slot of an unmapped arena has an empty ``view``, so a stale reference fails
loudly instead of touching freed memory.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections import OrderedDict, deque
from typing import Any, Callable, Hashable, Protocol

import numpy as np

from kvswap.common.units import round_up_to_page

log = logging.getLogger(__name__)

#: Bytes faulted in per :meth:`HostArena.grow` call on the background thread.
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


#: What a slot's ``view`` and an arena's ``memory`` become once the arena is unmapped.
_GONE = np.empty(0, dtype=np.uint8)
_GONE.flags.writeable = False


def _fault_in(address: int, nbytes: int) -> None:
    """Fault in ``nbytes`` at ``address`` (page aligned). Either way the GIL is released: a
    ctypes call drops it for the duration."""
    if _madvise is None or _madvise(address, nbytes, _MADV_POPULATE_WRITE) != 0:
        ctypes.memset(address, 0, nbytes)


class ArenaSlot:
    """One record's memory. ``view`` is exactly ``record_bytes`` long."""

    __slots__ = ("arena", "index", "view", "refs", "kept", "window")

    def __init__(self, arena: "HostArena", index: int, view: np.ndarray) -> None:
        self.arena = arena
        self.index = index
        #: Empty once the arena is unmapped (only a slot nobody holds can see that).
        self.view = view
        self.refs = 0
        #: The keeper's tag while it keeps a record here (the RAM tier: ``(namespace, key)``);
        #: the arena only asks whether there is one.
        self.kept: Hashable | None = None
        #: The window that took the slot, until its last holder lets go.
        self.window: ArenaWindow | None = None

    def retain(self) -> "ArenaSlot":
        with self.arena.lock:
            if self.refs <= 0:
                raise RuntimeError("retain of a slot nobody holds")
            self.refs += 1
        return self

    def release(self) -> None:
        self.arena._release(self)


class Keeper(Protocol):
    """What an arena asks of the tier that keeps records in its slots, always under the arena's
    lock (the RAM tier, :class:`~.ram_tier.RamTier`)."""

    def evict_locked(self) -> None:
        """Give up one cached slot nobody holds (there is at least one): forget its record,
        so :meth:`HostArena.unkeep_locked` makes it free."""

    def idled_locked(self, slot: ArenaSlot) -> None:
        """The last holder of a kept slot let go; the keeper may forget its record now."""

    def retired_locked(self) -> None:
        """The arena is being replaced: forget every record."""


class HostArena:
    def __init__(self, record_bytes: int, staging_slots: int, cache_slots: int = 0) -> None:
        if record_bytes <= 0 or staging_slots <= 0 or cache_slots < 0:
            raise ValueError("an arena needs a record size and at least one staging slot")
        self.record_bytes = record_bytes
        self.slot_bytes = round_up_to_page(record_bytes)  # every slot whole pages, so each starts aligned
        self.staging_slots = staging_slots
        self.capacity = staging_slots + cache_slots
        # An anonymous mapping: page aligned, and reserved without being touched.
        mem = mmap.mmap(-1, self.capacity * self.slot_bytes)
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no transparent hugepages here: 4 KiB pages work the same, with more TLB misses
        self._mem: mmap.mmap | None = mem  # None once unmapped (retire)
        # A view of a view: ``memory.base`` is then an array over the whole mapping, as it was
        # for the aligned allocations staging used before (GPU pinning code looks there).
        self.memory = np.frombuffer(mem, dtype=np.uint8)[:]
        self.base = self.memory.ctypes.data
        #: The slots faulted in so far, by index (``grow`` adds them in order): a slot object is
        #: made only once its memory is. Made all at once, a RAM tier of 4 KiB slots (records of
        #: a few hundred bytes, index_scan.py's) spent 2.8 s of a register making a million.
        self._slots: list[ArenaSlot] = []
        #: Guards every slot's state; the keeper takes it around its own bookkeeping too.
        self.lock = threading.Lock()
        #: The tier keeping records in the slots, set once by that tier when it is made.
        self.keeper: Keeper | None = None
        self._free: deque[int] = deque()
        # Cached slots nobody holds, longest idle first: what a take may give up.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._faulted = 0
        #: Slots with refs > 0; a retired arena unmaps when this reaches 0.
        self._held = 0
        self._retired = False
        #: Set when the daemon stops: a fault-in under way ends after its current step.
        self._growth_stopped = False
        self._faulting = False  # grow() is faulting in outside the lock: unmapping waits
        self._unmapped = False
        #: Called with the memory just before it is unmapped (tiers that registered it let go).
        self.before_unmap: list[Callable[[np.ndarray], None]] = []
        self.grow(staging_slots)

    # -- faulting in ------------------------------------------------------------------------------

    def grow(self, count: int | None = None) -> int:
        """Fault in up to ``count`` more slots (default: ``GROW_BYTES`` worth) and make them
        free; returns how many. Runs with the GIL released, so the loop keeps answering."""
        if count is None:
            count = max(1, GROW_BYTES // self.slot_bytes)
        with self.lock:
            start = self._faulted
            stop = min(self.capacity, start + count)
            if stop <= start or self._retired or self._growth_stopped:
                return 0
            self._faulting = True
        made: list[ArenaSlot] = []
        try:
            _fault_in(self.base + start * self.slot_bytes, (stop - start) * self.slot_bytes)
            made = [ArenaSlot(self, i, self.memory[i * self.slot_bytes : i * self.slot_bytes + self.record_bytes])
                    for i in range(start, stop)]
        finally:
            with self.lock:
                self._faulting = False
                if len(made) == stop - start:
                    self._slots.extend(made)
                    self._faulted = stop
                    self._free.extend(range(start, stop))
                due = self._unmap_due()
            if due:
                self._unmap()
        return stop - start

    def stop_growing(self) -> None:
        """No more fault-in: the daemon is stopping, and faulting in gigabytes it will never use
        would hold its exit (a background fault-in runs in 256 MiB steps; the current one ends)."""
        with self.lock:
            self._growth_stopped = True

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

    def take(self, count: int, window: "ArenaWindow | None" = None) -> list[ArenaSlot] | None:
        """``count`` slots, each held once, or None when fewer are available (all or nothing).
        Free slots first, then the keeper gives up cached records (in the order of
        :mod:`.chains`)."""
        with self.lock:
            if self._retired:
                return None
            if window is not None and window.in_use + count > window.capacity:
                return None
            if count > len(self._free) + len(self._idle):
                return None
            taken = []
            for _ in range(count):
                if not self._free:
                    assert self.keeper is not None  # a cached slot has a keeper
                    self.keeper.evict_locked()
                slot = self._slots[self._free.popleft()]
                slot.refs = 1
                slot.window = window
                taken.append(slot)
            if window is not None:
                window.in_use += count
            self._held += count
        return taken

    def _release(self, slot: ArenaSlot) -> None:
        with self.lock:
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
            if slot.kept is not None:
                self._idle[slot.index] = None  # cached: evictable again
                assert self.keeper is not None
                self.keeper.idled_locked(slot)
            else:
                self._free.append(slot.index)
        if due:
            self._unmap()

    # -- what the keeper does with slots, under the lock ---------------------------------------------

    def hold_locked(self, slot: ArenaSlot) -> ArenaSlot:
        """Hold ``slot`` once more for a reader (a RAM hit): not evictable until released."""
        if slot.refs == 0:
            self._held += 1
            self._idle.pop(slot.index, None)
        slot.refs += 1
        return slot

    def keep_locked(self, slot: ArenaSlot, tag: Hashable) -> None:
        """``slot`` (held by the caller) now keeps a record; it stays cached once released."""
        slot.kept = tag

    def unkeep_locked(self, slot: ArenaSlot) -> None:
        """``slot`` keeps nothing any more; nobody holding it, it is free."""
        slot.kept = None
        if slot.refs == 0:
            del self._idle[slot.index]
            self._free.append(slot.index)

    def longest_idle_locked(self) -> ArenaSlot:
        """The cached slot nobody has held for longest (there is at least one)."""
        return self._slots[next(iter(self._idle))]

    # -- replacement --------------------------------------------------------------------------------

    def retire(self) -> None:
        """This arena is being replaced (another record size): hand out nothing more, keep no
        records, and unmap the memory as soon as no slot is held (now, if none is)."""
        with self.lock:
            self._retired = True
            if self.keeper is not None:
                self.keeper.retired_locked()
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
        """Unmap the memory of a retired arena nobody holds a slot of (outside the lock: nothing
        can take a slot of it any more). The views into it go first, so the mapping has no
        exports left; one held elsewhere (a GPU mover still pinning it until its registration
        closes) defers the unmap to the moment that last reference goes, by reference count."""
        memory = self.memory
        for hook in self.before_unmap:
            try:
                hook(memory)
            except Exception as exc:  # a tier that cannot unregister must not keep the memory
                log.warning("letting go of the replaced host pool: %s", exc)
        self.before_unmap = []
        for slot in self._slots:
            slot.view = _GONE
        with self.lock:
            self._slots = []
            self._free.clear()
            self._idle.clear()
            self._faulted = 0
        self.memory = _GONE
        del memory
        mem, self._mem = self._mem, None
        try:
            if mem is not None:
                mem.close()
        except BufferError:
            log.info("the replaced host pool is still referenced; it is unmapped when that reference goes")

    def problems(self) -> list[str]:
        """Inconsistencies between slots and lists (empty when consistent). For tests; the
        keeper adds its own (:meth:`~.ram_tier.RamTier.problems`)."""
        out = []
        with self.lock:
            free, idle = set(self._free), set(self._idle)
            if len(free) != len(self._free):
                out.append("a slot is free twice")
            for slot in self._slots[: self._faulted]:
                where = (slot.index in free) + (slot.index in idle) + (slot.refs > 0)
                if where != 1:
                    out.append(f"slot {slot.index}: free={slot.index in free} idle={slot.index in idle} "
                               f"refs={slot.refs}")
                if slot.index in idle and slot.kept is None:
                    out.append(f"slot {slot.index} is cached without a record")
            if self._held != sum(1 for slot in self._slots if slot.refs > 0):
                out.append(f"{self._held} slots counted held, {sum(1 for s in self._slots if s.refs > 0)} are")
        return out


class ArenaWindow:
    """A bounded share of an arena for one use (swap_out's write staging, swap_in's read
    staging): at most ``capacity`` slots taken and still held, counted until their last holder
    lets go, so ``busy`` still means "write staging is full". Offers what the swap pipeline asks
    of staging (``try_take``, ``free``, ``in_use``)."""

    def __init__(self, arena: HostArena, name: str, capacity: int) -> None:
        self._arena = arena
        self.name = name
        self.capacity = capacity
        self.in_use = 0  # changed under the arena's lock

    @property
    def record_bytes(self) -> int:
        return self._arena.record_bytes

    @property
    def slot_bytes(self) -> int:
        return self._arena.slot_bytes

    @property
    def free(self) -> int:
        return max(0, min(self.capacity - self.in_use, self._arena.available))

    def try_take(self, count: int) -> list[ArenaSlot] | None:
        return self._arena.take(count, self)

    def close(self) -> None:
        pass  # the arena's memory goes with HostArena.retire, once no slot of it is held
