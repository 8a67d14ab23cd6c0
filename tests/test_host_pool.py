"""The host arena and the RAM tier in it: staging slots and cached records in one arena, with
reference counts.

Units on the arena and the tier (byte literals, counts, an invariant check after random
operations) and a real daemon showing the RAM tier serving from the slot a swap_out gathered
into."""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvswap.backends.base import GetStatus
from kvswap.backends.host_arena import ArenaWindow, HostArena
from kvswap.backends.ram_tier import RamBackend, RamTier
from kvswap.protocol import Client, HostKVCache
from kvswap.protocol.errors import NoSpace
from disk_records import LAYOUTS, GatedRecordWrites, records_on_disk
from support import DaemonProcess, free_port

NS = "00" * 16


def fill(slot, byte: int) -> None:
    slot.view[:] = byte


def ram_over(record_bytes: int, staging_slots: int, cache_slots: int = 0) -> tuple[HostArena, RamTier]:
    """An arena and the RAM tier made with it."""
    arena = HostArena(record_bytes, staging_slots, cache_slots)
    return arena, RamTier(arena)


def test_slots_are_aligned_faulted_and_taken_all_or_nothing() -> None:
    pool = HostArena(5000, staging_slots=3, cache_slots=0)
    assert pool.slot_bytes == 8192 and pool.faulted == 3
    slots = pool.take(2)
    assert [s.view.ctypes.data % 4096 for s in slots] == [0, 0]
    assert all(s.view.nbytes == 5000 for s in slots)
    assert pool.take(2) is None  # one left: all or nothing
    assert pool.available == 1
    slots[0].release()
    assert pool.available == 2
    with pytest.raises(RuntimeError):
        slots[0].release()
    assert pool.problems() == []


def test_slot_objects_are_made_as_their_memory_is_faulted_in_each_over_its_own_bytes() -> None:
    pool = HostArena(100, staging_slots=2, cache_slots=50_000)
    assert pool.faulted == 2 and len(pool._slots) == 2  # the cache share: none made before its fault-in
    assert pool.grow(5) == 5 and pool.faulted == 7 and len(pool._slots) == 7
    assert pool.grow_all() == 50_000 - 5 and len(pool._slots) == pool.capacity == 50_002
    assert [slot.index for slot in pool._slots[:3]] == [0, 1, 2]
    assert all(slot.view.ctypes.data == pool.base + slot.index * pool.slot_bytes and slot.view.nbytes == 100
               for slot in pool._slots[::997])
    taken = pool.take(50_002)
    assert taken is not None and len({s.index for s in taken}) == 50_002
    for slot in taken:
        slot.release()
    assert pool.problems() == []


def test_a_kept_slot_is_the_ram_copy_until_a_take_needs_it() -> None:
    pool, ram = ram_over(4096, staging_slots=2)
    a, b = pool.take(2)
    fill(a, 0xA1)
    fill(b, 0xB2)
    ram.keep(a, NS, "ka")
    ram.keep(b, NS, "kb")
    a.release()
    b.release()
    assert ram.records[NS] == 2 and pool.available == 2
    hit = ram.find(NS, "ka")  # ka is now the most recently used
    assert hit is a and bytes(hit.view[:2]) == b"\xa1\xa1"
    hit.release()
    (c,) = pool.take(1)  # evicts the least recently used: kb
    assert c is b and not ram.contains(NS, "kb") and ram.contains(NS, "ka")
    assert ram.evicted[NS] == 1 and ram.records[NS] == 1
    c.release()
    assert ram.problems() == []


def test_a_held_record_is_never_evicted() -> None:
    pool, ram = ram_over(4096, staging_slots=1)
    (a,) = pool.take(1)
    ram.keep(a, NS, "k")
    a.release()
    reader = ram.find(NS, "k")
    assert reader is a
    assert pool.take(1) is None  # the only slot is held by a reader
    reader.release()
    assert pool.take(1) == [a] and not ram.contains(NS, "k")


def test_windows_bound_their_share_until_the_last_holder_lets_go() -> None:
    pool, ram = ram_over(4096, staging_slots=4)
    write = ArenaWindow(pool, "write", 2)
    slots = write.try_take(2)
    assert slots is not None and write.in_use == 2 and write.free == 0
    assert write.try_take(1) is None  # the pool has room, the window has not
    ram.keep(slots[0], NS, "k")
    reader = slots[0].retain()  # a swap_in reading a record still being written
    slots[0].release()
    assert write.in_use == 2
    reader.release()
    assert write.in_use == 1  # back as a cached record, no longer the window's
    assert ram.contains(NS, "k")


def test_an_arena_has_one_ram_tier_made_with_it() -> None:
    arena, ram = ram_over(4096, staging_slots=1)
    assert arena.keeper is ram and ram.arena is arena
    with pytest.raises(ValueError):
        RamTier(arena)


def test_growth_faults_the_ram_share_only_when_asked() -> None:
    pool = HostArena(4096, staging_slots=4, cache_slots=100)
    assert pool.faulted == 4 and pool.capacity == 104
    assert not pool.wants_growth()  # free slots are plenty
    held = pool.take(4)
    assert pool.wants_growth()
    assert pool.grow(64) == 64 and pool.faulted == 68
    assert pool.grow(16) == 16 and pool.grow_all() == 20 and pool.grow(64) == 0
    for s in held:
        s.release()
    assert pool.available == 104 and pool.problems() == []


def test_put_of_a_pool_slot_keeps_it_in_place_and_a_copy_otherwise() -> None:
    backend = RamBackend(3 * 4096)
    pool = backend.make_arena(4096, staging_slots=2)
    assert pool.capacity == 2 + backend.cache_slots(4096)
    store = backend.open_store(NS, {}, 4096)
    (gathered,) = pool.take(1)
    fill(gathered, 7)
    store.put_slot("a", gathered)  # what the write thread passes
    gathered.release()
    slot = store.hold("a")
    assert slot is gathered  # zero copy: the RAM copy is the gathered slot
    slot.release()
    store.put("b", memoryview(bytes([9]) * 4096))  # not a slot: copied into one
    out = bytearray(4096)
    assert store.get_into("b", memoryview(out)).value == "loaded" and out == bytes([9]) * 4096
    assert store.get_into("c", memoryview(out)).value == "miss"
    assert store.stats()["hits"] == 2 and store.stats()["misses"] == 1
    assert store.usage() == {"records": 2, "bytes": 8192}
    assert store.cached_prefix(["a", "b", "c"]) == 2 and store.cached_prefix(["c"], {"c"}) == 1
    assert store.delete("a") and not store.contains("a")
    assert store.clear() == 1 and store.usage()["records"] == 0
    with pytest.raises(NoSpace):  # another record size: not this pool's
        backend.open_store("11" * 16, {}, 8192).put("x", memoryview(bytes(8192)))
    assert backend.problems() == []


def test_random_operations_keep_the_pool_consistent() -> None:
    rng = random.Random(3)
    pool, ram = ram_over(4096, staging_slots=6, cache_slots=10)
    window = ArenaWindow(pool, "write", 4)
    held: list = []
    for step in range(3000):
        op = rng.randrange(7)
        if op == 0:
            slots = window.try_take(rng.randint(1, 3)) if rng.random() < 0.5 else pool.take(rng.randint(1, 3))
            held.extend(slots or [])
        elif op == 1 and held:
            held.pop(rng.randrange(len(held))).release()
        elif op == 2 and held:
            ram.keep(rng.choice(held), NS, f"k{rng.randrange(12)}")
        elif op == 3:
            slot = ram.find(NS, f"k{rng.randrange(12)}")
            if slot is not None:
                held.append(slot)
        elif op == 4 and held:
            held.append(rng.choice(held).retain())
        elif op == 5:
            ram.drop(NS, f"k{rng.randrange(12)}")
        elif op == 6:
            pool.grow(rng.randint(0, 3))
        assert ram.problems() == [], step
        assert 0 <= window.in_use <= window.capacity
    for slot in held:
        slot.release()
    assert pool.available == pool.faulted and window.in_use == 0


# -- the RAM tier as a store: what the old host tier (backends/host_tier.py, gone in issue 23)
# was tested for, on the tier the daemon runs. Its checksum test has no port: a pool slot holds
# bytes gathered from the engine or verified when read from a lower tier, and is never re-read
# from anywhere a bit could rot.

STORE_NS = "aa" * 16
OTHER_NS = "bb" * 16


def ram_tier(records: int) -> tuple[RamTier, RamBackend]:
    """A RAM tier over an arena of ``records`` slots in all (one of them the staging share an
    arena must have; cached records may use it), every slot faulted in; and its backend."""
    backend = RamBackend((records - 1) * 4096)
    backend.make_arena(4096, staging_slots=1).grow_all()
    assert backend.ram is not None
    return backend.ram, backend


def record_bytes(seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, size=4096, dtype=np.uint8).tobytes())


def test_store_round_trips_and_a_miss_leaves_the_buffer_alone() -> None:
    ram, backend = ram_tier(10)
    store = backend.open_store(STORE_NS, {}, 4096)
    assert store.put("k0", record_bytes(0)) == 4096
    assert store.put_many([("k1", record_bytes(1)), ("k2", record_bytes(2))]) == [4096, 4096]
    out = memoryview(bytearray(b"\xee" * 4096))
    assert store.get_into("k1", out) is GetStatus.LOADED and bytes(out) == bytes(record_bytes(1))
    assert store.get_into("nope", out) is GetStatus.MISS and bytes(out) == bytes(record_bytes(1))
    assert store.usage() == {"records": 3, "bytes": 3 * 4096}
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 1, 0)
    assert store.contains_prefix(["k0", "k1", "x", "k2"]) == 2
    outs = [memoryview(bytearray(4096)) for _ in range(3)]
    assert store.get_many(["k2", "k0", "x"], outs) == [GetStatus.LOADED, GetStatus.LOADED, GetStatus.MISS]
    assert [bytes(o) for o in outs[:2]] == [bytes(record_bytes(2)), bytes(record_bytes(0))]
    with pytest.raises(ValueError):
        store.put("short", memoryview(bytes(4095)))
    assert not store.contains("short") and ram.problems() == []


def test_a_replaced_key_is_counted_once_and_reads_its_new_bytes() -> None:
    ram, backend = ram_tier(10)
    store = backend.open_store(STORE_NS, {}, 4096)
    store.put("k", record_bytes(0))
    store.put("k", record_bytes(1))
    out = memoryview(bytearray(4096))
    assert store.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(record_bytes(1))
    assert store.usage() == {"records": 1, "bytes": 4096} and ram.records[STORE_NS] == 1
    assert ram.arena.available == ram.arena.capacity and ram.problems() == []


def test_a_read_makes_a_record_recent_and_a_contains_does_not() -> None:
    """Records no chain links are all leaves: the least recent goes first. The daemon's lookup
    touches its hit prefix explicitly (touch_chain); a bare ``contains`` must not."""
    ram, backend = ram_tier(3)
    store = backend.open_store(STORE_NS, {}, 4096)
    for i, key in enumerate("abc"):
        store.put(key, record_bytes(i))
    assert store.get_into("a", memoryview(bytearray(4096))) is GetStatus.LOADED  # a: most recent
    store.put("d", record_bytes(3))
    assert [store.contains(k) for k in "abcd"] == [True, False, True, True]  # b went
    assert store.contains("c")  # a lookup's contains does not make c recent...
    store.put("e", record_bytes(4))
    assert [store.contains(k) for k in "acde"] == [True, False, True, True]  # ...so c went next
    assert store.stats()["evictions"] == 2 and ram.records[STORE_NS] == 3
    out = memoryview(bytearray(4096))
    assert store.get_into("a", out) is GetStatus.LOADED and bytes(out) == bytes(record_bytes(0))
    assert ram.problems() == []


def test_the_tier_never_holds_more_records_than_its_slots() -> None:
    ram, backend = ram_tier(5)
    store = backend.open_store(STORE_NS, {}, 4096)
    for i in range(20):
        store.put(f"k{i}", record_bytes(i))
        assert ram.records[STORE_NS] <= ram.arena.capacity
    assert store.usage()["records"] == 5 and store.stats()["evictions"] == 15
    assert store.contains_prefix([f"k{i}" for i in range(15, 20)]) == 5
    assert ram.problems() == []


def test_namespaces_share_the_pool_but_not_their_records() -> None:
    ram, backend = ram_tier(4)
    a = backend.open_store(STORE_NS, {}, 4096)
    b = backend.open_store(OTHER_NS, {}, 4096)
    assert backend.open_store(STORE_NS, {}, 4096) is a
    a.put("k", record_bytes(1))
    b.put("k", record_bytes(2))
    out = memoryview(bytearray(4096))
    assert a.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(record_bytes(1))
    assert b.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(record_bytes(2))
    b.put_many([(f"b{i}", record_bytes(10 + i)) for i in range(3)])  # pushes a's record out
    assert (a.contains("k"), a.stats()["evictions"], b.stats()["evictions"]) == (False, 1, 0)
    assert b.clear() == 4 and a.usage() == {"records": 0, "bytes": 0} and b.usage()["records"] == 0
    a.put_many([("x", record_bytes(3)), ("y", record_bytes(4))])
    b.put("x", record_bytes(5))
    assert (a.delete("x"), a.delete("x"), b.contains("x")) == (True, False, True)
    assert a.delete_many(["y", "zz"]) == 1
    assert ram.problems() == []


def test_concurrent_writers_readers_and_deleters_keep_the_pool_consistent() -> None:
    ram, backend = ram_tier(40)
    stores = [backend.open_store(STORE_NS, {}, 4096), backend.open_store(OTHER_NS, {}, 4096)]
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        try:
            for _ in range(300):
                n = rng.randrange(80)
                store, key = stores[n % 2], f"k{n}"
                action = rng.random()
                if action < 0.5:
                    try:
                        store.put(key, record_bytes(n))
                    except NoSpace:  # every slot held by readers at that instant: the tier's answer
                        pass
                elif action < 0.9:
                    out = memoryview(bytearray(4096))
                    status = store.get_into(key, out)
                    # Every writer stores the same bytes for a key, so any hit is exactly them.
                    assert status is GetStatus.MISS or bytes(out) == bytes(record_bytes(n)), status
                else:
                    store.delete(key)
                assert sum(ram.records.values()) <= ram.arena.capacity
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert ram.problems() == [] and ram.arena.available == ram.arena.capacity  # nothing left held
    assert sum(s.stats()["evictions"] for s in stores) > 0
    assert sum(s.usage()["records"] for s in stores) == sum(ram.records.values()) <= ram.arena.capacity
    for store in stores:
        for n in range(80):
            out = memoryview(bytearray(4096))
            if store.get_into(f"k{n}", out) is GetStatus.LOADED:
                assert store is stores[n % 2] and bytes(out) == bytes(record_bytes(n))


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_daemon_serves_a_ram_hit_from_the_pool_without_the_file(tmp_path: Path, cache: HostKVCache,
                                                               file_layout: str) -> None:
    """With the RAM tier on by default, a record whose file is gone (in the slab layout: whose
    slot's bytes are gone) is still served, from the slot swap_out gathered into; with
    --host-tier-bytes 0 the same swap_in finds nothing to load (a miss; a corrupt slot)."""
    for ram in (True, False):
        store = tmp_path / f"store-{ram}"
        args = ["--file-layout", file_layout] + ([] if ram else ["--host-tier-bytes", "0"])
        daemon = DaemonProcess(store, free_port(), free_port(), extra_args=args).start()
        try:
            with Client(daemon.endpoint, timeout=10) as c:
                c.register(cache)
                expected = [cache.block_record(i) for i in range(4)]
                keys = [f"r{i}" for i in range(4)]
                assert c.swap_out([0, 1, 2, 3], keys, wait="persisted").stored == 4
                on_disk = records_on_disk(store)
                assert len(on_disk) == 4
                for rec in on_disk:
                    if file_layout == "files":
                        rec.path.unlink()
                    else:  # a slot is not a file of its own: its bytes go instead
                        rec.write(0, bytes(rec.length))
                cache.fill_random(seed=99)
                result = c.swap_in(keys, [4, 5, 6, 7])
                stats = c.stats()
                if ram:
                    assert result.loaded == 4
                    assert [cache.block_record(i) for i in (4, 5, 6, 7)] == expected
                    assert stats["tiers"]["host"]["hits"] == 4
                    assert daemon.metric("kvswap_tier_ops_total", tier="host", op="get", result="hit") == 4
                else:
                    assert result.loaded == 0 and "host" not in stats["tiers"]
                    assert result.status[0] == ("miss" if file_layout == "files" else "corrupt"), result.status
                cache.fill_random(seed=1)
        finally:
            assert daemon.stop() == 0, daemon.log()


def test_a_ram_hit_is_scattered_from_its_slot_not_copied_through_the_store(tmp_path: Path, cache: HostKVCache,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-copy path: swap_in takes RAM hits straight from their slots. The store's
    copying read (get_into) is made to fail, so a hit that went through it would error."""
    from kvswap.backends.ram_tier import RamStore
    from support import InProcessDaemon

    with InProcessDaemon(tmp_path / "s", host_tier_bytes=1 << 20) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        expected = [cache.block_record(i) for i in range(3)]
        assert c.swap_out([0, 1, 2], ["h0", "h1", "h2"], wait="persisted").stored == 3

        def no_copy(self, key, out):
            raise AssertionError("a RAM hit was copied through the store")

        monkeypatch.setattr(RamStore, "get_into", no_copy)
        cache.zero_blocks([5, 6, 7])
        assert c.swap_in(["h0", "h1", "h2"], [5, 6, 7]).loaded == 3
        assert [cache.block_record(i) for i in (5, 6, 7)] == expected
        ram = d.daemon.backends["host"]
        assert ram.problems() == [] and ram.ram.records[c.stats()["registration"]["namespace"]] == 3


def _sample(d, name: str, **labels: str) -> float:
    return d.daemon.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_swap_in_asks_each_tier_once_per_key_and_counts_it_once(tmp_path: Path, cache: HostKVCache) -> None:
    """Issue 23: a swap_in looks each key up once across the retrieve locations. Two records the
    RAM tier lacks and the file tier has are 2 RAM misses (the swapper looked in RAM, then the
    tiers' read asked it again: 4); promoted, the next swap_in's 2 RAM hits are counted once
    each, in the tier's stats and in the metrics."""
    from support import InProcessDaemon

    with InProcessDaemon(tmp_path / "s", host_tier_bytes=1 << 20) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        expected = [cache.block_record(i) for i in (0, 1)]
        assert c.swap_out([0, 1], ["f0", "f1"], wait="persisted").stored == 2
        tiers = d.daemon.swapper.registration.tiers
        assert tiers.stores["host"].clear() == 2  # in the file tier only now
        record_bytes = cache.layout.record_bytes

        def host_ops() -> tuple[float, float, float]:
            """RAM hits and misses counted in the metrics, and the bytes read from RAM."""
            hits, misses = (_sample(d, "kvswap_tier_ops_total", tier="host", op="get", result=r) for r in ("hit", "miss"))
            return hits, misses, _sample(d, "kvswap_tier_bytes_total", tier="host", direction="read")

        cache.zero_blocks([5, 6])
        assert c.swap_in(["f0", "f1"], [5, 6]).loaded == 2
        assert [cache.block_record(5), cache.block_record(6)] == expected
        stats = c.stats()["tiers"]["host"]
        assert (stats["hits"], stats["misses"]) == (0, 2)
        assert host_ops() == (0, 2, 0)
        assert _sample(d, "kvswap_tier_ops_total", tier="file", op="get", result="hit") == 2
        assert _sample(d, "kvswap_tier_ops_total", tier="host", op="promote", result="ok") == 2

        cache.zero_blocks([5, 6])
        assert c.swap_in(["f0", "f1"], [5, 6]).loaded == 2
        assert [cache.block_record(5), cache.block_record(6)] == expected
        stats = c.stats()["tiers"]["host"]
        assert (stats["hits"], stats["misses"]) == (2, 2)
        assert host_ops() == (2, 2, 2 * record_bytes)
        assert _sample(d, "kvswap_tier_ops_total", tier="file", op="get", result="hit") == 2


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_swap_in_re_stamps_files_only_through_the_last_record_read_from_disk(tmp_path: Path, cache: HostKVCache,
                                                                               file_layout: str) -> None:
    """Issue 23: the chain touch after a swap_in re-stamps the records of its hit prefix on disk
    only up to the last record read from the file tier; a record served from RAM after that
    costs no disk write (a ``utime``, Disk.touch, in the files layout; a touch entry appended to
    a journal, Disk.append, in the slab layout), a swap_in served from RAM none at all. On disk
    (the files' mtimes; the stamps the journals keep) each chain's tail stays older than its
    head."""
    from kvswap.backends import slab_journal
    from kvswap.backends.file_layout import RECORD_SUFFIX, record_name
    from support import InProcessDaemon

    with InProcessDaemon(tmp_path / "s", host_tier_bytes=1 << 20, file_layout=file_layout) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        keys = ["t0", "t1", "t2", "t3"]
        expected = [cache.block_record(i) for i in range(4)]
        assert c.swap_out([0, 1, 2, 3], keys, wait="persisted").stored == 4
        tiers = d.daemon.swapper.registration.tiers
        host = tiers.stores["host"]
        names = [record_name(k) for k in keys]
        disk = d.daemon.file_backend.disk
        touched: list[str] = []  # the records re-stamped on disk, by name, in order
        real_touch, real_append, real_hit = disk.touch, disk.append, tiers.touch_hit
        done = threading.Semaphore(0)

        def touch(path, mtime_ns=None):
            touched.append(os.path.basename(path).removesuffix(RECORD_SUFFIX))
            return real_touch(path, mtime_ns)

        def append(fd, data, durable):
            entries, _, _ = slab_journal.decode(data)
            touched.extend(e.name.hex() for e in slab_journal.iter_entries(entries) if e.op == slab_journal.TOUCH)
            return real_append(fd, data, durable)

        def touch_hit(*args):
            try:
                real_hit(*args)
            finally:
                done.release()

        disk.touch, disk.append, tiers.touch_hit = touch, append, touch_hit

        def swap_in(missing_in_ram: list[str]) -> list[str]:
            """The records one swap_in of the chain re-stamps, ``missing_in_ram`` read from disk."""
            host.delete_many(missing_in_ram)
            touched.clear()
            cache.zero_blocks([8, 9, 10, 11])
            assert c.swap_in(keys, [8, 9, 10, 11]).loaded == 4
            assert done.acquire(timeout=10)  # the touch runs after the answer
            assert [cache.block_record(b) for b in (8, 9, 10, 11)] == expected
            return touched[:]

        assert swap_in([]) == []  # all four from RAM
        assert swap_in(["t2", "t3"]) == names  # the tail from disk: the head before it too
        assert swap_in(["t0", "t1"]) == names[:2]  # the head from disk: the RAM-served tail keeps its stamps
        stamps = {r.name: r.stamp for r in records_on_disk(tmp_path / "s")}
        on_disk = [stamps[n] for n in names]
        assert on_disk == sorted(on_disk, reverse=True), on_disk  # head newest, tail oldest
        assert swap_in(keys) == names


def test_lookup_prefix_joins_the_tiers_runs(tmp_path: Path) -> None:
    """NamespaceTiers.cached_prefix asks each tier for a run of keys at once; a key counts
    when any tier (or an in-flight write) has it, and the prefix stops at the first gap."""
    from kvswap.backends.file_backend import FileBackend
    from kvswap.daemon.metrics import Metrics
    from kvswap.daemon.tiers import Locations, NamespaceTiers

    ram = RamBackend(8 * 4096)
    pool = ram.make_arena(4096, staging_slots=2)
    pool.grow(8)  # the daemon's staging grows the pool as it fills; here, by hand
    host = ram.open_store(NS, {}, 4096)
    file = FileBackend(str(tmp_path / "files")).open_store(NS, {"t": 1}, 4096)
    payload = memoryview(bytes(4096))
    for key in ("a", "c", "e"):
        host.put(key, payload)
    for key in ("b", "c"):
        file.put(key, payload)
    tiers = NamespaceTiers({"host": host, "file": file}, Locations(("host", "file"), ("host", "file"), True),
                           Metrics())
    keys = ["a", "b", "c", "d", "e"]
    assert tiers.cached_prefix(keys, {}) == 3
    assert tiers.cached_prefix(keys, {"d": None}) == 5
    assert tiers.cached_prefix(["d", "a"], {}) == 0
    assert tiers.cached_prefix([], {}) == 0


def _rss_bytes(pid: int) -> int:
    """The process's resident set (VmRSS in /proc/<pid>/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_registers_with_alternating_record_sizes_do_not_keep_old_pools(tmp_path: Path) -> None:
    """Issue 22 (7): each register with a new record size makes a new host pool; the old one's
    memory must be unmapped then (its slots and the pool refer to each other, so waiting for the
    cyclic GC kept ~64 MiB per register here). A real daemon, 8 registers alternating between two
    record sizes, each followed by a swap_out and a swap_in of its bytes: the daemon's RSS
    after each of the 3rd to 8th stays within one pool of what it was after the 2nd."""
    from kvswap.protocol import CacheLayout

    staging = 32 << 20  # write and read staging each: a pool faults in 64 MiB at once
    daemon = DaemonProcess(tmp_path / "store", free_port(), free_port(),
                           extra_args=["--write-staging-bytes", str(staging), "--read-staging-bytes", str(staging),
                                       "--host-tier-bytes", str(4 << 20)]).start()
    layouts = [CacheLayout("rss-model", num_layers=n, num_blocks=16, block_size=8, num_kv_heads=2, head_dim=16)
               for n in (3, 2)]
    caches = [HostKVCache.create(layout) for layout in layouts]
    try:
        assert caches[0].layout.record_bytes != caches[1].layout.record_bytes
        rss = []
        with Client(daemon.endpoint, timeout=30) as c:
            for i in range(8):
                cache = caches[i % 2]
                cache.fill_random(seed=i)
                assert c.register(cache)["record_bytes"] == cache.layout.record_bytes
                keys = [f"r{i}-{b}" for b in range(4)]
                expected = [cache.block_record(b) for b in range(4)]
                assert c.swap_out([0, 1, 2, 3], keys, wait="persisted").stored == 4
                cache.zero_blocks([8, 9, 10, 11])
                assert c.swap_in(keys, [8, 9, 10, 11]).loaded == 4
                assert [cache.block_record(b) for b in (8, 9, 10, 11)] == expected
                rss.append(_rss_bytes(daemon.proc.pid))
        pool_bytes = 2 * staging
        # Every register after the 2nd: at most one pool above it (a leak adds a pool each time,
        # until the cyclic GC happens to run).
        assert max(rss[2:]) - rss[1] < pool_bytes, " ".join(f"{r / 2**20:.0f}" for r in rss) + " MiB"
    finally:
        for cache in caches:
            cache.close()
        assert daemon.stop() == 0, daemon.log()


def _mapped(start: int, nbytes: int) -> bool:
    """Whether one mapping of this process covers [start, start + nbytes)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= start and start + nbytes <= hi:
            return True
    return False


@pytest.fixture
def no_gc():
    """The cyclic GC off, so a pool that is unmapped was unmapped by the code, not by a collection."""
    import gc

    was = gc.isenabled()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_a_replaced_pool_is_unmapped_once_its_last_held_slot_is_released(no_gc) -> None:
    """Issue 22 (7), the unit: Staging.prepare with a new record size retires the old pool.
    A write slot and a RAM hit still held keep it mapped, their bytes intact and writable; the
    retired pool hands out nothing; the last release unmaps it (the range leaves
    /proc/self/maps), with the cyclic GC off."""
    from kvswap.daemon.metrics import Metrics
    from kvswap.daemon.staging import Staging

    ram = RamBackend(8 * 4096)
    staging = Staging(4 * 4096, 4 * 4096, [ram], Metrics())
    staging.prepare(4096)
    old = staging.arena
    assert old is not None
    start, nbytes = old.base, old.capacity * old.slot_bytes
    store = ram.open_store(NS, {}, 4096)
    store.put("k", memoryview(b"\x07" * 4096))
    hit = store.hold("k")
    write = staging.write.try_take(1)
    assert hit is not None and write is not None
    fill(write[0], 0x5A)
    staging.prepare(8192)
    assert staging.arena is not old and old.retired and not old.unmapped and _mapped(start, nbytes)
    assert old.take(1) is None and store.hold("k") is None
    assert bytes(hit.view) == b"\x07" * 4096 and bytes(write[0].view) == b"\x5a" * 4096
    fill(write[0], 0x33)
    assert bytes(write[0].view) == b"\x33" * 4096
    hit.release()
    assert not old.unmapped and _mapped(start, nbytes)
    write[0].release()
    assert old.unmapped and not _mapped(start, nbytes)
    assert write[0].view.nbytes == 0 and old.problems() == []
    # The new pool is untouched by the old one's going.
    again = staging.write.try_take(1)
    assert again is not None and again[0].view.nbytes == 8192
    fill(again[0], 1)
    assert bytes(again[0].view) == b"\x01" * 8192
    again[0].release()
    # A pool nobody holds a slot of is unmapped by retire itself.
    idle = staging.arena
    base = idle.base
    staging.prepare(4096)
    assert idle.unmapped and not _mapped(base, idle.capacity * idle.slot_bytes)


def _register(endpoint: str, cache: HostKVCache) -> dict:
    with Client(endpoint, timeout=30) as c:
        return c.register(cache)


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_writes_in_flight_keep_their_slots_across_a_register_with_another_record_size(
        tmp_path: Path, cache: HostKVCache, file_layout: str) -> None:
    """A register that replaces the pool while swap_out's writes still hold slots of it: the
    writes land the bytes they gathered (read back after registering the first layout again),
    and the old pool is unmapped once they finish. The register closes the first namespace's
    stores meanwhile: a write in flight must still land."""
    from kvswap.protocol import CacheLayout
    from support import InProcessDaemon, wait_until

    other = CacheLayout("other-model", num_layers=2, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=16)
    with InProcessDaemon(tmp_path / "s", host_tier_bytes=0, file_layout=file_layout) as d, \
            Client(d.endpoint, timeout=10) as c, \
            HostKVCache.create(other) as small:
        c.register(small)  # its namespace directory exists then: the gated register below writes nothing
        c.register(cache)
        staging = d.daemon.swapper.staging
        expected = [cache.block_record(b) for b in (1, 2)]
        with GatedRecordWrites(d.daemon.file_backend.disk) as gate:
            assert c.swap_out([1, 2], ["g1", "g2"], wait="copied").status == ["queued", "queued"]
            assert gate.started.acquire(timeout=10)
            old = staging.arena
            # The register replaces the pool, then waits for the old registration's requests.
            with ThreadPoolExecutor(1) as runner:
                registered = runner.submit(_register, d.endpoint, small)
                # Retired just after it is replaced (on the register's thread): wait for both.
                assert wait_until(lambda: staging.arena is not old and old.retired)
                assert not old.unmapped
                gate.gate.set()
                assert registered.result(timeout=30)["record_bytes"] == other.record_bytes
            assert wait_until(lambda: old.unmapped)
        c.register(cache)
        cache.zero_blocks([5, 6])
        assert c.swap_in(["g1", "g2"], [5, 6]).loaded == 2
        assert [cache.block_record(5), cache.block_record(6)] == expected


def test_a_stopping_daemon_stops_faulting_in_its_arena() -> None:
    """At shutdown the background fault-in of the RAM share ends after its current step: on a
    busy machine faulting in gigabytes no one will use held a SIGTERM'd daemon past its
    supervisor's kill (test_load's daemon was killed with -9 after 20 s)."""
    arena = HostArena(4096, staging_slots=2, cache_slots=1000)
    assert arena.grow(10) == 10
    arena.stop_growing()
    assert arena.grow_all() == 0 and arena.grow(5) == 0
    assert arena.faulted < arena.capacity  # what was not faulted in stays so
