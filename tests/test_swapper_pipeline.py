"""The swap pipeline's answers and counts, exactly: per-key statuses and their totals, the
blocks, bytes and lookup keys it counts in the daemon's registry, its stats, the one log line a
request with failed writes gets, deletes that wait for writes in flight, and swap_ins larger
than one read wave. A daemon in this process (so mutation testing sees its code), the real
client over a real socket, a real directory; faults only at the ``Disk`` seam. The daemons
here have the file tier alone (``host_tier_bytes=0``) unless a test asks for the RAM tier: the
checks are of the file tier's reads and writes."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import INSTALLED_BY_TEST_SETUP, GatedWrites, InProcessDaemon, wait_until

from kvswap.backends import record
from kvswap.backends.file_backend import FileBackend
from kvswap.daemon.swapper import GATHER_CHUNK, Deadline, gather_chunks
from kvswap.protocol import Client, HostKVCache, InvalidLayout, NotRegistered, Timeout
from kvswap.protocol import messages as m
from kvswap.protocol.errors import IOFailure


def metric(d: InProcessDaemon, name: str, **labels: str) -> float:
    return d.daemon.metrics.registry.get_sample_value(name, labels) or 0.0


def test_swap_out_answers_every_key_and_counts_blocks_and_bytes(tmp_path: Path, cache: HostKVCache) -> None:
    record = cache.layout.record_bytes
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0], ["a"], wait="persisted").status == ["stored"]
        out = c.swap_out([0, 1, 2, 1], ["a", "b", "c", "b"], wait="persisted")
        assert out.status == ["exists", "stored", "stored", "exists"]  # stored before, or named twice
        assert (out.queued, out.stored, out.exists, out.skipped, out.failed) == (0, 2, 2, 0, 0)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            out = c.swap_out([3, 4], ["d", "e"])
            assert out.status == ["queued", "queued"]
            assert (out.queued, out.stored, out.exists, out.skipped, out.failed) == (2, 0, 0, 0, 0)
            assert gate.started.acquire(timeout=10)
            assert metric(d, "kvswap_pending_writes") == 2 and c.stats()["write_tasks"] == 1
            # In flight, named twice, or new: each key is looked at, none is written twice.
            out = c.swap_out([3, 5, 5, 6], ["d", "f", "f", "g"])
            assert out.status == ["exists", "queued", "exists", "queued"]
            assert metric(d, "kvswap_pending_writes") == 4 and c.stats()["write_tasks"] == 2
            flushing = c.send(m.Flush, {})
            gate.gate.set()
            assert c.wait(flushing)["flushed"] == 2 and c.flush() == 0  # two requests' writes, then none
        assert {s: metric(d, "kvswap_blocks_total", op="swap_out", status=s)
                for s in ("stored", "exists", "queued")} == {"stored": 3, "exists": 4, "queued": 4}
        assert metric(d, "kvswap_bytes_total", direction="out") == 7 * record
        assert metric(d, "kvswap_pending_writes") == 0
        assert metric(d, "kvswap_write_failures_total", code="io_error") == 0
        stats = c.stats()
        assert (stats["registered"], stats["pending_writes"], stats["write_tasks"]) == (True, 0, 0)
        assert stats["tiers"]["file"]["records"] == 7


def test_swap_in_and_lookup_count_what_they_found(tmp_path: Path, cache: HostKVCache) -> None:
    record = cache.layout.record_bytes
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0, 1, 2], ["a", "b", "c"], wait="persisted").stored == 3
        cache.zero_blocks([10, 11, 12])
        result = c.swap_in(["a", "gone", "c"], [10, 11, 12])
        assert (result.loaded, result.status) == (1, ["loaded", "miss", "loaded"])
        assert cache.block_record(10) == cache.block_record(0)
        assert cache.block_record(11) == bytes(record)
        assert cache.block_record(12) == cache.block_record(2)
        assert {s: metric(d, "kvswap_blocks_total", op="swap_in", status=s)
                for s in ("loaded", "miss")} == {"loaded": 2, "miss": 1}
        assert metric(d, "kvswap_bytes_total", direction="in") == 2 * record
        assert c.lookup(["a", "b", "gone", "c"]) == 2
        assert c.lookup(["gone", "a"]) == 0
        assert {r: metric(d, "kvswap_lookup_keys_total", result=r) for r in ("hit", "miss")} == {"hit": 2, "miss": 4}


def test_lookup_asks_the_directory_for_keys_the_index_does_not_know(tmp_path: Path, cache: HostKVCache) -> None:
    root = tmp_path / "s"
    with InProcessDaemon(root, file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0], ["mine"], wait="persisted").stored == 1
        namespace = cache.layout.fingerprint()
        neighbour = FileBackend(str(root), layout="files").open_store(namespace, cache.layout.to_wire(), cache.layout.record_bytes)
        neighbour.put("theirs", memoryview(cache.block_record(5)))  # another daemon sharing the directory
        neighbour.put("also-theirs", memoryview(cache.block_record(6)))
        assert c.lookup(["mine", "theirs", "also-theirs", "nobody"]) == 3
        cache.zero_blocks([20, 21])
        assert c.swap_in(["theirs", "also-theirs"], [20, 21]).loaded == 2
        assert [cache.block_record(20), cache.block_record(21)] == [cache.block_record(5), cache.block_record(6)]


def test_failed_writes_are_one_log_line_per_request_and_counted_by_code(tmp_path: Path, cache: HostKVCache,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    # One write thread: the records are written in chain order, so x2 and x3 find x1 failed
    # (with several, each may fail its own write first: io_error, as correct an answer).
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, write_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        disk = d.daemon.file_backend.disk

        def failing(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error")

        disk.write_file = failing
        with caplog.at_level("WARNING"):
            out = c.swap_out([1, 2, 3], ["x1", "x2", "x3"], wait="persisted")
        # x1's write failed; x2 and x3 follow it in their chain, so no lookup could reach them.
        assert out.status == ["io_error", "no_space", "no_space"]
        assert (out.queued, out.stored, out.exists, out.skipped, out.failed) == (0, 0, 0, 0, 3)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("swap_out:")]
        assert lines == [  # the commonest failure first
            "swap_out: 3 of 3 records not stored: tier file: no_space x2 (the record before this one in its chain"
            " was evicted; storing it would waste the space); tier file: io_error x1 (cannot write a record:"
            " Input/output error)"]
        assert {code: metric(d, "kvswap_write_failures_total", code=code)
                for code in ("io_error", "no_space")} == {"io_error": 1, "no_space": 2}
        assert metric(d, "kvswap_blocks_total", op="swap_out", status="io_error") == 1
        assert metric(d, "kvswap_blocks_total", op="swap_out", status="no_space") == 2
        assert metric(d, "kvswap_pending_writes") == 0 and c.stats()["pending_writes"] == 0


def test_stats_describe_the_registration_its_tiers_and_staging(tmp_path: Path, cache: HostKVCache) -> None:
    host_bytes = 1 << 20
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=host_bytes) as d, Client(d.endpoint, timeout=10) as c:
        assert c.stats()["registered"] is False and "registration" not in c.stats()
        assert {t: metric(d, "kvswap_stored_records", tier=t) for t in ("host", "file")} == {"host": 0, "file": 0}
        assert metric(d, "kvswap_stored_bytes", tier="file") == 0
        c.register(cache)
        assert c.swap_out([0, 1], ["a", "b"], wait="persisted").stored == 2
        stats = c.stats()
        assert stats["registration"]["namespace"] == cache.layout.fingerprint()
        assert stats["locations"] == {"store": ["host", "file"], "retrieve": ["host", "file"], "promote_to_host": True}
        assert sorted(stats["tiers"]) == ["file", "host"]
        assert stats["tiers"]["host"]["capacity_bytes"] == host_bytes
        assert "capacity_bytes" not in stats["tiers"]["file"]
        assert "url" not in stats["tiers"]["file"] and "url" not in stats["tiers"]["host"]
        assert stats["tiers"]["file"]["records"] == 2 and stats["tiers"]["host"]["records"] == 2
        for pool in ("write_staging", "read_staging"):
            assert set(stats[pool]) == {"slots", "free", "slot_bytes"} and stats[pool]["free"] == stats[pool]["slots"]
        assert {t: metric(d, "kvswap_stored_records", tier=t) for t in ("host", "file")} == {"host": 2, "file": 2}
        record_file = record.header_len_for(cache.layout.record_bytes) + cache.layout.record_bytes
        assert metric(d, "kvswap_stored_bytes", tier="file") == 2 * record_file
        assert metric(d, "kvswap_tier_healthy", tier="file") == 1


def test_a_delete_waits_for_the_write_in_flight_and_is_not_undone(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            # Two requests, so "other" heads a chain of its own: as k's successor it would be
            # stranded by k's delete, and dropped if its write ended after the delete.
            assert c.swap_out([0], ["k"]).queued == 1
            assert c.swap_out([1], ["other"]).queued == 1
            assert gate.started.acquire(timeout=10)
            sent = c.send(m.Delete, {"keys": ("k",)})
            assert c.ping() < 5  # the delete waits without holding the loop
            gate.gate.set()
            assert c.wait(sent)["deleted"] == 1  # after the write landed, so it is gone for good
            c.flush()
            assert c.lookup(["k"]) == 0 and c.lookup(["other"]) == 1
            assert c.stats()["tiers"]["file"]["records"] == 1


def test_clear_waits_for_pending_writes_and_counts_what_it_removed(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            assert c.swap_out([0, 1, 2], ["a", "b", "c"]).queued == 3
            assert gate.started.acquire(timeout=10)
            sent = c.send(m.Clear, {})
            gate.gate.set()
            assert c.wait(sent)["deleted"] == 3
            assert c.stats()["tiers"]["file"]["records"] == 0 and c.lookup(["a"]) == 0


def test_a_tier_that_fails_a_delete_is_logged_and_the_others_answer(tmp_path: Path, cache: HostKVCache,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=1 << 20) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0, 1], ["a", "b"], wait="persisted").stored == 2

        def failing(path):
            raise OSError(errno.EROFS, "Read-only file system")

        d.daemon.file_backend.disk.remove = failing
        with caplog.at_level("WARNING"):
            assert c.delete(["a", "b"]) == 2  # the host tier deleted both
        assert "file tier: cannot delete a record: Read-only file system" in [r.getMessage() for r in caplog.records]
        assert c.delete(["a", "b"]) == 0


def test_a_swap_in_larger_than_a_read_wave_loads_every_block(tmp_path: Path, cache: HostKVCache) -> None:
    record = cache.layout.record_bytes
    slot = -(-record // 4096) * 4096
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, read_staging_bytes=4 * slot) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.stats()["read_staging"]["slots"] == 4  # waves of two keys
        keys = [f"w{i}" for i in range(7)]
        assert c.swap_out(list(range(7)), keys, wait="persisted").stored == 7
        targets = list(range(20, 27))
        cache.zero_blocks(targets)
        result = c.swap_in(keys, targets)
        assert (result.loaded, result.status) == (7, ["loaded"] * 7)
        assert [cache.block_record(t) for t in targets] == [cache.block_record(b) for b in range(7)]
        assert c.stats()["read_staging"]["free"] == 4


def test_requests_that_need_a_registration_say_so_before_one_exists(tmp_path: Path) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        for call in (lambda: c.lookup(["a"]), lambda: c.delete(["a"]), c.clear):
            with pytest.raises(NotRegistered) as err:
                call()
            assert err.value.message == "no cache is registered; send register first"
        assert c.stats()["registered"] is False and c.stats()["pending_writes"] == 0


def _truncate(cache: HostKVCache, size: int) -> None:
    fd = os.open(f"/dev/shm/{cache.segment.name}", os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def test_a_shrunk_segment_releases_the_registration_with_one_log_line(tmp_path: Path, layout,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    # This process is the engine and, here, the daemon too: after a truncate neither may touch
    # the mapping (SIGBUS), so expected bytes are taken first and the mover must refuse first.
    cache = HostKVCache.create(layout)
    try:
        cache.fill_random(4)
        expected = cache.block_record(0)
        with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            assert c.swap_out([0], ["s0"], wait="persisted").stored == 1
            _truncate(cache, 4096)
            with caplog.at_level("WARNING"), pytest.raises(InvalidLayout) as err:
                c.swap_out([1], ["s1"], wait="persisted")
            assert err.value.details["reason"] == "segment_shrunk"
            assert wait_until(lambda: metric(d, "kvswap_registrations_total", event="segment_shrunk") == 1)
            lines = [r.getMessage() for r in caplog.records if "releasing its registration" in r.getMessage()]
            assert lines == [f"pid {os.getpid()}: shared memory {cache.segment.name!r} shrank to 4096 bytes; the "
                             f"registration needs {cache.segment.size}; releasing its registration"]
            with pytest.raises(NotRegistered):
                c.swap_in(["s0"], [9])
            _truncate(cache, cache.segment.size)  # zeros again, full size: registered anew, shrunk again
            c.register(cache)
            _truncate(cache, 0)
            with pytest.raises(InvalidLayout) as err:  # the scatter of a swap_in finds it first
                c.swap_in(["s0"], [9])
            assert err.value.details["reason"] == "segment_shrunk"
            assert wait_until(lambda: metric(d, "kvswap_registrations_total", event="segment_shrunk") == 2)
            with HostKVCache.create(layout) as fresh:
                c.register(fresh)
                fresh.zero_blocks([9])
                assert c.swap_in(["s0"], [9]).loaded == 1
                assert fresh.block_record(9) == expected
    finally:
        cache.close()


def test_a_lookup_renews_its_hit_prefix_so_eviction_takes_an_older_chain(tmp_path: Path, cache: HostKVCache) -> None:
    per_file = record.header_len_for(cache.layout.record_bytes) + cache.layout.record_bytes
    # One read thread: the lookup's touch runs before the next request's work on that thread.
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, storage_max_bytes=4 * per_file,
                         read_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"])  # enforces the cap once scanned
        assert c.swap_out([0, 1], ["a0", "a1"], wait="persisted").stored == 2
        assert c.swap_out([2, 3], ["b0", "b1"], wait="persisted").stored == 2
        assert c.lookup(["a0", "a1"]) == 2  # chain a is now newer than chain b
        assert c.swap_out([4, 5], ["c0", "c1"], wait="persisted").stored == 2  # over the cap: b goes
        assert (c.lookup(["a0", "a1"]), c.lookup(["b0", "b1"]), c.lookup(["c0", "c1"])) == (2, 0, 2)


def test_a_failed_touch_of_a_hit_prefix_is_logged_and_the_answers_stand(tmp_path: Path, cache: HostKVCache,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0], ["a"], wait="persisted").stored == 1
        tiers = d.daemon.swapper.registration.tiers

        def failing(keys, persist=False):
            raise OSError(errno.EIO, f"touch of {len(keys)} failed (persist={persist})")

        tiers.touch_chain = failing

        def logged() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith("background task failed")]

        with caplog.at_level("WARNING"):
            assert c.lookup(["a", "b"]) == 1
            assert wait_until(lambda: len(logged()) == 1)
            cache.zero_blocks([9])
            assert c.swap_in(["a"], [9]).loaded == 1
            assert wait_until(lambda: len(logged()) == 2)
        assert logged() == ["background task failed: [Errno 5] touch of 1 failed (persist=False)",
                            "background task failed: [Errno 5] touch of 1 failed (persist=True)"]
        assert cache.block_record(9) == cache.block_record(0)


def test_a_record_read_after_its_deadline_is_not_scattered_and_counts_as_an_error(tmp_path: Path,
                                                                                   cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([1], ["slow"], wait="persisted").stored == 1
        disk = d.daemon.file_backend.disk
        real_read = disk.read_file
        release = threading.Event()

        def held(path, parts):
            assert release.wait(10)
            return real_read(path, parts)

        disk.read_file = held
        cache.zero_blocks([9])
        try:
            with pytest.raises(Timeout):
                c.swap_in(["slow"], [9], timeout=0.2)
        finally:
            release.set()  # the read ends after the deadline: the engine may have reused block 9
        assert wait_until(lambda: metric(d, "kvswap_blocks_total", op="swap_in", status="error") == 1)
        assert metric(d, "kvswap_blocks_total", op="swap_in", status="loaded") == 0
        assert metric(d, "kvswap_bytes_total", direction="in") == 0
        assert cache.block_record(9) == bytes(cache.layout.record_bytes)


class RecordingScatter:
    """Wraps the registration's mover: records the blocks of each scatter call, and with
    ``refuse`` answers as a mover does once the deadline passed (the copy abandoned).
    ``batches`` sets whether the mover wants a whole wave in one call, as the GPU movers do."""

    def __init__(self, mover, batches: bool) -> None:
        self.real = mover.scatter_blocks
        self.calls: list[list[int]] = []
        self.refuse = False
        self._lock = threading.Lock()
        mover.scatter_blocks = self
        mover.batches_scatter = batches

    def __call__(self, block_ids, slots, live) -> bool:
        with self._lock:
            self.calls.append(list(block_ids))
        return False if self.refuse else self.real(block_ids, slots, live)


@pytest.mark.parametrize("batches", [False, True])
def test_a_batching_mover_gets_a_wave_in_one_scatter_and_another_one_record_at_a_time(
        tmp_path: Path, cache: HostKVCache, batches: bool) -> None:
    empty = bytes(cache.layout.record_bytes)
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0, 1, 2], ["a", "b", "c"], wait="persisted").stored == 3
        scatter = RecordingScatter(d.daemon.swapper.registration.mover, batches)
        cache.zero_blocks([10, 11, 12, 13])
        result = c.swap_in(["a", "gone", "c", "b"], [10, 11, 12, 13])
        assert (result.loaded, result.status) == (1, ["loaded", "miss", "loaded", "loaded"])
        assert [cache.block_record(b) for b in (10, 11, 12, 13)] == [
            cache.block_record(0), empty, cache.block_record(2), cache.block_record(1)]
        # Batching: the loaded records of the wave in key order; else each on its read thread.
        assert (scatter.calls if batches else sorted(scatter.calls)) == ([[10, 12, 13]] if batches else
                                                                         [[10], [12], [13]])
        scatter.calls.clear()
        scatter.refuse = True
        cache.zero_blocks([10, 12])
        result = c.swap_in(["a", "c"], [10, 12])
        assert (result.loaded, result.status) == (0, ["error", "error"])
        assert cache.block_record(10) == empty and cache.block_record(12) == empty
        assert metric(d, "kvswap_blocks_total", op="swap_in", status="error") == 2
        assert len(scatter.calls) == (1 if batches else 2)


def test_a_swap_in_whose_registration_is_released_meanwhile_says_so_and_writes_nothing(
        tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0], ["a"], wait="persisted").stored == 1
        registration = d.daemon.swapper.registration
        disk = d.daemon.file_backend.disk
        real_read = disk.read_file
        reading, go = threading.Event(), threading.Event()

        def held(path, parts):
            reading.set()
            assert go.wait(10)
            return real_read(path, parts)

        disk.read_file = held
        cache.zero_blocks([9])
        try:
            swap = c.send(m.SwapIn, {"keys": ("a",), "block_ids": (9,)})
            assert reading.wait(10)
            release = c.send(m.Unregister, {})
            assert wait_until(lambda: registration.closing)  # it waits for the swap_in's lease
        finally:
            go.set()
        with pytest.raises(NotRegistered) as err:
            c.wait(swap)
        assert err.value.message == "the registration was released while this swap_in copied its blocks"
        assert c.wait(release)["released"] is True
        assert cache.block_record(9) == bytes(cache.layout.record_bytes)


def test_stats_name_a_remote_tiers_url(tmp_path: Path, cache: HostKVCache) -> None:
    pytest.importorskip("redis", reason=f"the redis client is not installed ({INSTALLED_BY_TEST_SETUP})")
    url = "redis://127.0.0.1:1/0"  # nothing listens there: the tier is configured, not reachable
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, remote_url=url) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        tiers = c.stats()["tiers"]
        assert tiers["remote"]["url"] == url
        assert "url" not in tiers["file"]


def test_each_record_of_a_swap_out_is_written_once_across_its_gather_chunks(tmp_path: Path,
                                                                            cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        disk = d.daemon.file_backend.disk
        real_write = disk.write_file
        written: list[str] = []
        lock = threading.Lock()

        def counting(tmp, final, *args, **kwargs):
            with lock:
                written.append(final)
            return real_write(tmp, final, *args, **kwargs)

        disk.write_file = counting
        keys = [f"k{i}" for i in range(9)]  # three gather chunks: 4, 4 and 1 blocks
        assert c.swap_out(list(range(9)), keys, wait="persisted").status == ["stored"] * 9
        assert len(written) == 9 and len(set(written)) == 9
        failures = sum(s.value for metric_family in d.daemon.metrics.registry.collect()
                       if metric_family.name == "kvswap_write_failures" for s in metric_family.samples
                       if s.name == "kvswap_write_failures_total")
        assert failures == 0  # a stored record is not a failure


def test_a_bug_in_the_write_path_answers_internal_and_frees_every_slot(tmp_path: Path, cache: HostKVCache,
                                                                       caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvswap.daemon import swapper as swapper_module

    def broken(tiers, pulled, item):
        raise RuntimeError("a bug")

    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        slots = c.stats()["write_staging"]["slots"]
        monkeypatch.setattr(swapper_module, "_write_record", broken)
        with caplog.at_level("ERROR"):
            out = c.swap_out(list(range(6)), [f"k{i}" for i in range(6)], wait="persisted")
        assert out.status == ["internal"] * 6 and out.failed == 6
        lines = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("writes of"))
        # One per gather chunk: (0, 1), (1, 4), (4, 6).
        assert lines == ["writes of 1 records failed", "writes of 2 records failed", "writes of 3 records failed"]
        assert metric(d, "kvswap_write_failures_total", code="internal") == 6
        stats = c.stats()
        assert (stats["pending_writes"], stats["write_staging"]["free"]) == (0, slots)


def test_a_deadline_counts_down_to_zero_and_an_expired_one_is_dead_at_once() -> None:
    assert Deadline(0.0).remaining() == 0.0 and not Deadline(0.0).live()
    deadline = Deadline(60)
    assert 59 < deadline.remaining() <= 60 and deadline.live()
    deadline.expire()  # the server gave up on the request: copies stop though time is left
    assert not deadline.live() and deadline.remaining() > 59


def test_a_write_that_raises_a_bug_is_internal_for_its_record_alone(tmp_path: Path, cache: HostKVCache,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0], ["head"], wait="persisted").stored == 1
        tiers = d.daemon.swapper.registration.tiers
        real_write = tiers.write

        def buggy(key, payload):
            if key == "bad":
                raise RuntimeError("a bug")
            return real_write(key, payload)

        tiers.write = buggy
        with caplog.at_level("ERROR"):
            out = c.swap_out([1, 2], ["bad", "good"], wait="persisted")
        assert out.status == ["internal", "stored"] and out.failed == 1
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("write of")] == [
            "write of bad failed"]


def test_copies_reads_and_writes_run_on_their_own_named_threads(tmp_path: Path, cache: HostKVCache) -> None:
    threads: dict[str, set[str]] = {"write": set(), "read": set(), "copy": set()}
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, write_threads=2, read_threads=3) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        disk = d.daemon.file_backend.disk
        real_read = disk.read_file
        mover = d.daemon.swapper.registration.mover
        real_gather = mover.gather_blocks

        def gather(*args, **kwargs):
            threads["copy"].add(threading.current_thread().name)
            return real_gather(*args, **kwargs)

        def read(*args, **kwargs):
            threads["read"].add(threading.current_thread().name)
            return real_read(*args, **kwargs)

        mover.gather_blocks = gather
        disk.read_file = read
        with GatedWrites(disk) as gate:
            real_write = gate.original

            def write(*args, **kwargs):
                threads["write"].add(threading.current_thread().name)
                return real_write(*args, **kwargs)

            gate.original = write
            # Three gather chunks, each written on a write thread while the others are held:
            # only two threads may hold writes.
            assert c.swap_out(list(range(12)), [f"k{i}" for i in range(12)]).queued == 12
            assert gate.started.acquire(timeout=10) and gate.started.acquire(timeout=10)
            gate.gate.set()
            assert c.flush() == 1
        cache.zero_blocks(list(range(20, 32)))
        assert c.swap_in([f"k{i}" for i in range(12)], list(range(20, 32))).loaded == 12
    assert threads["write"] == {"kvswap-write_0", "kvswap-write_1"}
    assert threads["copy"] == {"kvswap-copy_0"}
    assert threads["read"] <= {"kvswap-read_0", "kvswap-read_1", "kvswap-read_2"} and threads["read"]


def test_the_failure_line_names_the_four_commonest_kinds_only(tmp_path: Path, cache: HostKVCache,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        tiers = d.daemon.swapper.registration.tiers

        def refusing(key, payload):  # a tier that says no, a different reason for each record
            raise IOFailure("not stored", tier="file", reason=f"reason {key}")

        tiers.write = refusing
        keys = ["r1", "r2", "r2b", "r3", "r4", "r5"]
        with caplog.at_level("WARNING"):
            out = c.swap_out(list(range(6)), keys, wait="persisted")
        assert out.status == ["io_error"] * 6
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("swap_out:")]
        assert lines == ["swap_out: 6 of 6 records not stored: tier file: io_error x1 (reason r1); tier file: io_error"
                         " x1 (reason r2); tier file: io_error x1 (reason r2b); tier file: io_error x1 (reason r3)"]


def test_upkeep_evicts_what_other_writers_stored_past_the_cap(tmp_path: Path, cache: HostKVCache) -> None:
    root = tmp_path / "s"
    record_bytes = cache.layout.record_bytes
    per_file = record.header_len_for(record_bytes) + record_bytes
    with InProcessDaemon(root, file_layout="files", host_tier_bytes=0, storage_max_bytes=10 * per_file, storage_rescan_interval_s=0.05,
                         maintenance_interval_s=0.05) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"])
        # Another daemon sharing the directory, not the evicting one: it writes past the cap.
        neighbour = FileBackend(str(root), layout="files").open_store(cache.layout.fingerprint(), cache.layout.to_wire(), record_bytes)
        for i in range(12):
            neighbour.put(f"n{i}", memoryview(cache.block_record(i)))
        # The daemon's background pass rescans, sees 12 records, and evicts down to the low watermark.
        assert wait_until(lambda: c.stats()["tiers"]["file"].get("evicted_capacity", 0) >= 4, 10)
        assert c.stats()["tiers"]["file"]["records"] <= 8


def test_ram_hits_are_scattered_from_their_slots_and_counted_as_host_reads(tmp_path: Path, cache: HostKVCache) -> None:
    record_bytes = cache.layout.record_bytes
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=1 << 22) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert c.swap_out([0, 1, 2], ["a", "b", "c"], wait="persisted").stored == 3
        hits = metric(d, "kvswap_tier_ops_total", tier="host", op="get", result="hit")
        read = metric(d, "kvswap_tier_bytes_total", tier="host", direction="read")
        scatter = RecordingScatter(d.daemon.swapper.registration.mover, batches=False)
        cache.zero_blocks([10, 11, 12])
        result = c.swap_in(["a", "b", "c"], [10, 11, 12])
        # Straight from the pool's slots, in one scatter (not one per record from read slots).
        assert scatter.calls == [[10, 11, 12]]
        assert (result.loaded, result.status) == (3, ["loaded"] * 3)
        assert [cache.block_record(b) for b in (10, 11, 12)] == [cache.block_record(b) for b in (0, 1, 2)]
        assert metric(d, "kvswap_tier_ops_total", tier="host", op="get", result="hit") - hits == 3
        assert metric(d, "kvswap_tier_bytes_total", tier="host", direction="read") - read == 3 * record_bytes
        assert metric(d, "kvswap_tier_ops_total", tier="file", op="get", result="hit") == 0  # none read from disk


@given(st.integers(min_value=0, max_value=200))
def test_gather_chunks_cover_the_request_in_order_and_start_with_one_block(count: int) -> None:
    chunks = gather_chunks(count)
    assert [i for start, stop in chunks for i in range(start, stop)] == list(range(count))
    assert all(0 < stop - start <= GATHER_CHUNK for start, stop in chunks)
    if count:
        assert chunks[0] == (0, 1)  # the first write waits for one block's copy only
        assert all(start % GATHER_CHUNK == 0 for start, _ in chunks[2:])
