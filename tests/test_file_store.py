"""The file tier (kvswap.backends.file_store) against a real directory: byte-exact round
trips, the index, damaged and misplaced records, restarts, permissions, temp-file reclaim, and
faults injected through the ``Disk`` seam. Pure units, no daemon."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import tempfile
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from hypothesis import strategies as st

from kvswap.backends import file_store, record
from kvswap.backends.base import GetStatus
from kvswap.backends.disk import aligned_empty
from kvswap.backends.file_backend import Capacity, FileBackend
from kvswap.backends.file_store import Disk, FileStore, record_name
from kvswap.protocol.errors import IOFailure, NoSpace
from kvswap.protocol.layout import CacheLayout

LAYOUT = CacheLayout(model_id="test/model", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
RECORD_BYTES = LAYOUT.record_bytes  # 4 regions * 128 bytes
NAMESPACE = LAYOUT.fingerprint()
DESCRIPTION = LAYOUT.to_wire()
DEAD_PID = 2**22 + 12345  # above the largest pid_max Linux allows, so never a live process


def payload_for(seed: int, size: int = RECORD_BYTES) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8).tobytes())


def out_buffer(size: int = RECORD_BYTES) -> memoryview:
    return memoryview(bytearray(b"\xee" * size))


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "kv")  # not created yet: the store creates it, 0700


@pytest.fixture
def backend(root) -> FileBackend:
    return FileBackend(root, layout="files")


@pytest.fixture
def store(backend) -> FileStore:
    return backend.open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)


def tmp_files(store: FileStore) -> list[str]:
    return sorted(os.listdir(store.tmp_dir))


def record_files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".kvr"))


# -- round trip and the index ---------------------------------------------------------------


def test_put_then_get_is_byte_exact(store):
    payloads = {f"key-{i}": payload_for(i) for i in range(5)}
    for key, payload in payloads.items():
        assert store.put(key, payload) == 256 + RECORD_BYTES
    for key, payload in payloads.items():
        out = out_buffer()
        assert store.get_into(key, out) is GetStatus.LOADED
        assert bytes(out) == bytes(payload)


def test_get_into_numpy_staging(store):
    """The daemon reads straight into staging slots (numpy arrays)."""
    payload = payload_for(7)
    store.put("k", payload)
    out = np.zeros(RECORD_BYTES, dtype=np.uint8)
    assert store.get_into("k", memoryview(out)) is GetStatus.LOADED
    assert out.tobytes() == bytes(payload)


def test_large_record_uses_page_header(backend):
    size = 64 * 1024 + 100
    store = backend.open_store("ab" * 16, {"big": True}, size)
    payload = payload_for(3, size)
    assert store.put("big", payload) == 4096 + size
    (path,) = record_files(backend.root)
    assert os.path.getsize(path) == 4096 + size
    out = out_buffer(size)
    assert store.get_into("big", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload)


def test_file_is_a_record_in_the_documented_format(store, backend):
    payload = payload_for(1)
    store.put("blk:01", payload)
    name, path = store.path_of("blk:01")
    assert name == record_name("blk:01")
    assert path == os.path.join(backend.root, NAMESPACE, name[:2], name[2:4], name + ".kvr")
    with open(path, "rb") as f:
        data = f.read()
    assert bytes(record.decode_record(data, bytes.fromhex(NAMESPACE), "blk:01")) == bytes(payload)


def test_key_never_becomes_a_path(store, backend):
    name, path = store.path_of("../../etc/passwd")
    assert len(name) == 32 and all(c in "0123456789abcdef" for c in name)
    assert os.path.dirname(os.path.dirname(os.path.dirname(path))) == os.path.join(backend.root, NAMESPACE)
    assert "passwd" not in path


def test_get_of_missing_key_is_a_miss(store):
    assert store.get_into("never-stored", out_buffer()) is GetStatus.MISS
    assert store.usage() == {"records": 0, "bytes": 0}
    assert record_files(store.backend.root) == []


def test_cached_prefix_counts_keys_the_caller_holds_as_present(store):
    store.put("a", payload_for(1))
    store.put("c", payload_for(3))
    assert store.cached_prefix(["a", "b", "c", "d"]) == 1
    assert store.cached_prefix(["a", "b", "c", "d"], also_present={"b"}) == 3


def test_cached_prefix_across_the_pieces_it_names_keys_in(store):
    # Names are made 64, then 256, then 1,024 keys at a time: hits, holes the caller holds and
    # the first miss are found on either side of those boundaries.
    keys = [f"k{i}" for i in range(400)]
    held = {"k10", "k63", "k64", "k300"}
    for key in keys[:350]:
        if key not in held:
            store.put(key, payload_for(1))
    assert store.cached_prefix(keys[:64]) == 10
    assert store.cached_prefix(keys, also_present=held) == 350
    assert store.cached_prefix(keys[:320], also_present=held) == 320
    assert store.cached_prefix(keys[11:], also_present={"k63"}) == 64 - 11  # k64 neither stored nor held
    assert store.cached_prefix(keys[65:], also_present=held) == 350 - 65
    assert store.cached_prefix([]) == 0


def test_contains(store):
    assert store.contains("a") is False
    store.put("a", payload_for(1))
    assert store.contains("a") is True
    assert store.contains("b") is False


def test_usage_counts_records_and_bytes(store):
    per_file = 256 + RECORD_BYTES
    assert store.usage() == {"records": 0, "bytes": 0}
    for i in range(3):
        store.put(f"k{i}", payload_for(i))
    assert store.usage() == {"records": 3, "bytes": 3 * per_file}
    store.put("k0", payload_for(99))  # replacing a key does not count it twice
    assert store.usage() == {"records": 3, "bytes": 3 * per_file}
    out = out_buffer()
    assert store.get_into("k0", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(99))


def test_stats_name_every_figure(root, monkeypatch):
    clock = iter([100.0, 100.1234567, 100.2])  # the scan starts, ends, and notes when it ran
    monkeypatch.setattr(file_store, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    per_file = 256 + RECORD_BYTES
    capacity = Capacity(max_bytes=10 * per_file, min_free_bytes=4096)
    store = FileBackend(root, capacity=capacity, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    store.put("k", payload_for(1))
    assert store.scan() == 1
    assert store.stats() == {
        "records": 1, "bytes": per_file, "leader": True, "scan_complete": True, "scan_seconds": 0.123,
        "stuck": 0, "unreachable": 0, "max_bytes": 10 * per_file, "min_free_bytes": 4096, "direct_io": False,
        "temp_reclaimed": 0, "scan_records": 1, "leader_elections": 1}


def test_put_refuses_wrong_size(store):
    with pytest.raises(ValueError) as info:
        store.put("k", payload_for(1, RECORD_BYTES - 1))
    assert str(info.value) == f"payload of {RECORD_BYTES - 1} bytes, the namespace stores {RECORD_BYTES}"
    with pytest.raises(ValueError):
        store.put("k", payload_for(1, RECORD_BYTES + 1))
    assert record_files(store.backend.root) == []
    assert store.usage() == {"records": 0, "bytes": 0}


def test_delete(store):
    store.put("a", payload_for(1))
    store.put("b", payload_for(2))
    assert store.delete("a") is True
    assert store.delete("a") is False
    assert store.contains("a") is False
    assert store.get_into("a", out_buffer()) is GetStatus.MISS
    assert store.usage() == {"records": 1, "bytes": 256 + RECORD_BYTES}
    out = out_buffer()
    assert store.get_into("b", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(2))


def test_clear(store, backend):
    for i in range(4):
        store.put(f"k{i}", payload_for(i))
    assert len(record_files(backend.root)) == 4
    assert store.clear() == 4
    assert record_files(backend.root) == []
    assert store.usage() == {"records": 0, "bytes": 0}
    assert store.contains("k0") is False
    assert store.get_into("k1", out_buffer()) is GetStatus.MISS
    assert store.clear() == 0
    # the namespace stays usable
    store.put("k0", payload_for(5))
    assert store.get_into("k0", out_buffer()) is GetStatus.LOADED


def test_namespaces_do_not_see_each_other(backend):
    a = backend.open_store("aa" * 16, {}, RECORD_BYTES)
    b = backend.open_store("bb" * 16, {}, RECORD_BYTES)
    a.put("shared-key", payload_for(1))
    assert b.contains("shared-key") is False
    assert b.get_into("shared-key", out_buffer()) is GetStatus.MISS
    assert b.clear() == 0
    assert a.get_into("shared-key", out_buffer()) is GetStatus.LOADED


# -- damaged and misplaced records ------------------------------------------------------------


def _assert_corrupt_and_gone(store: FileStore, key: str) -> None:
    _, path = store.path_of(key)
    assert store.get_into(key, out_buffer()) is GetStatus.CORRUPT
    assert not os.path.exists(path)
    assert store.contains(key) is False
    assert store.get_into(key, out_buffer()) is GetStatus.MISS


@pytest.mark.parametrize("offset", [0, 1, RECORD_BYTES // 2, RECORD_BYTES - 1])
def test_flipped_payload_byte_is_corrupt_and_removed(store, offset):
    store.put("k", payload_for(1))
    store.put("other", payload_for(2))
    _, path = store.path_of("k")
    with open(path, "r+b") as f:
        f.seek(256 + offset)
        byte = f.read(1)
        f.seek(256 + offset)
        f.write(bytes([byte[0] ^ 0x10]))
    _assert_corrupt_and_gone(store, "k")
    assert store.usage() == {"records": 1, "bytes": 256 + RECORD_BYTES}


@pytest.mark.parametrize("offset", [0, 12, 60, 195])
def test_flipped_header_byte_is_corrupt_and_removed(store, offset):
    store.put("k", payload_for(1))
    _, path = store.path_of("k")
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    _assert_corrupt_and_gone(store, "k")


@pytest.mark.parametrize("size", [0, 100, 256, 256 + RECORD_BYTES - 1])
def test_truncated_file_is_corrupt_and_removed(store, size):
    store.put("k", payload_for(1))
    _, path = store.path_of("k")
    os.truncate(path, size)
    _assert_corrupt_and_gone(store, "k")


def test_a_wrong_sized_record_is_logged_with_its_path_key_and_reason(store, caplog):
    store.put("k", payload_for(1))
    _, path = store.path_of("k")
    os.truncate(path, 300)
    with caplog.at_level("WARNING"):
        assert store.get_into("k", out_buffer()) is GetStatus.CORRUPT
    assert f"corrupt record {path} for key k: record has the wrong size; removing it" in [
        r.getMessage() for r in caplog.records]
    assert store.stats()["corrupt"] == 1


def test_get_into_refuses_a_buffer_of_the_wrong_size(store):
    with pytest.raises(ValueError) as info:
        store.get_into("k", out_buffer(RECORD_BYTES - 1))
    assert str(info.value) == f"output buffer of {RECORD_BYTES - 1} bytes, records hold {RECORD_BYTES}"


def test_file_with_trailing_bytes_is_corrupt_and_removed(store):
    store.put("k", payload_for(1))
    _, path = store.path_of("k")
    with open(path, "ab") as f:
        f.write(b"\x00")
    _assert_corrupt_and_gone(store, "k")


def test_record_moved_onto_another_keys_path_is_corrupt(store):
    store.put("key-a", payload_for(1))
    store.put("key-b", payload_for(2))
    _, path_a = store.path_of("key-a")
    _, path_b = store.path_of("key-b")
    with open(path_a, "rb") as f:
        data = f.read()
    with open(path_b, "wb") as f:
        f.write(data)
    _assert_corrupt_and_gone(store, "key-b")
    out = out_buffer()
    assert store.get_into("key-a", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(1))


def test_record_of_another_namespace_is_corrupt(backend):
    a = backend.open_store("aa" * 16, {}, RECORD_BYTES)
    b = backend.open_store("bb" * 16, {}, RECORD_BYTES)
    a.put("k", payload_for(1))
    b.put("k", payload_for(2))
    with open(a.path_of("k")[1], "rb") as f:
        data = f.read()
    with open(b.path_of("k")[1], "wb") as f:
        f.write(data)
    _assert_corrupt_and_gone(b, "k")


# -- chains: records no lookup could reach are refused or dropped --------------------------------


def test_a_record_whose_predecessor_went_is_refused_with_its_key(store):
    store.expect_chain(["a", "b"])
    store.put("a", payload_for(1))
    assert store.delete("a") is True  # gone before b was written
    with pytest.raises(NoSpace) as info:
        store.put("b", payload_for(2))
    assert info.value.message == (
        "the record before this one in its chain was evicted; storing it would waste the space")
    assert info.value.details == {"key": "b", "tier": "file"}
    assert store.stats()["chain_refused"] == 1
    assert record_files(store.backend.root) == [] and store.usage() == {"records": 0, "bytes": 0}


def test_a_record_whose_predecessor_goes_while_it_is_written_is_removed_and_refused(store, monkeypatch):
    store.expect_chain(["a", "b"])
    store.put("a", payload_for(1))
    real_write = store.disk.write_file

    def write_while_a_goes(*args, **kwargs):
        assert store.delete("a") is True  # evicted (or deleted) by another thread meanwhile
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store.disk, "write_file", write_while_a_goes)
    with pytest.raises(NoSpace) as info:
        store.put("b", payload_for(2))
    assert info.value.details == {"key": "b", "tier": "file"}
    assert record_files(store.backend.root) == [] and store.usage() == {"records": 0, "bytes": 0}


def test_a_record_keeps_the_recency_it_was_given_before_its_write(root, monkeypatch):
    """A slow write does not make its record look newer than one written meanwhile: in memory,
    as in its file's mtime, it is as old as the moment it was stamped."""
    per_file = 256 + RECORD_BYTES
    store = FileBackend(root, capacity=Capacity(max_bytes=10 * per_file), layout="files").open_store(NAMESPACE, DESCRIPTION,
                                                                                      RECORD_BYTES)
    store.scan()
    real_write = store.disk.write_file
    slow_path = store.path_of("slow")[1]
    writing, go = threading.Event(), threading.Event()

    def held(tmp, final, *args, **kwargs):
        if final == slow_path:
            writing.set()
            assert go.wait(10)
        return real_write(tmp, final, *args, **kwargs)

    monkeypatch.setattr(store.disk, "write_file", held)
    slow = threading.Thread(target=store.put, args=("slow", payload_for(1)))
    slow.start()
    assert writing.wait(10)
    store.put("fast", payload_for(2))  # stamped after "slow", stored before it
    go.set()
    slow.join(10)
    assert store.contains("slow") and store.contains("fast")
    assert os.stat(slow_path).st_mtime_ns < os.stat(store.path_of("fast")[1]).st_mtime_ns
    assert store.evict(1, "capacity") == per_file
    assert (store.contains("slow"), store.contains("fast")) == (False, True)


def test_a_failed_write_removes_the_records_of_its_chain_already_written_after_it(store, monkeypatch):
    store.expect_chain(["a", "b", "c", "d"])
    store.put("c", payload_for(3))  # other write threads got there first
    store.put("d", payload_for(4))
    store.put("x", payload_for(9))  # no chain: stays
    monkeypatch.setattr(store.disk, "write_file", _raise(errno.EIO))
    with pytest.raises(IOFailure):
        store.put("b", payload_for(2))
    assert record_files(store.backend.root) == [store.path_of("x")[1]]
    assert store.usage() == {"records": 1, "bytes": 256 + RECORD_BYTES}
    assert store.stats()["evicted_stranded"] == 2


def test_a_stranded_record_that_cannot_be_removed_is_logged_and_the_rest_still_go(store, monkeypatch, caplog):
    store.expect_chain(["a", "b", "c"])
    store.put("b", payload_for(2))
    store.put("c", payload_for(3))
    stubborn = store.path_of("b")[1]
    _remove_failing_for(store, monkeypatch, stubborn)
    monkeypatch.setattr(store.disk, "write_file", _raise(errno.EIO))
    with caplog.at_level("WARNING"):
        with pytest.raises(IOFailure):
            store.put("a", payload_for(1))
    assert f"cannot remove stranded record {record_name('b')}: [Errno 1] Operation not permitted" in [
        r.getMessage() for r in caplog.records]
    assert record_files(store.backend.root) == [stubborn]
    assert store.stats()["evicted_stranded"] == 1


# -- restart, sharing, layout on disk ---------------------------------------------------------


def test_restart_finds_records_again(root, store):
    payloads = {f"k{i}": payload_for(i) for i in range(6)}
    for key, payload in payloads.items():
        store.put(key, payload)

    again = FileBackend(root, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    assert again.usage() == {"records": 0, "bytes": 0}
    assert again.scan() == 6
    assert again.scan_complete.is_set()
    assert again.usage() == {"records": 6, "bytes": 6 * (256 + RECORD_BYTES)}
    for key, payload in payloads.items():
        assert again.contains(key) is True
        out = out_buffer()
        assert again.get_into(key, out) is GetStatus.LOADED
        assert bytes(out) == bytes(payload)
    assert again.contains("not-there") is False


def test_contains_sees_another_instances_write_without_scan(root, store):
    neighbour = FileBackend(root, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    assert neighbour.contains("k") is False
    store.put("k", payload_for(1))
    assert neighbour.contains("k") is True
    assert neighbour.usage()["records"] == 1
    assert neighbour.cached_prefix(["k"]) == 1  # indexed under its own name: later lookups need no stat
    out = out_buffer()
    assert neighbour.get_into("k", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(1))


def test_permissions_are_private(root, store):
    other = store.backend.open_store("cd" * 16, {"x": 1}, RECORD_BYTES)
    for i in range(5):
        store.put(f"k{i}", payload_for(i))
    other.put("k", payload_for(9))
    dirs, files = [root], []
    for d, subdirs, names in os.walk(root):
        dirs += [os.path.join(d, s) for s in subdirs]
        files += [os.path.join(d, n) for n in names]
    assert len(files) == 5 + 1 + 2  # records + namespace.json of each namespace
    for d in dirs:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f


def test_namespace_json_holds_the_description(root, store):
    path = os.path.join(root, NAMESPACE, "namespace.json")
    with open(path) as f:
        meta = json.load(f)
    assert meta["namespace"] == NAMESPACE
    assert meta["record_bytes"] == RECORD_BYTES
    assert meta["record_format"] == record.FORMAT_VERSION
    assert meta["layout"] == json.loads(json.dumps(DESCRIPTION))
    assert tmp_files(store) == []  # written through a temp file that was renamed away


def test_a_new_namespace_directory_holds_its_description_and_temp_folder_only(root, store):
    assert sorted(os.listdir(os.path.join(root, NAMESPACE))) == ["namespace.json", "tmp"]
    stats = store.stats()  # before its start-up scan
    assert (stats["scan_complete"], stats["scan_seconds"], stats["leader"]) == (False, 0.0, False)


@pytest.mark.parametrize("err, exc, message", [
    (errno.EACCES, IOFailure, f"cannot prepare the namespace directory: {os.strerror(errno.EACCES)}"),
    (errno.ENOSPC, NoSpace, "no space left to prepare the namespace directory")])
def test_a_namespace_directory_that_cannot_be_made_is_a_typed_error(root, monkeypatch, err, exc, message):
    backend = FileBackend(root, layout="files")
    monkeypatch.setattr(backend.disk, "make_dirs", _raise(err))
    with pytest.raises(exc) as info:
        backend.open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    assert info.value.message == message
    assert info.value.details["path"] == os.path.join(root, NAMESPACE)


def test_reopening_keeps_namespace_json(root, store):
    path = os.path.join(root, NAMESPACE, "namespace.json")
    with open(path, "rb") as f:
        before = f.read()
    FileBackend(root, layout="files").open_store(NAMESPACE, {"something": "else"}, RECORD_BYTES)
    with open(path, "rb") as f:
        assert f.read() == before


def test_check_writable_creates_private_root(root):
    backend = FileBackend(root, layout="files")
    backend.check_writable()
    assert backend.disk.direct is False  # direct I/O is off unless asked for, even where it works
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert os.listdir(root) == []  # the probe is gone


def test_check_writable_fails_when_the_root_refuses_new_files(root, monkeypatch):
    real_open = os.open

    def refusing(path, flags, mode=0o777, **kwargs):
        if os.path.dirname(path) == root:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(file_store.os, "open", refusing)
    with pytest.raises(PermissionError):
        FileBackend(root, layout="files").check_writable()


def test_direct_io_where_the_file_system_allows_it(root, caplog):
    if not Disk.probe_direct(os.path.dirname(root)):
        pytest.skip("this file system refuses O_DIRECT")
    backend = FileBackend(root, direct_io="on", layout="files")
    with caplog.at_level("INFO"):
        backend.check_writable()
    assert backend.disk.direct is True
    assert f"direct I/O on in {root}" in [r.getMessage() for r in caplog.records]
    size = 64 * 1024  # page-sized header and payload: written and read with O_DIRECT
    store = backend.open_store(NAMESPACE, DESCRIPTION, size)
    for i in range(2):  # the second record reuses the thread's aligned header buffers
        payload = aligned_empty(size)
        payload[:] = np.frombuffer(bytes(payload_for(i, size)), dtype=np.uint8)
        assert store.put(f"k{i}", memoryview(payload)) == 4096 + size
    for i in range(2):
        out = aligned_empty(size)
        assert store.get_into(f"k{i}", memoryview(out)) is GetStatus.LOADED
        assert out.tobytes() == bytes(payload_for(i, size))


def _no_direct_io(monkeypatch) -> None:
    """A file system that refuses O_DIRECT (tmpfs, some network file systems)."""
    monkeypatch.setattr(file_store.Disk, "probe_direct", staticmethod(lambda directory: False))


def test_direct_io_on_is_refused_where_the_file_system_cannot(root, monkeypatch):
    _no_direct_io(monkeypatch)
    with pytest.raises(OSError) as info:
        FileBackend(root, direct_io="on", layout="files").check_writable()
    assert (info.value.errno, info.value.strerror) == (errno.EINVAL, "O_DIRECT is not supported here (--direct-io on)")


def test_direct_io_auto_falls_back_to_buffered_io_where_the_file_system_cannot(root, monkeypatch, caplog):
    _no_direct_io(monkeypatch)
    backend = FileBackend(root, direct_io="auto", layout="files")
    with caplog.at_level("INFO"):
        backend.check_writable()
    assert backend.disk.direct is False
    assert f"direct I/O unavailable, using buffered I/O in {root}" in [r.getMessage() for r in caplog.records]
    store = backend.open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    store.put("k", payload_for(1))
    out = out_buffer()
    assert store.get_into("k", out) is GetStatus.LOADED and bytes(out) == bytes(payload_for(1))


# -- temp files: reclaim the dead, keep the living ---------------------------------------------


def _touch(store: FileStore, name: str) -> str:
    path = os.path.join(store.tmp_dir, name)
    with open(path, "wb") as f:
        f.write(b"partial")
    return path


def test_scan_reclaims_dead_writers_temp_files(store):
    with pytest.raises(ProcessLookupError):
        os.kill(DEAD_PID, 0)
    host, me, inst = socket.gethostname(), os.getpid(), store.backend.instance
    n = record_name("k")
    dead = _touch(store, f"{n}.{host}.{DEAD_PID}.deadbeef.0123abcd.tmp")
    dead_ns = _touch(store, f"namespace.{host}.{DEAD_PID}.deadbeef.0123abcd.tmp")
    predecessor = _touch(store, f"{n}.{host}.{me}.{'0' * 8 if inst != '0' * 8 else '1' * 8}.0123abcd.tmp")
    mine = _touch(store, f"{n}.{host}.{me}.{inst}.0123abcd.tmp")
    other_host = _touch(store, f"{n}.some-other-host.{DEAD_PID}.deadbeef.0123abcd.tmp")
    not_ours = _touch(store, "README.txt")

    assert store.scan() == 0
    assert not os.path.exists(dead)
    assert not os.path.exists(dead_ns)
    assert not os.path.exists(predecessor)  # same pid, another instance: a restart in a container
    assert os.path.exists(mine)
    assert os.path.exists(other_host)  # another host's writer may be alive; not ours to judge
    assert os.path.exists(not_ours)
    assert tmp_files(store) == sorted(os.path.basename(p) for p in (mine, other_host, not_ours))


def test_scan_keeps_a_live_neighbours_temp_file(store):
    parent = os.getppid()  # alive while we run
    host = socket.gethostname()
    live = _touch(store, f"{record_name('k')}.{host}.{parent}.cafebabe.0123abcd.tmp")
    store.scan()
    assert os.path.exists(live)


def test_scan_parses_dotted_host_names(root, monkeypatch):
    monkeypatch.setattr(file_store.socket, "gethostname", lambda: "node-1.cluster.example.com")
    store = FileBackend(root, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    n = record_name("k")
    dead = _touch(store, f"{n}.node-1.cluster.example.com.{DEAD_PID}.deadbeef.0123abcd.tmp")
    other = _touch(store, f"{n}.node-1.cluster.example.org.{DEAD_PID}.deadbeef.0123abcd.tmp")
    store.scan()
    assert not os.path.exists(dead)
    assert os.path.exists(other)


def test_scan_ignores_temp_files_when_counting_records(store):
    store.put("k", payload_for(1))
    _touch(store, f"{record_name('x')}.{socket.gethostname()}.{os.getpid()}.{store.backend.instance}.00.tmp")
    assert store.scan() == 1


# -- faults through the Disk seam --------------------------------------------------------------


def _raise(err: int):
    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))
    return fail


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_write_without_space_is_no_space(store, monkeypatch, err):
    monkeypatch.setattr(store.disk, "write_file", _raise(err))
    with pytest.raises(NoSpace) as info:
        store.put("k", payload_for(1))
    assert info.value.message == "no space left to write a record"
    assert info.value.details == {"path": store.path_of("k")[1]}
    assert store.usage() == {"records": 0, "bytes": 0}
    assert store.contains("k") is False


def test_a_write_error_without_an_errno_is_io_failure_with_errno_0(store, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("the medium said no")

    monkeypatch.setattr(store.disk, "write_file", fail)
    with pytest.raises(IOFailure) as info:
        store.put("k", payload_for(1))
    assert info.value.message == "cannot write a record: the medium said no"
    assert info.value.details == {"errno": 0, "path": store.path_of("k")[1]}


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS, errno.EIO])
def test_write_failure_is_io_failure_with_errno(store, monkeypatch, err):
    monkeypatch.setattr(store.disk, "write_file", _raise(err))
    with pytest.raises(IOFailure) as info:
        store.put("k", payload_for(1))
    assert info.value.details["errno"] == err
    assert info.value.details["path"] == store.path_of("k")[1]
    assert store.usage() == {"records": 0, "bytes": 0}
    assert store.contains("k") is False


def test_read_failure_is_io_failure_and_keeps_the_record(store, monkeypatch):
    store.put("k", payload_for(1))
    _, path = store.path_of("k")
    monkeypatch.setattr(store.disk, "read_file", _raise(errno.EIO))
    with pytest.raises(IOFailure) as info:
        store.get_into("k", out_buffer())
    assert info.value.message == f"cannot read a record: {os.strerror(errno.EIO)}"
    assert info.value.details == {"errno": errno.EIO, "path": path}
    assert os.path.exists(path)  # a failing medium is not a corrupt record
    monkeypatch.undo()
    out = out_buffer()
    assert store.get_into("k", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(1))


def test_delete_failure_is_io_failure(store, monkeypatch):
    store.put("k", payload_for(1))
    monkeypatch.setattr(store.disk, "remove", _raise(errno.EROFS))
    with pytest.raises(IOFailure) as info:
        store.delete("k")
    assert info.value.message == f"cannot delete a record: {os.strerror(errno.EROFS)}"
    assert info.value.details == {"errno": errno.EROFS, "path": store.path_of("k")[1]}


def _remove_failing_for(store: FileStore, monkeypatch, stubborn: str) -> None:
    real = store.disk.remove

    def remove(path):
        if path == stubborn:
            raise OSError(errno.EPERM, "Operation not permitted")
        return real(path)

    monkeypatch.setattr(store.disk, "remove", remove)


def test_clear_logs_a_file_it_cannot_remove_and_removes_the_rest(store, monkeypatch, caplog):
    store.put("a", payload_for(1))
    store.put("b", payload_for(2))
    stubborn = store.path_of("a")[1]
    _remove_failing_for(store, monkeypatch, stubborn)
    with caplog.at_level("WARNING"):
        assert store.clear() == 1
    assert f"cannot remove {stubborn}: [Errno 1] Operation not permitted" in [r.getMessage() for r in caplog.records]
    assert record_files(store.backend.root) == [stubborn]


def test_a_corrupt_record_that_cannot_be_removed_is_logged_and_never_served(store, monkeypatch, caplog):
    store.put("k", payload_for(1))
    _, path = store.path_of("k")
    os.truncate(path, 300)
    _remove_failing_for(store, monkeypatch, path)
    with caplog.at_level("WARNING"):
        assert store.get_into("k", out_buffer()) is GetStatus.CORRUPT
    assert f"cannot remove corrupt record {path}: [Errno 1] Operation not permitted" in [
        r.getMessage() for r in caplog.records]
    assert store.usage() == {"records": 0, "bytes": 0}
    assert store.get_into("k", out_buffer()) is GetStatus.CORRUPT  # checked again, still not served
    monkeypatch.undo()
    _assert_corrupt_and_gone(store, "k")


def test_vanished_file_is_a_miss(store):
    store.put("k", payload_for(1))
    os.unlink(store.path_of("k")[1])
    assert store.get_into("k", out_buffer()) is GetStatus.MISS
    assert store.usage() == {"records": 0, "bytes": 0}


def _writev_that_fails_after(nbytes: int, err: int):
    real = os.writev

    def writev(fd, buffers):
        data = b"".join(bytes(b) for b in buffers)
        real(fd, [data[:nbytes]])
        raise OSError(err, os.strerror(err))
    return writev


@pytest.mark.parametrize("err, exc", [(errno.ENOSPC, NoSpace), (errno.EIO, IOFailure)])
def test_failed_write_leaves_no_temp_file(store, monkeypatch, err, exc):
    monkeypatch.setattr(file_store.os, "writev", _writev_that_fails_after(100, err))
    with pytest.raises(exc):
        store.put("k", payload_for(1))
    monkeypatch.undo()
    assert tmp_files(store) == []
    assert record_files(store.backend.root) == []
    assert store.get_into("k", out_buffer()) is GetStatus.MISS


def test_failed_overwrite_keeps_the_old_record(store, monkeypatch):
    store.put("k", payload_for(1))
    monkeypatch.setattr(file_store.os, "writev", _writev_that_fails_after(300, errno.ENOSPC))
    with pytest.raises(NoSpace):
        store.put("k", payload_for(2))
    monkeypatch.undo()
    assert tmp_files(store) == []
    out = out_buffer()
    assert store.get_into("k", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(1))


def test_failed_fdatasync_leaves_no_temp_file(root, monkeypatch):
    store = FileBackend(root, fsync="data", layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    monkeypatch.setattr(file_store.os, "fdatasync", _raise(errno.EIO))
    with pytest.raises(IOFailure) as info:
        store.put("k", payload_for(1))
    monkeypatch.undo()
    assert info.value.details["errno"] == errno.EIO
    assert tmp_files(store) == []
    assert record_files(root) == []


def test_failed_rename_leaves_no_temp_file(store, monkeypatch):
    monkeypatch.setattr(file_store.os, "rename", _raise(errno.EXDEV))
    with pytest.raises(IOFailure) as info:
        store.put("k", payload_for(1))
    monkeypatch.undo()
    assert info.value.details["errno"] == errno.EXDEV
    assert tmp_files(store) == []
    assert record_files(store.backend.root) == []


def test_short_writes_are_completed(store, monkeypatch):
    """A file system may write fewer bytes than asked (after a signal, on some network file
    systems); the writer carries on from where it stopped."""
    real = os.writev
    calls = []

    def writev(fd, buffers):
        data = b"".join(bytes(b) for b in buffers)
        calls.append(len(data))
        return real(fd, [data[:7]])

    monkeypatch.setattr(file_store.os, "writev", writev)
    payload = payload_for(4)
    assert store.put("k", payload) == 256 + RECORD_BYTES
    monkeypatch.undo()
    total = 256 + RECORD_BYTES
    assert len(calls) == -(-total // 7)
    assert calls == [total - 7 * i for i in range(len(calls))]  # each call asks for exactly the rest
    out = out_buffer()
    assert store.get_into("k", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload)
    assert tmp_files(store) == []


class RecordingDisk(Disk):
    """The real Disk, remembering which temp names it was given."""

    def __init__(self) -> None:
        super().__init__("none")
        self.tmp_seen: list[str] = []

    def write_file(self, tmp, final, parts, **options):
        self.tmp_seen.append(tmp)
        return super().write_file(tmp, final, parts, **options)


def test_temp_file_is_named_for_its_writer_and_removed_on_failure(root, monkeypatch):
    disk = RecordingDisk()
    backend = FileBackend(root, disk=disk, layout="files")
    store = backend.open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    disk.tmp_seen.clear()  # namespace.json went through it too

    seen_during_write = []
    real = os.writev

    def writev(fd, buffers):
        seen_during_write.extend(os.listdir(store.tmp_dir))  # the temp file exists mid-write
        real(fd, [bytes(buffers[0])[:10]])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_store.os, "writev", writev)
    with pytest.raises(NoSpace):
        store.put("k", payload_for(1))
    monkeypatch.undo()

    (tmp,) = disk.tmp_seen
    assert seen_during_write == [os.path.basename(tmp)]
    assert os.path.dirname(tmp) == store.tmp_dir
    parts = os.path.basename(tmp).split(".")
    host = socket.gethostname().split(".")
    assert parts[0] == record_name("k")
    assert parts[1:1 + len(host)] == host
    assert parts[-4:-2] == [str(os.getpid()), backend.instance]
    assert parts[-1] == "tmp"
    assert tmp_files(store) == []
    assert record_files(root) == []


def test_direct_io_mode_is_checked(root):
    with pytest.raises(ValueError) as info:
        FileBackend(root, direct_io="maybe", layout="files")
    assert str(info.value) == "direct_io must be one of ('auto', 'on', 'off')"


def test_fsync_mode_is_checked():
    with pytest.raises(ValueError):
        Disk("sometimes")
    for mode in file_store.FSYNC_MODES:
        assert Disk(mode).fsync == mode


@pytest.mark.parametrize("fsync", ["data", "strict"])
def test_fsync_modes_round_trip(root, fsync):
    store = FileBackend(root, fsync=fsync, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    store.put("k", payload_for(1))
    out = out_buffer()
    assert store.get_into("k", out) is GetStatus.LOADED
    assert bytes(out) == bytes(payload_for(1))


# -- against a model ---------------------------------------------------------------------------

_KEY_FIRST = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
_keys = st.builds(lambda a, b: a + b, st.sampled_from(_KEY_FIRST), st.text(_KEY_FIRST + ".:=+-", max_size=127))
MODEL_KEYS = 16
MODEL_CAP_RECORDS = 6
FILE_BYTES = 256 + RECORD_BYTES


def keys_on_disk(root: str) -> dict[str, bytes]:
    """Every record file under ``root``, read with the record format alone (not the store's
    index): key -> payload. Each must pass its own check."""
    out = {}
    for path in record_files(root):
        with open(path, "rb") as f:
            data = f.read()
        header = record.decode_header(data)
        payload = data[header.header_len:]
        record.verify(header, header.namespace, header.key, payload)
        out[header.key] = payload
    return out


class FileStoreModel(RuleBasedStateMachine):
    """The file tier under a capacity cap of MODEL_CAP_RECORDS records, against a dict plus a
    recency order. The model does not predict how much eviction frees (the store evicts down
    to its low watermark); it checks that whatever vanished was the least recently used,
    that the cap held, and, after every step, that the directory is exactly the model."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.root = os.path.join(self.tmp.name, "kv")
        self.store = self._open()
        self.model: dict[str, bytes] = {}
        #: Recency: key -> rank, higher is more recent. A restart sets every rank to 0, since
        #: file mtimes (the recency a restart sees) are too coarse to order writes a moment apart.
        self.rank: dict[str, int] = {}
        self.clock = 0
        self.keys: list[str] = []

    def _open(self) -> FileStore:
        backend = FileBackend(self.root, capacity=Capacity(max_bytes=MODEL_CAP_RECORDS * FILE_BYTES), layout="files")
        store = backend.open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
        store.scan()
        return store

    def _use(self, key: str) -> None:
        self.clock += 1
        self.rank[key] = self.clock

    def _check_evictions(self, survivors_expected: set[str], exempt: str | None = None) -> None:
        """Keys of the model no longer on disk were evicted: drop them from the model, after
        checking each was no more recent than any record that stayed."""
        on_disk = set(keys_on_disk(self.root))
        gone = survivors_expected - on_disk
        kept = (survivors_expected & on_disk) - {exempt}
        if gone and kept:
            assert max(self.rank[k] for k in gone) <= min(self.rank[k] for k in kept), \
                f"evicted {sorted(gone)} while less recently used {sorted(kept)} stayed"
        for k in gone:
            del self.model[k]
            del self.rank[k]

    @initialize(keys=st.lists(_keys, min_size=MODEL_KEYS, max_size=MODEL_KEYS, unique=True))
    def choose_keys(self, keys: list[str]) -> None:
        self.keys = keys

    @rule(k=st.integers(0, MODEL_KEYS - 1), seed=st.integers(0, 2**16))
    def put(self, k: int, seed: int) -> None:
        key = self.keys[k]
        payload = payload_for(seed)
        assert self.store.put(key, payload) == FILE_BYTES
        self._check_evictions(set(self.model) - {key})
        self.model[key] = bytes(payload)
        self._use(key)

    @rule(k=st.integers(0, MODEL_KEYS - 1))
    def get(self, k: int) -> None:
        key = self.keys[k]
        out = out_buffer()
        status = self.store.get_into(key, out)
        if key in self.model:
            assert status is GetStatus.LOADED and bytes(out) == self.model[key]
            self._use(key)
        else:
            assert status is GetStatus.MISS

    @rule(k=st.integers(0, MODEL_KEYS - 1))
    def contains(self, k: int) -> None:
        # An existence check alone (swap_out asks it of every key) is not a use: it must not
        # refresh recency, or a chain checked head first would end with its tail newest.
        key = self.keys[k]
        assert self.store.contains(key) is (key in self.model)

    @rule(k=st.integers(0, MODEL_KEYS - 1))
    def lookup(self, k: int) -> None:
        # A lookup is a use: the daemon counts the hit prefix, then touches it as a whole
        # (Swapper.lookup -> touch_chain), which refreshes recency like a read.
        key = self.keys[k]
        assert self.store.contains(key) is (key in self.model)
        if key in self.model:
            self.store.touch_chain([key])
            self._use(key)

    @rule(k=st.integers(0, MODEL_KEYS - 1))
    def delete(self, k: int) -> None:
        key = self.keys[k]
        assert self.store.delete(key) is (key in self.model)
        self.model.pop(key, None)
        self.rank.pop(key, None)

    @rule()
    def maintain(self) -> None:
        self.store.maintain()
        self._check_evictions(set(self.model))

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = self._open()
        assert self.store.usage()["records"] == len(self.model)
        self.rank = {k: 0 for k in self.model}

    @invariant()
    def directory_is_the_model(self) -> None:
        if not self.keys:
            return
        assert keys_on_disk(self.root) == self.model
        assert self.store.usage() == {"records": len(self.model), "bytes": len(self.model) * FILE_BYTES}
        assert self.store.usage()["bytes"] <= MODEL_CAP_RECORDS * FILE_BYTES
        assert tmp_files(self.store) == []

    def teardown(self) -> None:
        self.store.close()
        self.tmp.cleanup()


# No shrinking: a failing run prints its whole step list, and shrinking stalls (for minutes)
# on steps whose outcome depends on file mtimes, which a replay cannot reproduce.
FileStoreModel.TestCase.settings = settings(max_examples=40, stateful_step_count=60, deadline=None,
                                            phases=[Phase.explicit, Phase.reuse, Phase.generate])
test_file_store_against_a_model_with_a_cap = FileStoreModel.TestCase
