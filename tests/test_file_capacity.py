"""Capacity, eviction, recency and leadership of the file tier, as pure units over a real
directory (faults through the Disk seam)."""

from __future__ import annotations

import errno
import os
import threading
from types import SimpleNamespace

import pytest

from kvswap.backends import file_store
from kvswap.backends.base import GetStatus
from kvswap.backends.file_index import RecordIndex
from kvswap.backends.file_backend import Capacity, FileBackend
from kvswap.backends.file_store import FileStore, record_name
from kvswap.protocol.errors import NoSpace

from support import record_bytes_on_disk

NAMESPACE = "ab" * 16
RECORD = 1000
FILE = 256 + RECORD  # small records carry a 256-byte header


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * RECORD)


def open_store(root, records_cap: int = 0, **kw) -> FileStore:
    backend = FileBackend(str(root), capacity=Capacity(max_bytes=records_cap * FILE, **kw), layout="files")
    store = backend.open_store(NAMESPACE, {"t": 1}, RECORD)
    store.scan()
    return store


def files_on_disk(store: FileStore) -> int:
    return record_bytes_on_disk(store.dir)


@pytest.mark.parametrize("limits, message", [
    ({"max_bytes": -1}, "capacity limits must be >= 0"),
    ({"min_free_bytes": -1}, "capacity limits must be >= 0"),
    ({"low": 0.0, "high": 0.5}, "watermarks must satisfy 0 < low < high <= 1"),
    ({"low": 0.5, "high": 0.5}, "watermarks must satisfy 0 < low < high <= 1"),
    ({"low": 0.5, "high": 1.5}, "watermarks must satisfy 0 < low < high <= 1"),
])
def test_capacity_refuses_negative_limits_and_disordered_watermarks(limits, message) -> None:
    with pytest.raises(ValueError) as info:
        Capacity(**limits)
    assert str(info.value) == message


def test_capacity_allows_a_high_watermark_at_the_cap() -> None:
    assert (Capacity(max_bytes=10, high=1.0, low=0.5).high, Capacity().max_bytes, Capacity().min_free_bytes) == (
        1.0, 0, 0)


def test_index_orders_by_recency_and_skips_pins() -> None:
    index = RecordIndex()
    for name in "abcd":
        index.add(name, 10)
    index.touch("a")  # b is now the oldest
    index.pin("b")
    assert index.take_victim() == ("c", 10)
    assert index.take_victim() == ("d", 10)
    assert index.take_victim() == ("a", 10)
    assert index.take_victim() is None  # only the pinned one is left
    index.unpin("b")
    assert index.take_victim() == ("b", 10)
    assert index.bytes == 0 and len(index) == 0


def test_index_merge_puts_scanned_records_before_used_ones() -> None:
    index = RecordIndex()
    index.add("fresh", 5)
    added = index.merge_scanned([("old", 1, 100), ("older", 2, 50), ("fresh", 5, 10)])
    assert added == 2
    assert [index.take_victim()[0] for _ in range(3)] == ["older", "old", "fresh"]


def test_present_prefix_counts_stuck_records_and_what_the_caller_holds() -> None:
    index = RecordIndex()
    for name in "abde":
        index.add(name, 10)
    victim = index.take_victim()
    assert victim is not None
    index.mark_stuck(victim[0], 10)  # taken to be deleted, its file still there: still readable
    names = list("abcdef")
    assert index.present_prefix(names) == 2  # c is neither stored nor held
    assert index.present_prefix(names, lambda i: names[i] == "c") == 5
    assert index.present_prefix(names, lambda i: names[i] in "cf") == 6
    assert index.present_prefix([]) == 0


def test_present_prefix_never_waits_for_the_index_lock() -> None:
    """The loop answers lookups with it while write threads hold the lock for every record."""
    index = RecordIndex()
    for name in "abc":
        index.add(name, 10)
    answer: list[int] = []
    with index._lock:  # a write thread in the middle of an add
        reader = threading.Thread(target=lambda: answer.append(index.present_prefix(list("abcd"))))
        reader.start()
        reader.join(30)
        assert answer == [3], "present_prefix waited for the lock"


def test_the_cap_is_never_exceeded_and_recent_records_stay(tmp_path) -> None:
    store = open_store(tmp_path, records_cap=10)
    assert store.try_lead()
    for i in range(30):
        store.put(f"k{i}", payload(i))
        assert files_on_disk(store) <= 10 * FILE
        assert store.index.bytes <= 10 * FILE
    # The most recent records survive; the first ones went.
    assert store.contains("k29") and store.contains("k28")
    assert not store.contains("k0")
    assert store.counters["evicted_capacity"] >= 20


def test_reads_refresh_recency(tmp_path) -> None:
    store = open_store(tmp_path, records_cap=4)
    store.try_lead()
    for i in range(4):
        store.put(f"k{i}", payload(i))
    out = memoryview(bytearray(RECORD))
    assert store.get_into("k0", out) is GetStatus.LOADED  # k0 becomes the most recent
    store.put("k4", payload(4))  # over the cap: evicts down to the low watermark
    assert store.contains("k0")
    assert not store.contains("k1")


def test_recency_survives_a_restart(tmp_path) -> None:
    store = open_store(tmp_path)
    for i in range(6):
        store.put(f"k{i}", payload(i))
        name, path = store.path_of(f"k{i}")
        os.utime(path, ns=(1_000_000_000 * (i + 1), 1_000_000_000 * (i + 1)))
    os.utime(store.path_of("k0")[1], ns=(10**11, 10**11))  # k0 was read last
    store.close()

    again = open_store(tmp_path, records_cap=6)
    assert again.try_lead()
    again.evict(3 * FILE, "capacity")
    assert [again.contains(f"k{i}") for i in range(6)] == [True, False, False, False, True, True]


def test_pinned_records_are_not_evicted(tmp_path) -> None:
    store = open_store(tmp_path)
    for i in range(3):
        store.put(f"k{i}", payload(i))
    store.index.pin(record_name("k0"))
    assert store.evict(10 * FILE, "capacity") == 2 * FILE
    assert store.contains("k0")


def test_a_file_that_cannot_be_deleted_is_set_aside_and_counted(tmp_path, monkeypatch) -> None:
    store = open_store(tmp_path)
    for i in range(4):
        store.put(f"k{i}", payload(i))
    stubborn = store.path_of("k0")[1]
    real_remove = store.disk.remove

    def remove(path):
        if path == stubborn:
            raise OSError(errno.EPERM, "Operation not permitted")
        return real_remove(path)

    monkeypatch.setattr(store.disk, "remove", remove)
    freed = store.evict(4 * FILE, "capacity")
    assert freed == 3 * FILE
    assert store.counters["eviction_failures"] == 1
    assert store.index.stuck == 1
    # It is never offered again, so eviction cannot wedge on it.
    assert store.evict(FILE, "capacity") == 0
    assert store.counters["eviction_failures"] == 1
    assert store.usage()["bytes"] == FILE  # still on disk, still counted


def test_full_cap_with_everything_pinned_is_no_space(tmp_path) -> None:
    store = open_store(tmp_path, records_cap=2)
    store.try_lead()
    store.put("a", payload(1))
    store.put("b", payload(2))
    store.index.pin(record_name("a"))
    store.index.pin(record_name("b"))
    with pytest.raises(NoSpace) as info:
        store.put("c", payload(3))
    assert info.value.message == "the store is at its cap and nothing can be evicted (all records pinned or stuck)"
    assert info.value.details == {"max_bytes": 2 * FILE, "used": 2 * FILE}
    assert store.contains("a") and store.contains("b")


def test_enospc_evicts_and_retries_once(tmp_path, monkeypatch) -> None:
    store = open_store(tmp_path)
    store.try_lead()
    for i in range(8):
        store.put(f"k{i}", payload(i))
    real_write = store.disk.write_file
    calls = {"n": 0}

    def full_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store.disk, "write_file", full_once)
    store.put("new", payload(9))
    assert calls["n"] == 2
    assert store.counters["enospc_retries"] == 1
    assert store.counters["evicted_enospc"] == 2  # room for two records, then the one retry
    assert store.contains("new") and store.usage()["records"] == 8 - 2 + 1

    monkeypatch.setattr(store.disk, "write_file", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(NoSpace):
        store.put("never", payload(10))


def test_the_leader_says_so_and_names_itself_in_the_lock_file(tmp_path, caplog) -> None:
    with caplog.at_level("INFO"):
        store = open_store(tmp_path)  # alone on its directory: it leads from its scan on
    assert store.is_leader and store.counters["leader_elections"] == 1
    assert f"this daemon now evicts for namespace {NAMESPACE}" in [r.getMessage() for r in caplog.records]
    with open(os.path.join(store.dir, "evict.lock")) as f:
        assert f.read() == f"{store.backend._writer_tag}\n"


def test_one_leader_per_namespace_and_takeover(tmp_path) -> None:
    first = open_store(tmp_path)
    second = open_store(tmp_path)
    assert first.try_lead()
    assert not second.try_lead()
    second.maintain()
    assert not second.is_leader
    first.close()  # the leader goes: its flock goes with its file descriptor
    second.maintain()
    assert second.is_leader


def test_background_eviction_keeps_under_the_high_watermark(tmp_path) -> None:
    store = open_store(tmp_path, records_cap=100)
    for i in range(99):  # writes as a follower: no eviction at write time
        store.put(f"k{i}", payload(i))
    assert store.index.bytes > 0.95 * 100 * FILE
    store.maintain()  # becomes leader, evicts down to the low watermark
    assert store.is_leader
    assert store.index.bytes <= 0.85 * 100 * FILE
    assert store.counters["evicted_capacity"] >= 14


def test_min_free_space_floor(tmp_path, monkeypatch) -> None:
    store = open_store(tmp_path, min_free_bytes=10**6)
    for i in range(20):
        store.put(f"k{i}", payload(i))
    monkeypatch.setattr(store.disk, "free_bytes", lambda path: 10**6 - 5 * FILE)
    store.maintain()
    assert store.counters["evicted_min_free"] >= 5


@pytest.mark.parametrize("records, left", [(10, 10), (11, 5)])
def test_background_eviction_starts_above_the_high_watermark_and_stops_at_the_low(tmp_path, records, left) -> None:
    store = open_store(tmp_path, records_cap=20, high=0.5, low=0.25)
    for i in range(records):  # under the cap: nothing is evicted at write time
        store.put(f"k{i}", payload(i))
    store.maintain()  # exactly at the high watermark is not above it; one record more is
    assert store.usage() == {"records": left, "bytes": left * FILE}
    assert store.counters["evicted_capacity"] == records - left


@pytest.mark.parametrize("short, evicted", [(0, 0), (1194, 2), (1195, 3)])
def test_the_free_space_floor_evicts_the_shortfall_plus_a_twentieth_of_the_store(tmp_path, monkeypatch, short,
                                                                                 evicted) -> None:
    store = open_store(tmp_path, min_free_bytes=10**6)
    for i in range(21):
        store.put(f"k{i}", payload(i))
    # 21 records: a twentieth of the store is 1318 bytes (more than a record), so 1194 bytes
    # short asks for exactly two records' bytes, and one byte more for a third.
    assert (21 * FILE // 20, 2 * FILE) == (1318, 1194 + 1318)
    monkeypatch.setattr(store.disk, "free_bytes", lambda path: 10**6 - short if path == store.dir else 0)
    store.maintain()
    assert store.counters["evicted_min_free"] == evicted
    assert store.usage()["records"] == 21 - evicted


def test_free_bytes_is_the_file_systems_and_none_when_it_cannot_be_read(tmp_path, monkeypatch) -> None:
    store = open_store(tmp_path)
    assert store.free_bytes() > 0
    monkeypatch.setattr(store.disk, "free_bytes", lambda path: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    assert store.free_bytes() is None


def test_no_rescan_interval_means_the_start_up_scan_only(tmp_path) -> None:
    leader = open_store(tmp_path)
    other = open_store(tmp_path)
    other.put("theirs", payload(1))
    leader.maintain(now=leader._last_rescan + 10**6)  # however late
    assert leader.is_leader and record_name("theirs") not in leader.index


def test_rescans_come_when_the_interval_has_passed_since_the_last_one(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(file_store, "time", SimpleNamespace(monotonic=lambda: 100.0))
    leader = FileBackend(str(tmp_path), rescan_interval_s=10, layout="files").open_store(NAMESPACE, {}, RECORD)
    leader.scan()  # at 100.0
    other = open_store(tmp_path)
    other.put("theirs", payload(1))
    leader.maintain(now=109.9)
    assert record_name("theirs") not in leader.index
    leader.maintain(now=110.0)
    assert record_name("theirs") in leader.index
    other.put("later", payload(2))
    leader.maintain(now=119.9)  # counted from the last rescan, not from the scan
    assert record_name("later") not in leader.index
    leader.maintain(now=120.0)
    assert record_name("later") in leader.index


def test_maintain_reads_the_clock_itself(tmp_path) -> None:
    leader = FileBackend(str(tmp_path), rescan_interval_s=1e-9, layout="files").open_store(NAMESPACE, {}, RECORD)
    leader.scan()
    open_store(tmp_path).put("theirs", payload(1))
    leader.maintain()
    assert record_name("theirs") in leader.index


def test_a_swap_ins_touch_reaches_the_files_and_a_lookups_does_not(tmp_path) -> None:
    store = open_store(tmp_path)
    store.expect_chain(["a", "b", "c"])
    for key in "abc":
        store.put(key, payload(1))
    store.put("y", payload(2))  # another chain, newer than a-b-c
    paths = {k: store.path_of(k)[1] for k in "abcy"}

    def mtimes() -> dict[str, int]:
        return {k: os.stat(p).st_mtime_ns for k, p in paths.items()}

    before = mtimes()
    store.touch_chain(["a", "b", "c"])  # a lookup hit: recency in memory only
    assert mtimes() == before
    store.touch_chain(["a", "b", "c"], persist=True)  # a swap_in hit: the files take the stamps
    after = mtimes()
    assert after["a"] > after["b"] > after["c"] > before["y"] == after["y"]
    store.close()
    again = open_store(tmp_path, records_cap=4)
    assert again.try_lead() and again.evict(FILE, "capacity") == FILE
    assert [again.contains(k) for k in "abcy"] == [True, True, True, False]  # y is now the oldest


def test_rescan_sees_records_other_writers_added_and_removed(tmp_path) -> None:
    leader = FileBackend(str(tmp_path), rescan_interval_s=1, layout="files").open_store(NAMESPACE, {}, RECORD)
    leader.scan()
    other = open_store(tmp_path)
    other.put("theirs", payload(1))
    leader.put("mine", payload(2))
    os.unlink(leader.path_of("mine")[1])  # someone else deleted it
    leader.maintain(now=10**6)
    assert leader.usage() == {"records": 1, "bytes": FILE}
    assert record_name("theirs") in leader.index


def test_concurrent_writers_never_pass_the_cap(tmp_path) -> None:
    store = open_store(tmp_path, records_cap=8)
    store.try_lead()
    errors: list[BaseException] = []
    peak = {"bytes": 0}

    def writer(w: int) -> None:
        try:
            for i in range(40):
                store.put(f"w{w}-{i}", payload(i))
                peak["bytes"] = max(peak["bytes"], store.index.bytes)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert peak["bytes"] <= 8 * FILE
    assert files_on_disk(store) <= 8 * FILE
    assert store.index.bytes == files_on_disk(store)


def test_a_planted_symlink_or_fifo_is_never_read_through(tmp_path) -> None:
    store = open_store(tmp_path)
    target = tmp_path / "secret.txt"
    target.write_bytes(b"not yours")
    link_path = store.path_of("linked")[1]
    os.makedirs(os.path.dirname(link_path), exist_ok=True)
    os.symlink(target, link_path)
    fifo_path = store.path_of("fifo")[1]
    os.makedirs(os.path.dirname(fifo_path), exist_ok=True)
    os.mkfifo(fifo_path)
    out = memoryview(bytearray(RECORD))
    assert store.get_into("linked", out) is GetStatus.CORRUPT
    assert store.get_into("fifo", out) is GetStatus.CORRUPT  # returns: O_NONBLOCK, not a hang
    assert not os.path.lexists(link_path) and not os.path.exists(fifo_path)
    assert target.read_bytes() == b"not yours"
    assert store.counters["corrupt"] == 2


def test_a_record_being_read_is_never_evicted(tmp_path) -> None:
    """Eviction that runs while a read is between its open and its checks (here: from inside
    the read, at the Disk seam) must pass the record by."""
    store = open_store(tmp_path)
    store.put("k0", payload(7))
    real_read = store.disk.read_file
    freed = []

    def read_while_evicting(path, parts):
        freed.append(store.evict(10 * FILE, "capacity"))
        return real_read(path, parts)

    store.disk.read_file = read_while_evicting
    out = memoryview(bytearray(RECORD))
    assert store.get_into("k0", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload(7))
    assert freed == [0] and store.contains("k0")


def test_a_write_over_the_cap_takes_the_lead_when_it_is_free(tmp_path) -> None:
    first = open_store(tmp_path, records_cap=3)
    second = open_store(tmp_path, records_cap=3)
    assert first.is_leader and not second.is_leader
    for i in range(3):
        second.put(f"k{i}", payload(i))
    first.close()  # the evicting daemon went away
    second.put("k3", payload(3))  # over the cap: this writer takes the lead and evicts first
    assert second.is_leader
    assert files_on_disk(second) <= 3 * FILE
    assert second.contains("k3") and not second.contains("k0")


def test_a_stuck_file_is_logged_and_its_bytes_go_when_it_is_finally_deleted(tmp_path, monkeypatch, caplog) -> None:
    store = open_store(tmp_path)
    store.put("k0", payload(0))
    stubborn = store.path_of("k0")[1]
    real_remove = store.disk.remove

    def remove(path):
        if path == stubborn:
            raise OSError(errno.EPERM, "Operation not permitted")
        return real_remove(path)

    monkeypatch.setattr(store.disk, "remove", remove)
    with caplog.at_level("WARNING"):
        assert store.evict(FILE, "capacity") == 0
    assert f"cannot evict {stubborn}: [Errno 1] Operation not permitted; setting it aside" in [
        r.getMessage() for r in caplog.records]
    assert store.usage() == {"records": 1, "bytes": FILE}  # on disk, counted, never offered again
    monkeypatch.undo()
    assert store.delete("k0") is True
    assert store.usage() == {"records": 0, "bytes": 0} and store.index.stuck == 0


def _lock_fds(store: FileStore) -> int:
    """How many of this process's descriptors are open on the namespace's evict.lock."""
    lock = os.path.realpath(os.path.join(store.dir, "evict.lock"))
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == lock
        except OSError:
            continue  # the descriptor listdir itself used, closed meanwhile
    return count


def test_a_store_closed_before_its_scan_never_takes_the_lead(tmp_path) -> None:
    """Issue 22 (4): a namespace closed while its start-up scan was queued kept evict.lock (a
    leaked descriptor), so the store opened next for that namespace never led."""
    writer = open_store(tmp_path)
    for i in range(5):
        writer.put(f"k{i}", payload(i))
    writer.close()
    closed = FileBackend(str(tmp_path), capacity=Capacity(max_bytes=3 * FILE), layout="files").open_store(NAMESPACE, {"t": 1}, RECORD)
    closed.close()
    assert closed.scan() == 0 and closed.counters["scan_records"] == 0
    closed.maintain()
    assert closed.try_lead() is False
    assert not closed.is_leader and _lock_fds(closed) == 0
    again = open_store(tmp_path, records_cap=3)
    assert again.is_leader and _lock_fds(again) == 1
    again.put("k9", payload(9))  # the cap holds again: the new store evicts at write time
    assert files_on_disk(again) <= 3 * FILE and again.counters["evicted_capacity"] >= 3


def test_a_store_closed_during_its_scan_stops_scanning_and_never_leads(tmp_path, monkeypatch) -> None:
    writer = open_store(tmp_path)
    for i in range(20):
        writer.put(f"k{i}", payload(i))
    writer.close()
    store = FileBackend(str(tmp_path), layout="files").open_store(NAMESPACE, {"t": 1}, RECORD)
    real_walk = file_store.scan_record_files

    def walk_then_close(path):
        for n, found in enumerate(real_walk(path)):
            if n == 2:
                store.close()  # the daemon registered another layout meanwhile
            yield found

    monkeypatch.setattr(file_store, "scan_record_files", walk_then_close)
    store.scan()
    assert store.counters["scan_records"] == 2  # it stopped at the first record after the close
    assert not store.is_leader and _lock_fds(store) == 0
