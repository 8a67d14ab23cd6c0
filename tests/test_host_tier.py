"""The host tier (kvswap.backends.host_tier): records in RAM under one byte budget, least
recently used out. Byte-exact round trips, LRU order, the budget as an invariant (also under
concurrent writers), verification of what is read, namespaces sharing one budget."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from kvswap.backends import record
from kvswap.backends.base import GetStatus
from kvswap.backends.host_tier import HostBackend
from kvswap.protocol.errors import NoSpace

RECORD_BYTES = 1000
STORED = record.SMALL_HEADER + RECORD_BYTES  # 1256: header + payload is what the budget counts
NS_A = "aa" * 16
NS_B = "bb" * 16


def payload(seed: int, size: int = RECORD_BYTES) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).tobytes())


def out_buffer(size: int = RECORD_BYTES) -> memoryview:
    return memoryview(bytearray(b"\xee" * size))


def test_round_trip_counts_header_and_payload():
    store = HostBackend(10 * STORED).open_store(NS_A, {}, RECORD_BYTES)
    assert store.put("k0", payload(0)) == STORED
    assert store.put_many([("k1", payload(1)), ("k2", payload(2))]) == [STORED, STORED]
    out = out_buffer()
    assert store.get_into("k1", out) is GetStatus.LOADED and bytes(out) == bytes(payload(1))
    assert store.get_into("nope", out) is GetStatus.MISS and bytes(out) == bytes(payload(1))
    assert store.usage() == {"records": 3, "bytes": 3 * STORED}
    assert (store.hits, store.misses, store.evictions) == (1, 1, 0)
    assert store.contains_prefix(["k0", "k1", "x", "k2"]) == 2
    assert store.cached_prefix(["k0", "k1", "x", "k2"]) == 2
    assert store.cached_prefix(["k0", "k1", "x", "k2"], also_present={"x"}) == 4
    outs = [out_buffer() for _ in range(3)]
    assert store.get_many(["k2", "k0", "x"], outs) == [GetStatus.LOADED, GetStatus.LOADED, GetStatus.MISS]
    assert [bytes(o) for o in outs[:2]] == [bytes(payload(2)), bytes(payload(0))]


def test_a_replaced_key_is_counted_once():
    backend = HostBackend(10 * STORED)
    store = backend.open_store(NS_A, {}, RECORD_BYTES)
    store.put("k", payload(0))
    store.put("k", payload(1))
    out = out_buffer()
    assert store.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(payload(1))
    assert store.usage() == {"records": 1, "bytes": STORED} and backend.used_bytes == STORED
    assert backend.problems() == []


def test_least_recently_used_goes_first_and_lookups_do_not_refresh():
    backend = HostBackend(3 * STORED)
    store = backend.open_store(NS_A, {}, RECORD_BYTES)
    for i, key in enumerate("abc"):
        store.put(key, payload(i))
    assert store.get_into("a", out_buffer()) is GetStatus.LOADED  # a is now the most recent
    store.put("d", payload(3))
    assert [store.contains(k) for k in "abcd"] == [True, False, True, True]  # b went
    assert store.contains("c")  # a lookup does not make c recent...
    store.put("e", payload(4))
    assert [store.contains(k) for k in "acde"] == [True, False, True, True]  # ...so c went next
    assert (store.evictions, backend.evictions) == (2, 2)
    assert backend.used_bytes == 3 * STORED <= backend.capacity_bytes
    out = out_buffer()
    assert store.get_into("a", out) is GetStatus.LOADED and bytes(out) == bytes(payload(0))


def test_budget_holds_after_every_put_and_too_big_is_refused():
    backend = HostBackend(5 * STORED + 100)  # room for five, not six
    store = backend.open_store(NS_A, {}, RECORD_BYTES)
    for i in range(20):
        store.put(f"k{i}", payload(i))
        assert backend.used_bytes <= backend.capacity_bytes
    assert store.usage()["records"] == 5 and store.evictions == 15
    assert store.contains_prefix([f"k{i}" for i in range(15, 20)]) == 5

    tiny = HostBackend(STORED - 1)
    big = tiny.open_store(NS_A, {}, RECORD_BYTES)
    with pytest.raises(NoSpace) as info:
        big.put("k", payload(0))
    assert info.value.details == {"size": STORED, "capacity": STORED - 1}
    assert (tiny.used_bytes, tiny.evictions, big.contains("k")) == (0, 0, False)


def test_namespaces_share_the_budget_but_not_their_records():
    backend = HostBackend(4 * STORED)
    a = backend.open_store(NS_A, {}, RECORD_BYTES)
    b = backend.open_store(NS_B, {}, RECORD_BYTES)
    assert backend.open_store(NS_A, {}, RECORD_BYTES) is a
    a.put("k", payload(1))
    b.put("k", payload(2))
    out = out_buffer()
    assert a.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(payload(1))
    assert b.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(payload(2))
    b.put_many([(f"b{i}", payload(10 + i)) for i in range(3)])  # pushes a's record out
    assert (a.contains("k"), a.evictions, b.evictions) == (False, 1, 0)
    assert b.clear() == 4 and a.usage() == {"records": 0, "bytes": 0}
    a.put_many([("x", payload(3)), ("y", payload(4))])
    b.put("x", payload(5))
    assert (a.delete("x"), a.delete("x"), b.contains("x")) == (True, False, True)
    assert a.delete_many(["y", "zz"]) == 1
    assert backend.problems() == []


def test_a_damaged_record_is_corrupt_and_dropped():
    backend = HostBackend(10 * STORED)
    store = backend.open_store(NS_A, {}, RECORD_BYTES)
    store.put("k", payload(0))
    damaged = bytearray(backend._entries[(NS_A, "k")])
    damaged[-1] ^= 0x80  # bit rot in the payload
    backend._entries[(NS_A, "k")] = bytes(damaged)
    assert store.get_into("k", out_buffer()) is GetStatus.CORRUPT
    assert (store.contains("k"), store.corrupt, store.usage()["records"]) == (False, 1, 0)
    assert backend.problems() == []


def test_concurrent_writers_readers_and_deleters_keep_the_invariants():
    capacity = 40 * STORED + 2 * (record.SMALL_HEADER + 300)
    backend = HostBackend(capacity)
    small = backend.open_store(NS_B, {}, 300)  # a second record size in the same budget
    big = backend.open_store(NS_A, {}, RECORD_BYTES)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        try:
            for i in range(300):
                n = rng.randrange(80)
                store, size = (big, RECORD_BYTES) if n % 3 else (small, 300)
                key = f"k{n}"
                action = rng.random()
                if action < 0.5:
                    store.put(key, payload(n, size))
                elif action < 0.9:
                    out = out_buffer(size)
                    status = store.get_into(key, out)
                    # Every writer stores the same bytes for a key, so any hit is exactly them.
                    assert status is GetStatus.MISS or bytes(out) == bytes(payload(n, size)), status
                else:
                    store.delete(key)
                assert backend.used_bytes <= capacity
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert backend.problems() == []
    assert backend.used_bytes <= capacity and backend.evictions > 0
    assert big.usage()["records"] + small.usage()["records"] == backend.records
    assert big.corrupt == small.corrupt == 0
    for store, size in ((big, RECORD_BYTES), (small, 300)):
        for (ns, key) in [e for e in list(backend._entries) if e[0] == store.namespace]:
            out = out_buffer(size)
            assert store.get_into(key, out) is GetStatus.LOADED
            assert bytes(out) == bytes(payload(int(key[1:]), size))
