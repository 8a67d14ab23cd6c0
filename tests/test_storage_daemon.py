"""The file tier in production, through real daemons: a capacity cap, three daemons sharing
one directory, and a restart that serves lookups before its scan ends."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvswap.backends.file_store import FileStore
from kvswap.backends.slab_store import SlabStore
from kvswap.protocol import CacheLayout, Client, HostKVCache

from disk_records import LAYOUTS, record_bytes_on_disk
from support import DaemonProcess, InProcessDaemon, free_port, wait_until

LAYOUT = CacheLayout("cap-test", num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64)
FILE_BYTES = 4096 + LAYOUT.record_bytes  # 16 KiB records carry a page-sized header (a slab slot: the same)
#: The store class each ``--file-layout`` opens, for tests that hold its start-up scan.
STORE_CLASS = {"slab": SlabStore, "files": FileStore}


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_capped_store_stays_under_its_cap_and_keeps_recent_records(tmp_path: Path, file_layout: str) -> None:
    cap = 40 * FILE_BYTES
    store = tmp_path / "store"
    # No RAM tier: what the file tier evicted must be gone.
    daemon = DaemonProcess(store, free_port(), free_port(), extra_args=["--storage-max-bytes", str(cap),
                                                                        "--host-tier-bytes", "0",
                                                                        "--file-layout", file_layout]).start()
    try:
        with HostKVCache.create(LAYOUT) as cache, Client(daemon.endpoint, timeout=10) as c:
            cache.fill_random(3)
            c.register(cache)
            keys = [f"cap-{i}" for i in range(120)]  # 3x the cap
            peak = 0
            for start in range(0, len(keys), 8):
                batch = keys[start : start + 8]
                out = c.swap_out(list(range(len(batch))), batch, wait="persisted")
                assert out.status == ["stored"] * len(batch)
                peak = max(peak, record_bytes_on_disk(store))
            assert 0 < peak <= cap + FILE_BYTES
            assert 0 < record_bytes_on_disk(store) <= cap
            assert c.ping() < 5
            # The most recent records are all there; the oldest are gone.
            assert c.lookup(keys[-16:]) == 16
            assert c.lookup(keys[:1]) == 0
            assert c.swap_in(keys[-4:], [40, 41, 42, 43]).loaded == 4
        assert daemon.metric("kvswap_evictions_total", tier="file", reason="capacity") >= 70
        assert daemon.metric("kvswap_store_capacity_bytes", tier="file") == cap
        assert daemon.metric("kvswap_stored_bytes", tier="file") <= cap
    finally:
        assert daemon.stop() == 0


def _leaders(daemons: list[DaemonProcess]) -> list[int]:
    return [i for i, d in enumerate(daemons) if d.alive and d.metric("kvswap_eviction_leader", tier="file") == 1]


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_three_daemons_share_one_directory(tmp_path: Path, file_layout: str) -> None:
    store = tmp_path / "shared"
    cap = 48 * FILE_BYTES
    args = ["--storage-max-bytes", str(cap), "--storage-rescan-interval-s", "0.3", "--maintenance-interval-s", "0.1",
            "--file-layout", file_layout]
    daemons = [DaemonProcess(store, free_port(), free_port(), extra_args=args).start() for _ in range(3)]
    caches = [HostKVCache.create(LAYOUT) for _ in daemons]
    try:
        clients = [Client(d.endpoint, timeout=10) for d in daemons]
        for i, (c, cache) in enumerate(zip(clients, caches)):
            cache.fill_random(10 + i)
            c.register(cache)
        # Each writes its own keys; all see every record, whoever wrote it.
        for i, c in enumerate(clients):
            c.swap_out(list(range(8)), [f"d{i}-{k}" for k in range(8)], wait="persisted")
        for i, c in enumerate(clients):
            for j in range(3):
                assert c.lookup([f"d{j}-{k}" for k in range(8)]) == 8
        caches[0].zero_blocks([50])
        assert clients[0].swap_in(["d2-5"], [50]).loaded == 1
        assert caches[0].block_record(50) == caches[2].block_record(5)

        # Exactly one evicts.
        assert wait_until(lambda: len(_leaders(daemons)) == 1, timeout=10)
        leader = _leaders(daemons)[0]
        for round_ in range(10):
            for i, c in enumerate(clients):
                c.swap_out(list(range(8)), [f"r{round_}-d{i}-{k}" for k in range(8)], wait="persisted")
        assert wait_until(lambda: 0 < record_bytes_on_disk(store) <= cap, timeout=15)
        evicting = [i for i, d in enumerate(daemons)
                    if d.metric("kvswap_evictions_total", tier="file", reason="capacity") > 0]
        assert evicting == [leader]

        # Kill the evicting daemon: another takes over and keeps the cap.
        daemons[leader].kill()
        clients[leader].close()
        survivors = [i for i in range(3) if i != leader]
        assert wait_until(lambda: len(_leaders(daemons)) == 1 and _leaders(daemons)[0] in survivors, timeout=10)
        new_leader = _leaders(daemons)[0]
        for round_ in range(10):
            for i in survivors:
                clients[i].swap_out(list(range(8)), [f"t{round_}-d{i}-{k}" for k in range(8)], wait="persisted")
        assert wait_until(lambda: 0 < record_bytes_on_disk(store) <= cap, timeout=15)
        assert daemons[new_leader].metric("kvswap_evictions_total", tier="file", reason="capacity") > 0
        for i in survivors:
            clients[i].close()
    finally:
        for d in daemons:
            d.stop()
        for cache in caches:
            cache.close()


@pytest.mark.parametrize(("written", "read"), [("files", "files"), ("slab", "slab"), ("files", "slab")],
                         ids=["files", "slab", "files-then-slab"])
def test_lookups_work_before_the_start_up_scan_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str,
                                                    read: str) -> None:
    """Records written in layout ``written``, then served by a daemon in layout ``read`` whose
    start-up scan is held: the files layout's lookups stat the files meanwhile; the slab layout
    replayed its journals when the store opened (its scan is the old layout's files: a
    directory moved over from it serves them before that scan ends, too)."""
    store = tmp_path / "store"
    with HostKVCache.create(LAYOUT) as cache:
        cache.fill_random(5)
        keys = [f"early-{i}" for i in range(16)]
        with InProcessDaemon(store, file_layout=written) as d, Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            c.swap_out(list(range(16)), keys, wait="persisted")
        # A dead writer's temp file, left by a crash.
        namespace = LAYOUT.fingerprint()
        leftover = store / namespace / "tmp" / f"{'0' * 32}.{os.uname().nodename}.{2**22 + 7}.deadbeef.cafe.tmp"
        leftover.write_bytes(b"torn")

        gate = threading.Event()
        store_class = STORE_CLASS[read]
        real_scan = store_class.scan

        def slow_scan(self):
            assert gate.wait(30), "the test never released the scan"
            return real_scan(self)

        monkeypatch.setattr(store_class, "scan", slow_scan)
        with InProcessDaemon(store, file_layout=read) as d, Client(d.endpoint, timeout=10) as c:
            c.register(cache)
            assert c.stats()["tiers"]["file"]["scan_complete"] is False
            assert c.lookup(keys) == 16  # answered from the directory while the scan waits
            cache.zero_blocks([30])
            assert c.swap_in(keys[3:4], [30]).loaded == 1
            gate.set()
            assert wait_until(lambda: c.stats()["tiers"]["file"]["scan_complete"] is True)
            stats = c.stats()["tiers"]["file"]
            assert stats["records"] == 16
            assert stats["temp_reclaimed"] == 1
            assert not leftover.exists()


def _lock_holders(lock: Path) -> int:
    """This process's descriptors open on ``lock`` (the in-process daemon's among them)."""
    target = os.path.realpath(lock)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            continue
    return count


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_namespace_closed_during_its_scan_leaves_the_lock_to_its_next_store(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch,
                                                                               file_layout: str) -> None:
    """Issue 22 (4): register layout A, then B from the same pid while A's start-up scan runs,
    then A again. The scan of the closed A took evict.lock (and kept its descriptor), so the
    new A store never led and the cap stopped holding."""
    store = tmp_path / "store"
    cap = 12 * FILE_BYTES
    other = CacheLayout("cap-test-b", num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64)
    lock = store / LAYOUT.fingerprint() / "evict.lock"
    gate, held = threading.Event(), threading.Event()
    store_class = STORE_CLASS[file_layout]
    real_scan = store_class.scan

    def first_scan_waits(self):
        if self.namespace == LAYOUT.fingerprint() and not held.is_set():
            held.set()
            assert gate.wait(30), "the test never released the scan"
        return real_scan(self)

    monkeypatch.setattr(store_class, "scan", first_scan_waits)
    with HostKVCache.create(LAYOUT) as a, HostKVCache.create(other) as b, \
            InProcessDaemon(store, storage_max_bytes=cap, maintenance_interval_s=0.05, file_layout=file_layout) as d, \
            Client(d.endpoint, timeout=10) as c:
        a.fill_random(1)
        b.fill_random(2)
        c.register(a)
        assert held.wait(10)  # A's scan is under way
        c.register(b)  # closes A's stores
        gate.set()
        assert wait_until(lambda: c.stats()["tiers"]["file"]["scan_complete"] is True)  # B's scan ran after A's
        for _ in range(3):  # each round trip used to leak one more descriptor on A's lock
            c.register(a)
            assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"] is True, timeout=10), c.stats()["tiers"]
            assert _lock_holders(lock) == 1
            c.register(b)
            assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"] is True, timeout=10)
            assert _lock_holders(lock) == 0
        c.register(a)
        assert wait_until(lambda: c.stats()["tiers"]["file"]["leader"] is True, timeout=10)
        for start in range(0, 32, 8):  # well past the cap
            keys = [f"again-{i}" for i in range(start, start + 8)]
            assert c.swap_out(list(range(8)), keys, wait="persisted").status == ["stored"] * 8
            assert 0 < record_bytes_on_disk(store / LAYOUT.fingerprint()) <= cap
        file_tier = c.stats()["tiers"]["file"]
        assert file_tier["bytes"] <= cap and file_tier["evicted_capacity"] + file_tier["records"] == 32


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_background_eviction_runs_on_the_maintenance_interval_not_the_remote_checks(tmp_path: Path,
                                                                                   file_layout: str) -> None:
    """Issue 22 (12c): storage maintenance comes every --maintenance-interval-s, whatever the
    remote health interval. With maintenance every 50 ms and remote probes once an hour, each
    round of writes to the high watermark is evicted back to the low one well within a minute;
    maintenance tied to the remote interval would manage one round at most."""
    cap_records = 20
    layout_args = ["--file-layout", file_layout]
    probe = DaemonProcess(tmp_path / "probe", free_port(), free_port(),
                          extra_args=["--host-tier-bytes", "0", *layout_args]).start()
    try:
        with HostKVCache.create(LAYOUT) as cache, Client(probe.endpoint, timeout=10) as c:
            c.register(cache)
            c.swap_out([0], ["size"], wait="persisted")
            file_bytes = c.stats()["tiers"]["file"]["bytes"]  # one record on disk, header included
    finally:
        assert probe.stop() == 0
    cap = cap_records * file_bytes
    daemon = DaemonProcess(tmp_path / "store", free_port(), free_port(),
                           extra_args=["--storage-max-bytes", str(cap), "--host-tier-bytes", "0", *layout_args,
                                       "--maintenance-interval-s", "0.05", "--remote-check-interval-s", "3600"]).start()
    try:
        with HostKVCache.create(LAYOUT) as cache, Client(daemon.endpoint, timeout=10) as c:
            cache.fill_random(4)
            c.register(cache)

            def file_tier() -> dict:
                return c.stats()["tiers"]["file"]

            assert wait_until(lambda: file_tier()["leader"] is True)
            # Up to the cap (over the 95 % high watermark, so no write evicts): only the
            # background pass can take the store down to 85 % (17 records), three at a time.
            batches = [[f"first-{i}" for i in range(cap_records)], ["second-0", "second-1", "second-2"],
                       ["third-0", "third-1", "third-2"]]
            for round_, keys in enumerate(batches, 1):
                assert c.swap_out(list(range(len(keys))), keys, wait="persisted").status == ["stored"] * len(keys)
                assert wait_until(lambda: file_tier()["records"] == 17, timeout=30), file_tier()
                assert file_tier()["evicted_capacity"] == 3 * round_
                assert record_bytes_on_disk(tmp_path / "store") == 17 * file_bytes
    finally:
        assert daemon.stop() == 0
