"""Which record to evict next when records form prefix chains: the one eviction rule of the
host tier and the file tier.

Keys form chains (key i hashes key i-1 and block i's tokens) and ``lookup`` counts leading
keys, so a record is reachable only while every record before it in its chain is stored. Plain
LRU breaks that: a swap_out writes a chain head first, so the head is the oldest record and
goes first, leaving a tail no lookup can reach (issue 14: a 40-block chain under a 3 MB cap
kept 20 records and a lookup hit 0). The rule here:

1. **Recency by chain.** A chain named by a request (a swap_out's keys, a lookup's or swap_in's
   hit prefix) is stamped as a whole, head newest and tail oldest (the order vLLM's prefix cache
   frees blocks in), and newer than everything stamped before.
2. **Leaves only.** The victim is the least recent stored record that no stored record
   follows. Evicting it never strands a successor, so a tail always goes before its head, even
   when a later request extended an older chain.
3. **Stranded first.** A stored record whose known predecessor is neither stored nor about to
   be (a crash mid-write, another daemon's delete, a failed write) is unreachable: it is
   evicted before any reachable record.
4. **No new strays.** A record whose predecessor was evicted is not worth writing:
   :meth:`ChainOrder.orphaned` tells the store to refuse it (a chain longer than the whole
   cap keeps its head, not a head plus a stray tail record).

Links (which record follows which) are learned from the ordered key lists of requests; they
live in memory only. After a restart every record is its own root again, ordered by the
recency its file's mtime kept (the stamps are wall-clock nanoseconds so that they can be
mtimes), and links come back as requests name their chains again.

Stamps and links are per name; a name is whatever the owner uses (a record file name, a
``(namespace, key)`` pair). Not thread-safe: the owner holds its lock around every call.

Worked example: a swap_out of ``[a, b, c]`` then a swap_out of ``[c, d]`` (``c`` exists)::

    stamps  a=3 b=2 c=1, then c=6 d=5     links  a <- b <- c <- d
    leaves  d only                        victims in order: d, c, b, a
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from typing import Callable, Final, Generic, Hashable, Iterable, Sequence, TypeVar

from kvswap.protocol.errors import NoSpace

N = TypeVar("N", bound=Hashable)

#: The eviction orders a store can be built with: "chain" (this module's rule) and "lru", the
#: order before it (every put or read is the most recent; a lookup touches its keys head first,
#: so the tail ends newest; no links), kept for benchmarks/prefix_replay.py to compare against.
POLICIES: Final = ("chain", "lru")

#: Stamps handed to records a swap_out is about to write, kept until their put (or until this
#: many newer ones were handed out: a write that never happens must not hold memory forever).
RESERVED_LIMIT: Final = 1 << 16


class Children(Generic[N]):
    """name -> the names whose predecessor it is. Most records have one successor: it is kept
    as itself, in a dict of names to names, which the cyclic GC does not walk (a dict of
    untracked objects is untracked); only a branch point (two or more) keeps a set. One set per
    record made a million chained records a million objects for the GC: a full collection
    took 220 ms, the daemon's every thread stopped meanwhile, and each set cost about 200 bytes
    (issue 27).

        c = Children(); c.add("a", "b"); c.add("a", "c")
        sorted(c.of("a")) == ["b", "c"] and c.of("b") == ()
    """

    __slots__ = ("_one", "_many")

    def __init__(self) -> None:
        self._one: dict[N, N] = {}
        self._many: dict[N, set[N]] = {}

    def of(self, parent: N) -> tuple[N, ...] | set[N]:
        """``parent``'s successors (empty when none)."""
        if parent in self._one:
            return (self._one[parent],)
        return self._many.get(parent, ())

    def has(self, parent: N) -> bool:
        return parent in self._one or parent in self._many

    def add(self, parent: N, child: N) -> None:
        many = self._many.get(parent)
        if many is not None:
            many.add(child)
        elif parent not in self._one:
            self._one[parent] = child
        elif self._one[parent] != child:
            self._many[parent] = {self._one.pop(parent), child}

    def discard(self, parent: N, child: N) -> bool:
        """Forget that ``child`` follows ``parent``; True when ``parent`` had ``child`` and has
        no successor left."""
        if parent in self._one:
            if self._one[parent] != child:
                return False
            del self._one[parent]
            return True
        many = self._many.get(parent)
        if many is None or child not in many:
            return False
        many.discard(child)
        if len(many) == 1:
            self._one[parent] = many.pop()
            del self._many[parent]
        return False

    def clear(self) -> None:
        self._one.clear()
        self._many.clear()

    def __eq__(self, other: object) -> bool:
        # One form for one map: a single successor is always in _one, two or more in _many.
        return isinstance(other, Children) and self._one == other._one and self._many == other._many

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Children({ {**self._one, **self._many} })"


def chain_broken(key: str, tier: str) -> NoSpace:
    """The refusal of a record whose predecessor in its chain is gone (both tiers answer it)."""
    return NoSpace("the record before this one in its chain was evicted; storing it would waste the space",
                   key=key, tier=tier)


class ChainOrder(Generic[N]):
    """Recency stamps, predecessor links and the eviction order derived from them."""

    def __init__(self, policy: str = "chain", clock: Callable[[], int] = time.time_ns) -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._clock = clock
        self._last = 0
        #: stored name -> stamp (larger is more recent).
        self._stamp: dict[N, int] = {}
        #: name -> its predecessor, for stored and reserved names.
        self._parent: dict[N, N] = {}
        #: name -> stored names whose predecessor it is (kept while any is stored, even when
        #: the name itself is not: then they are stranded).
        self._children: Children[N] = Children()
        #: stored names whose predecessor is known and neither stored nor reserved.
        self._stranded: dict[N, None] = {}
        #: names about to be written -> the stamp their chain gave them.
        self._reserved: OrderedDict[N, int] = OrderedDict()
        #: (stamp, name) of eviction candidates; entries whose stamp changed or that gained a
        #: child are stale and skipped when popped.
        self._heap: list[tuple[int, N]] = []
        #: The heap lacks the records of a bulk load (merge_older): rebuilt before it is used.
        self._heap_stale = False

    # -- reading -------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._stamp

    def __len__(self) -> int:
        return len(self._stamp)

    def stamp(self, name: N) -> int | None:
        return self._stamp.get(name)

    @property
    def stranded(self) -> int:
        """Stored records whose predecessor is known to be gone."""
        return len(self._stranded)

    def unreachable(self, where: Callable[[N], bool] = lambda name: True) -> int:
        """Stored records (those ``where`` accepts) no lookup can reach: the stranded ones and
        every stored record after them. Walks only those records, so it costs nothing while
        there are none."""
        seen: set[N] = set()
        todo = list(self._stranded)
        while todo:
            name = todo.pop()
            if name in seen or name not in self._stamp:
                continue
            seen.add(name)
            todo.extend(self._children.of(name))
        return sum(1 for name in seen if where(name))

    def is_stranded(self, name: N) -> bool:
        return name in self._stranded

    def orphaned(self, name: N) -> bool:
        """Whether a swap_out should not write ``name``: it was named in a chain (it holds a
        reserved stamp) and its predecessor is stranded, or neither stored nor about to be
        written. Records stored for other reasons (promotion into the host tier) are written
        whatever their predecessor: their chain may live in another tier."""
        if name not in self._reserved:
            return False
        parent = self._parent.get(name)
        if parent is None:
            return False
        return parent in self._stranded or (parent not in self._stamp and parent not in self._reserved)

    def upcoming_stamp(self, name: N) -> int:
        """The stamp ``name`` will get when it is added: the one its chain reserved, else a
        fresh one (so a file can be given its mtime before the index learns of it)."""
        reserved = self._reserved.get(name)
        return reserved if reserved is not None else self._next(1)

    # -- changes -------------------------------------------------------------------------------

    def add(self, name: N, stamp: int | None = None) -> int:
        """``name`` is stored (written, read, or found on disk); returns its stamp. Without a
        ``stamp``, a record a chain reserved one for takes that, any other becomes the most
        recent."""
        reserved = self._reserved.pop(name, None)
        if stamp is None:
            stamp = reserved if reserved is not None else self._next(1)
        new = name not in self._stamp
        self._stamp[name] = stamp
        if new:
            parent = self._parent.get(name)
            if parent is not None:
                self._children.add(parent, name)
                if parent not in self._stamp and parent not in self._reserved:
                    self._stranded[name] = None
            for child in self._children.of(name):
                self._stranded.pop(child, None)
        if not self._children.has(name):
            heapq.heappush(self._heap, (stamp, name))
        self._compact()
        return stamp

    def remove(self, name: N) -> bool:
        """``name`` is no longer stored (evicted, deleted, corrupt, vanished)."""
        if self._stamp.pop(name, None) is None:
            return False
        self._stranded.pop(name, None)
        parent = self._parent.get(name)
        if name not in self._reserved:
            self._parent.pop(name, None)
        if parent is not None:
            self._unchild(parent, name)
        if name not in self._reserved:
            for child in self._children.of(name):
                self._stranded[child] = None
        return True

    def release(self, name: N) -> None:
        """A reserved record will not be written after all (its write failed or was refused):
        records already stored after it are stranded."""
        if self._reserved.pop(name, None) is None or name in self._stamp:
            return
        self._parent.pop(name, None)
        for child in self._children.of(name):
            self._stranded[child] = None

    def clear(self) -> None:
        self._stamp.clear()
        self._parent.clear()
        self._children.clear()
        self._stranded.clear()
        self._reserved.clear()
        self._heap.clear()
        self._heap_stale = False

    def chain(self, names: Sequence[N], reserve: bool = False) -> list[tuple[N, int]]:
        """``names`` are one chain, head first (``names[i]`` follows ``names[i-1]``). Learn the
        links, and stamp the chain as a whole, head newest, newer than anything before. Stored
        names are touched; with ``reserve`` (a swap_out about to write them) the others keep
        their stamp for their put. Returns the stored names touched, with their new stamps."""
        if self.policy == "lru":
            return [] if reserve else [(name, self.add(name)) for name in names if name in self._stamp]
        base = self._next(len(names))
        touched = []
        for i, name in enumerate(names):
            stamp = base + len(names) - 1 - i
            if name in self._stamp:
                self._stamp[name] = stamp
                if not self._children.has(name):
                    heapq.heappush(self._heap, (stamp, name))
                touched.append((name, stamp))
            elif reserve:
                self._reserved[name] = stamp
                self._reserved.move_to_end(name)
                # About to be written: what is stored after it is reachable again (issue 22).
                for child in self._children.of(name):
                    self._stranded.pop(child, None)
        while len(self._reserved) > RESERVED_LIMIT:
            self.release(next(iter(self._reserved)))
        for parent, child in zip(names, names[1:]):
            if child != parent and (child in self._stamp or child in self._reserved):
                self._link(child, parent)
        self._compact()
        return touched

    def merge_older(self, found: Iterable[tuple[N, int]]) -> int:
        """Add names found on disk with their mtimes as stamps, all older than every name
        already known (those were used since the scan began), in their own order. Returns how
        many were new."""
        if not self._stamp and not self._parent and not self._reserved:
            # A start-up load into an empty order: no links to learn, so the stamps and the
            # heap are built whole (1M records in ~0.5 s, against ~3 s one add at a time).
            self._stamp = dict(found)
            if not self._stamp:
                return 0
            # The heap is built by the first eviction (_compact on a stale heap), off the path
            # that is waiting for the load: a million entries take ~0.6 s to heapify.
            self._heap = []
            self._heap_stale = True
            self._last = max(self._last, max(self._stamp.values()))
            return len(self._stamp)
        new = [(name, stamp) for name, stamp in found if name not in self._stamp]
        if not new:
            return 0
        floor = min(self._stamp.values(), default=None)
        top = max(stamp for _, stamp in new)
        shift = top - floor + 1 if floor is not None and top >= floor else 0
        for name, stamp in new:
            self.add(name, stamp - shift)
        return len(new)

    def stranded_victim(self, skip: Callable[[N], bool] = lambda name: False) -> N | None:
        """A stranded record ``skip`` does not reject, or None. Looks at the stranded records
        only, never the heap: a refused write calls it once per record, under its store's lock
        (scanning the leaves there cost 65 ms a record at 40k records, issue 22). Dropping a
        chain's stranded records one by one walks the chain: removing one strands the next."""
        for name in self._stranded:
            if not skip(name):
                return name
        return None

    def victim(self, skip: Callable[[N], bool] = lambda name: False) -> N | None:
        """The record to evict next, or None when every candidate is skipped (pinned). The
        caller removes it."""
        for name in self._stranded:
            if not skip(name):
                return name
        if self._heap_stale:
            self._rebuild_heap()
        held = []
        found = None
        while self._heap:
            stamp, name = heapq.heappop(self._heap)
            if self._stamp.get(name) != stamp or self._children.has(name):
                continue  # stale: touched since, removed, or no longer a leaf
            held.append((stamp, name))
            if not skip(name):
                found = name
                break
        for entry in held:
            heapq.heappush(self._heap, entry)
        if found is not None or held:
            return found  # held but none found: every leaf is pinned; evicting an inner record would strand
        # No leaf at all: links that loop (keys that are not a real chain). Fall back to LRU.
        candidates = [(stamp, name) for name, stamp in self._stamp.items() if not skip(name)]
        return min(candidates, key=lambda c: c[0])[1] if candidates else None

    # -- internals -------------------------------------------------------------------------

    def _next(self, count: int) -> int:
        """The first of ``count`` fresh stamps: wall-clock nanoseconds (so a stamp can be a
        file's mtime), never going back."""
        base = max(self._last + 1, self._clock())
        self._last = base + count - 1
        return base

    def _link(self, child: N, parent: N) -> None:
        old = self._parent.get(child)
        if old == parent:
            return
        self._parent[child] = parent
        if child not in self._stamp:
            return
        if old is not None:
            self._unchild(old, child)
        self._children.add(parent, child)
        if parent in self._stamp or parent in self._reserved:
            self._stranded.pop(child, None)
        else:
            self._stranded[child] = None

    def _unchild(self, parent: N, child: N) -> None:
        if self._children.discard(parent, child):
            stamp = self._stamp.get(parent)
            if stamp is not None:
                heapq.heappush(self._heap, (stamp, parent))  # a leaf again

    def _compact(self) -> None:
        """Stale heap entries pile up with every touch; rebuild when they outnumber the live."""
        if len(self._heap) > 2 * len(self._stamp) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(s, n) for n, s in self._stamp.items() if not self._children.has(n)]
        heapq.heapify(self._heap)
        self._heap_stale = False
