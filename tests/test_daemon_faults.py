"""Faults injected at the file-system seam of a daemon running in this process, driven by the
real client over a real socket. The faults are injected where the files layout writes and reads
(``Disk.write_file``, ``Disk.read_file``), so these daemons run ``file_layout="files"``; the slab
layout's seam (``Disk.write_at``, ``read_at``, ``grow``, ``append``) is faulted in
tests/test_slab_store.py."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvswap.backends.file_store import record_name
from kvswap.protocol import Busy, Client, HostKVCache, Timeout

from support import GatedWrites, InProcessDaemon, wait_until


def test_swap_in_of_a_key_still_being_written_returns_its_data(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files") as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            expected = [cache.block_record(b) for b in (3, 4)]
            out = c.swap_out([3, 4], ["w0", "w1"], wait="copied")
            assert out.status == ["queued", "queued"]
            assert gate.started.acquire(timeout=10)
            assert c.stats()["pending_writes"] == 2
            # Nothing is on disk yet; the daemon serves the staged bytes.
            assert c.lookup(["w0", "w1"]) == 2
            cache.zero_blocks([10, 11])
            result = c.swap_in(["w0", "w1"], [10, 11])
            assert result.status == ["loaded", "loaded"]
            assert [cache.block_record(10), cache.block_record(11)] == expected
            # Pings and lookups are answered while writes are stuck.
            assert c.ping() < 1.0
            gate.gate.set()
            c.flush()
            assert c.stats()["pending_writes"] == 0
            assert c.stats()["tiers"]["file"]["records"] == 2


def test_full_disk_is_a_typed_status_and_reads_keep_working(tmp_path: Path, cache: HostKVCache) -> None:
    # No RAM tier: a record the disk refused must not be found anywhere. One write thread: with
    # more, x2's write may start before x1's fails (each record is a job of its own), and then
    # both retry; the counts below are those of the order the chain rule is about.
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0, write_threads=1) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"])  # evicts once its scan is done
        c.swap_out(list(range(10, 20)), [f"old-{i}" for i in range(10)], wait="persisted")
        c.swap_out([0], ["before"], wait="persisted")
        disk = d.daemon.file_backend.disk

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        disk.write_file = no_space
        out = c.swap_out([1, 2], ["x1", "x2"], wait="persisted")
        assert out.status == ["no_space", "no_space"]
        assert out.failed == 2
        assert c.lookup(["x1"]) == 0
        # x1's failed write evicted records to make room (the old chain's tail, not its head),
        # then gave up; x2 was not even tried: with x1 missing no lookup could reach it.
        stats = c.stats()["tiers"]["file"]
        assert stats["enospc_retries"] == 1 and stats["evicted_enospc"] == 2 and stats["chain_refused"] == 1
        assert c.lookup([f"old-{i}" for i in range(10)]) == 8
        cache.zero_blocks([9])
        assert c.swap_in(["before"], [9]).loaded == 1
        assert cache.block_record(9) == cache.block_record(0)

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        disk.write_file = read_only
        assert c.swap_out([3], ["x3"], wait="persisted").status == ["io_error"]

        def denied(*args, **kwargs):
            raise OSError(errno.EACCES, "Permission denied")

        disk.write_file = denied
        assert c.swap_out([4], ["x4"], wait="persisted").status == ["io_error"]
        cache.zero_blocks([9])
        assert c.swap_in(["before"], [9]).status == ["loaded"]  # reads still work
        assert c.ping() < 1.0


def test_read_errors_are_per_key_statuses(tmp_path: Path, cache: HostKVCache) -> None:
    # No RAM tier: the reads must reach the failing disk.
    with InProcessDaemon(tmp_path / "s", file_layout="files", host_tier_bytes=0) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        c.swap_out([0, 1], ["r0", "r1"], wait="persisted")
        disk = d.daemon.file_backend.disk
        original = disk.read_file

        failing = record_name("r1")

        def flaky(path, parts):
            if failing in path:
                raise OSError(errno.EIO, "Input/output error")
            return original(path, parts)

        disk.read_file = flaky
        result = c.swap_in(["r0", "r1"], [5, 6])
        assert result.status == ["loaded", "error"]
        assert result.loaded == 1
        disk.read_file = original
        result = c.swap_in(["r0", "r1"], [5, 6])
        assert result.status == ["loaded", "loaded"]


def test_a_stuck_write_times_out_with_an_answer(tmp_path: Path, cache: HostKVCache) -> None:
    with InProcessDaemon(tmp_path / "s", file_layout="files") as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            with pytest.raises(Timeout) as err:
                c.swap_out([0], ["slow"], wait="persisted", timeout=0.3)
            assert err.value.details.get("timeout_ms") == 300  # the daemon's own answer, not a local one
            assert c.ping() < 1.0
            gate.gate.set()
            c.flush()
            assert c.lookup(["slow"]) == 1


def test_full_write_staging_answers_busy(tmp_path: Path, cache: HostKVCache) -> None:
    record = cache.layout.record_bytes
    with InProcessDaemon(tmp_path / "s", file_layout="files", write_staging_bytes=4 * max(record, 4096)) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            assert c.swap_out([0, 1, 2, 3], ["b0", "b1", "b2", "b3"]).queued == 4
            with pytest.raises(Busy) as err:
                c.swap_out([4], ["b4"])
            assert err.value.details == {"needed": 1, "free": 0, "pending_writes": 4, "waiting": 0}
            # Reads have their own staging and still work.
            assert c.swap_in(["b0"], [20]).loaded == 1
            gate.gate.set()
            c.flush()
            assert c.swap_out([4], ["b4"], wait="persisted").status == ["stored"]


def test_partial_swap_out_stores_what_fits_and_says_which(tmp_path: Path, cache: HostKVCache) -> None:
    record = cache.layout.record_bytes
    with InProcessDaemon(tmp_path / "s", file_layout="files", write_staging_bytes=3 * max(record, 4096)) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        with GatedWrites(d.daemon.file_backend.disk) as gate:  # opened on the way out, even when a check fails
            first = c.swap_out([0, 1], ["p0", "p1"])
            assert first.queued == 2
            out = c.swap_out([2, 3, 4], ["p2", "p3", "p4"], partial=True)
            assert out.status == ["queued", "skipped", "skipped"]
            assert (out.queued, out.skipped, out.failed) == (1, 2, 0)
            gate.gate.set()
            c.flush()
            assert c.lookup(["p0", "p1", "p2", "p3"]) == 3


def test_a_register_of_another_size_that_fails_leaves_the_current_engine_swapping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine re-registers with another layout and the new namespace's directory cannot be
    made (a full disk): the registration it had stays, and so does staging of its size (before,
    its next swap_out failed with internal: the slots were the failed layout's size)."""
    from kvswap.backends import file_backend
    from kvswap.protocol import CacheLayout, IOFailure

    first = CacheLayout("faults-a", num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, head_dim=64)
    second = CacheLayout("faults-b", num_layers=2, num_blocks=16, block_size=16, num_kv_heads=2, head_dim=32)
    opened = file_backend.FileBackend.open_store

    def full_for_the_second(self, namespace, description, record_bytes):
        if record_bytes == second.record_bytes:
            raise IOFailure("no space left on device (injected)")
        return opened(self, namespace, description, record_bytes)

    with HostKVCache.create(first) as a, HostKVCache.create(second) as b, InProcessDaemon(tmp_path / "s", file_layout="files") as d, \
            Client(d.endpoint, timeout=10) as c:
        a.fill_random(1)
        c.register(a)
        c.swap_out([0], ["kept"], wait="persisted")
        monkeypatch.setattr(file_backend.FileBackend, "open_store", full_for_the_second)
        with pytest.raises(IOFailure):
            c.register(b)
        monkeypatch.setattr(file_backend.FileBackend, "open_store", opened)
        assert c.swap_out([1, 2], ["x", "y"], wait="persisted").status == ["stored", "stored"]
        a.zero_blocks([5, 6, 7])
        assert c.swap_in(["x", "y", "kept"], [5, 6, 7]).status == ["loaded"] * 3
        assert [a.block_record(i) for i in (5, 6, 7)] == [a.block_record(i) for i in (1, 2, 0)]
        assert d.daemon.swapper.staging.arena is not None
        assert d.daemon.swapper.staging.arena.record_bytes == first.record_bytes
