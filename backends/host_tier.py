"""The host tier: records in the daemon's RAM, within a byte budget, prefix chains kept whole.

One budget (``capacity_bytes``) covers every namespace the daemon serves: the backend owns one
map of ``(namespace, key) -> record bytes`` with one eviction order over all of them (the rule
of :mod:`.chains`: stranded records first, then the least recent record no other record
follows), and each store is a view of its namespace.
A record is kept whole — header and payload, the bytes a record file holds — so a read is
verified exactly like a file, and ``bytes`` counts header + payload.

A put that would go over the budget evicts records (of any namespace) in that order until the
new one fits; a record larger than the whole budget is refused with ``NoSpace``, and so is a
swap_out's record whose predecessor was evicted (it would be unreachable). Reads
(``get_into``) make a record most recently used; ``contains`` does not: a lookup or swap_in
touches its hit prefix as a whole (:meth:`HostStore.touch_chain`), head newest. Encoding and checksums run outside the lock; the lock only guards
the dictionary and the byte count, so ``used_bytes <= capacity_bytes`` holds at every instant.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Container, Iterable, Sequence

from kvswap.protocol.errors import Corrupt, NoSpace

from . import record
from .base import Backend, GetStatus, Store
from .chains import ChainOrder

log = logging.getLogger(__name__)


class HostBackend(Backend):
    tier = "host"

    def __init__(self, capacity_bytes: int, eviction: str = "chain") -> None:
        if capacity_bytes <= 0:
            raise ValueError("host tier capacity must be a positive number of bytes")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        # (namespace, key) -> whole record; the order says which goes first.
        self._entries: dict[tuple[str, str], bytes] = {}
        # Eviction order (:data:`.chains.POLICIES`); "lru" only to measure against.
        self._order: ChainOrder[tuple[str, str]] = ChainOrder(eviction)
        self._used = 0
        self._stores: dict[str, HostStore] = {}
        #: Records evicted to make room, all namespaces.
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def records(self) -> int:
        return len(self._entries)

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> "HostStore":
        with self._lock:
            store = self._stores.get(namespace)
            if store is None:
                store = self._stores[namespace] = HostStore(self, namespace, record_bytes)
            elif store.record_bytes != record_bytes:
                raise ValueError(f"namespace {namespace} holds {store.record_bytes}-byte records, not {record_bytes}")
            return store

    def problems(self) -> list[str]:
        """Compare the byte count and per-namespace counts with the entries; return the
        mismatches (empty when consistent). For stress tests."""
        problems = []
        with self._lock:
            total = sum(len(v) for v in self._entries.values())
            if total != self._used:
                problems.append(f"used_bytes {self._used} != sum of records {total}")
            if self._used > self.capacity_bytes:
                problems.append(f"used_bytes {self._used} > capacity {self.capacity_bytes}")
            if len(self._order) != len(self._entries) or any(e not in self._order for e in self._entries):
                problems.append(f"eviction order knows {len(self._order)} records, the tier holds {len(self._entries)}")
            for ns, store in self._stores.items():
                n = sum(1 for (entry_ns, _) in self._entries if entry_ns == ns)
                b = sum(len(v) for (entry_ns, _), v in self._entries.items() if entry_ns == ns)
                if (n, b) != (store._records, store._bytes):
                    problems.append(f"namespace {ns}: counted {store._records}/{store._bytes}, holds {n}/{b}")
        return problems

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._order.clear()
            self._used = 0
            for store in self._stores.values():
                store._records = store._bytes = 0

    # -- under self._lock -------------------------------------------------------------------------

    def _insert(self, namespace: str, key: str, data: bytes) -> None:
        """Store ``data`` (most recent, or with the stamp its chain reserved), evicting to make
        room."""
        size = len(data)
        entry = (namespace, key)
        if size > self.capacity_bytes:
            self._order.release(entry)
            raise NoSpace("record larger than the host tier", size=size, capacity=self.capacity_bytes)
        if self._order.orphaned(entry):
            self._order.release(entry)
            self._stores[namespace].chain_refused += 1
            raise _chain_broken(key)
        old = self._entries.get(entry)
        if old is not None and len(old) == size:  # a replaced record keeps its links; just touched
            self._entries[entry] = data
            self._order.add(entry)
            return
        if old is not None:
            self._remove(namespace, key)
        while self._used + size > self.capacity_bytes:
            victim = self._order.victim()
            assert victim is not None, "the budget is used by records the order does not know"
            self._remove(*victim)
            self.evictions += 1
            self._stores[victim[0]].evictions += 1
        self._entries[entry] = data
        self._account(namespace, 1, size)
        self._order.add(entry)
        if self._order.is_stranded(entry):
            # Its predecessor was evicted to make room for it: nothing could reach it.
            self._remove(namespace, key)
            self._stores[namespace].chain_refused += 1
            raise _chain_broken(key)

    def _remove(self, namespace: str, key: str, expected: bytes | None = None) -> bool:
        entry = (namespace, key)
        data = self._entries.get(entry)
        if data is None or (expected is not None and data is not expected):
            return False
        del self._entries[entry]
        self._order.remove(entry)
        self._account(namespace, -1, -len(data))
        return True

    def _account(self, namespace: str, records: int, nbytes: int) -> None:
        self._used += nbytes
        store = self._stores[namespace]
        store._records += records
        store._bytes += nbytes


class HostStore(Store):
    """One namespace's view of the host tier. Counters: ``hits``, ``misses``, ``evictions``
    (this namespace's records evicted for room), ``corrupt``."""

    tier = "host"

    def __init__(self, backend: HostBackend, namespace: str, record_bytes: int) -> None:
        self.backend = backend
        self.namespace = namespace
        self.namespace_bytes = bytes.fromhex(namespace)
        self.record_bytes = record_bytes
        self.stored_bytes = record.header_len_for(record_bytes) + record_bytes
        self._records = 0
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.corrupt = 0
        #: swap_out records refused because their predecessor was evicted.
        self.chain_refused = 0

    def _encode(self, key: str, payload: memoryview) -> bytes:
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        return record.encode_record(self.namespace_bytes, key, payload)

    def put(self, key: str, payload: memoryview) -> int:
        data = self._encode(key, payload)
        with self.backend._lock:
            self.backend._insert(self.namespace, key, data)
        return len(data)

    def put_many(self, items: Iterable[tuple[str, memoryview]]) -> list[int]:
        encoded = [(key, self._encode(key, payload)) for key, payload in items]
        with self.backend._lock:
            for key, data in encoded:
                self.backend._insert(self.namespace, key, data)
        return [len(data) for _, data in encoded]

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        entry = (self.namespace, key)
        with self.backend._lock:
            data = self.backend._entries.get(entry)
            if data is None:
                self.misses += 1
                return GetStatus.MISS
            self.backend._order.add(entry)
        try:
            payload = record.decode_record(data, self.namespace_bytes, key)
            if len(payload) != len(out):
                raise Corrupt("payload length differs from the namespace's record size", got=len(payload))
        except Corrupt as exc:
            log.warning("corrupt host-tier record for key %s: %s; removing it", key, exc.message)
            with self.backend._lock:
                # Only the bytes we read: a put may have replaced them meanwhile.
                self.backend._remove(self.namespace, key, expected=data)
                self.corrupt += 1
            return GetStatus.CORRUPT
        out[:] = payload
        with self.backend._lock:
            self.hits += 1
        return GetStatus.LOADED

    def get_many(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[GetStatus]:
        return [self.get_into(key, out) for key, out in zip(keys, outs)]

    def contains(self, key: str) -> bool:
        return (self.namespace, key) in self.backend._entries

    def contains_prefix(self, keys: Sequence[str]) -> int:
        with self.backend._lock:
            for i, key in enumerate(keys):
                if (self.namespace, key) not in self.backend._entries:
                    return i
        return len(keys)

    def cached_prefix(self, keys: Sequence[str], also_present: Container[str] = ()) -> int:
        """RAM is the whole tier, so this is :meth:`contains_prefix` (no I/O either way)."""
        entries = self.backend._entries
        with self.backend._lock:
            for i, key in enumerate(keys):
                if (self.namespace, key) not in entries and key not in also_present:
                    return i
        return len(keys)

    def expect_chain(self, keys: Sequence[str]) -> None:
        """A swap_out is about to write ``keys``, one chain head first: the tail gets the
        oldest stamp (see :mod:`.chains`)."""
        with self.backend._lock:
            self.backend._order.chain([(self.namespace, key) for key in keys], reserve=True)

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """A hit prefix, touched as a whole, head newest (RAM has nothing to persist)."""
        with self.backend._lock:
            self.backend._order.chain([(self.namespace, key) for key in keys])

    def unreachable(self) -> int:
        """Records of this namespace no lookup can reach in this tier alone."""
        with self.backend._lock:
            return self.backend._order.unreachable(lambda entry: entry[0] == self.namespace)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.usage())
        with self.backend._lock:
            out.update(hits=self.hits, misses=self.misses, evictions=self.evictions, corrupt=self.corrupt,
                       evicted_capacity=self.evictions, chain_refused=self.chain_refused)
        out["unreachable"] = self.unreachable()
        return out

    def delete(self, key: str) -> bool:
        with self.backend._lock:
            return self.backend._remove(self.namespace, key)

    def delete_many(self, keys: Iterable[str]) -> int:
        with self.backend._lock:
            return sum(1 for key in keys if self.backend._remove(self.namespace, key))

    def clear(self) -> int:
        with self.backend._lock:
            mine = [key for (ns, key) in self.backend._entries if ns == self.namespace]
            for key in mine:
                self.backend._remove(self.namespace, key)
        return len(mine)

    def usage(self) -> dict[str, int]:
        with self.backend._lock:
            return {"records": self._records, "bytes": self._bytes}


def _chain_broken(key: str) -> NoSpace:
    return NoSpace("the record before this one in its chain was evicted; storing it would waste the space",
                   key=key, tier="host")
