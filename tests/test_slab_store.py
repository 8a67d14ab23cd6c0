"""The file tier's slab layout (kvswap.backends.slab_store) against a real directory: byte-exact
round trips, restarts from the journals, torn and damaged journal entries, corrupt slots,
several daemons on one directory, capacity, compaction, the old layout read beside the new,
and a model-based run. What is on disk is read back with ``slab_journal.live_records``, which
replays the journals from the files alone. Pure units, no daemon."""

from __future__ import annotations

import errno
import os
import tempfile
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvswap.backends import record, slab_journal
from kvswap.backends.base import GetStatus
from kvswap.backends.file_backend import Capacity, FileBackend
from kvswap.backends.file_layout import record_name
from kvswap.backends.slab_store import SLAB_DIR, SlabStore
from kvswap.protocol.errors import IOFailure, NoSpace
from kvswap.protocol.layout import CacheLayout

LAYOUT = CacheLayout(model_id="test/slab", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
RECORD_BYTES = LAYOUT.record_bytes
NAMESPACE = LAYOUT.fingerprint()
DESCRIPTION = LAYOUT.to_wire()
SLOT = 256 + RECORD_BYTES  # a small record: 256-byte header, packed at 256 bytes


def payload_for(seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, size=RECORD_BYTES, dtype=np.uint8).tobytes())


def out_buffer() -> memoryview:
    return memoryview(bytearray(b"\xee" * RECORD_BYTES))


def open_store(root: str, records_cap: int = 0, **kw) -> SlabStore:
    backend = FileBackend(root, layout="slab", capacity=Capacity(max_bytes=records_cap * SLOT), **kw)
    store = backend.open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    assert isinstance(store, SlabStore)
    store.scan()
    return store


def slab_dir(root: str) -> str:
    return os.path.join(root, NAMESPACE, SLAB_DIR)


def on_disk(root: str) -> dict[str, bytes]:
    """key -> payload of every record the journals name, each read from its slot and checked
    with the record format alone."""
    out = {}
    for rec in slab_journal.live_records(slab_dir(root)):
        with open(rec.slab_path, "rb") as f:
            f.seek(rec.offset)
            data = f.read(SLOT)
        header = record.decode_header(data)
        payload = data[header.header_len: header.header_len + RECORD_BYTES]
        record.verify(header, bytes.fromhex(NAMESPACE), header.key, payload)
        assert record_name(header.key) == rec.name
        out[header.key] = payload
    return out


def get(store: SlabStore, key: str) -> tuple[GetStatus, bytes]:
    out = out_buffer()
    status = store.get_into(key, out)
    return status, bytes(out)


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "kv")


def test_round_trip_delete_and_restart(root) -> None:
    store = open_store(root)
    for i in range(20):
        assert store.put(f"k{i}", payload_for(i)) == SLOT
    assert [get(store, f"k{i}") for i in (3, 19)] == [(GetStatus.LOADED, bytes(payload_for(i))) for i in (3, 19)]
    assert get(store, "absent")[0] is GetStatus.MISS
    assert store.delete("k3") and not store.delete("k3") and not store.contains("k3")
    store.close()
    again = open_store(root)
    assert again.usage() == {"records": 19, "bytes": 19 * SLOT}
    assert get(again, "k19") == (GetStatus.LOADED, bytes(payload_for(19)))
    assert get(again, "k3")[0] is GetStatus.MISS
    assert set(on_disk(root)) == {f"k{i}" for i in range(20) if i != 3}
    # The restarted store took over the slab: no second slab, and the freed slot is reused.
    assert again.stats()["slabs"] == 1 and again.stats()["slabs_owned"] == 1
    again.put("new", payload_for(99))
    assert len(os.listdir(slab_dir(root))) == 3  # <id>.slab, .journal, .lock


def test_files_are_private(root) -> None:
    open_store(root).put("k", payload_for(1))
    for name in os.listdir(slab_dir(root)):
        assert os.stat(os.path.join(slab_dir(root), name)).st_mode & 0o777 == 0o600
    assert os.stat(slab_dir(root)).st_mode & 0o777 == 0o700


def _stored_and_closed(root: str, records: int) -> str:
    """Store ``k0..k{records-1}``, close the store; the path of its one journal."""
    store = open_store(root)
    for i in range(records):
        store.put(f"k{i}", payload_for(i))
    store.close()
    [journal_name] = [n for n in os.listdir(slab_dir(root)) if n.endswith(".journal")]
    return os.path.join(slab_dir(root), journal_name)


def test_a_torn_journal_tail_is_cut_and_the_rest_served(root) -> None:
    path = _stored_and_closed(root, 5)
    with open(path, "ab") as f:
        f.write(b"\x01" * 40)  # a SIGKILL in the middle of an append
    again = open_store(root)
    assert again.counters["journal_tail_cut"] == 1
    assert os.path.getsize(path) % slab_journal.ENTRY_BYTES == 0
    assert set(on_disk(root)) == {f"k{i}" for i in range(5)}
    again.put("k5", payload_for(5))  # appended after the cut: readable by the next replay
    again.close()
    assert set(on_disk(root)) == {f"k{i}" for i in range(6)}
    assert open_store(root).usage()["records"] == 6


def test_a_damaged_journal_entry_is_skipped_never_trusted(root) -> None:
    path = _stored_and_closed(root, 4)
    with open(path, "r+b") as f:
        f.seek(2 * slab_journal.ENTRY_BYTES + 20)  # the second put (entry 0 is the header)
        f.write(b"\xff")
    again = open_store(root)
    assert again.counters["journal_damaged"] == 1
    assert again.usage()["records"] == 3 and not again.contains("k1")
    assert get(again, "k2") == (GetStatus.LOADED, bytes(payload_for(2)))


def test_a_slot_written_without_its_journal_entry_is_never_served(root, monkeypatch) -> None:
    store = open_store(root)
    store.put("kept", payload_for(1))
    monkeypatch.setattr(store.disk, "append", _raise(errno.EIO))
    with pytest.raises(IOFailure):
        store.put("lost", payload_for(2))  # its bytes reached the slot, its entry did not
    assert not store.contains("lost")
    monkeypatch.undo()
    store.close()
    assert set(on_disk(root)) == {"kept"}
    again = open_store(root)
    assert not again.contains("lost") and get(again, "lost")[0] is GetStatus.MISS


def _raise(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def test_a_corrupt_slot_is_a_miss_counted_and_freed(root, caplog) -> None:
    store = open_store(root)
    store.put("k", payload_for(1))
    [rec] = slab_journal.live_records(slab_dir(root))
    with open(rec.slab_path, "r+b") as f:
        f.seek(rec.offset + 256 + 7)
        byte = f.read(1)
        f.seek(rec.offset + 256 + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    # at_level: an earlier test in this process may have raised the root logger's level.
    with caplog.at_level("WARNING", logger="kvswap.backends.slab_store"):
        assert get(store, "k")[0] is GetStatus.CORRUPT
    assert store.counters["corrupt"] == 1
    assert get(store, "k")[0] is GetStatus.MISS and not store.contains("k")
    assert slab_journal.live_records(slab_dir(root)) == []  # freed in the journal too
    assert any("corrupt record" in r.getMessage() for r in caplog.records)


def test_write_and_read_errors_are_typed_and_lose_nothing(root, monkeypatch) -> None:
    store = open_store(root)
    store.put("kept", payload_for(1))
    monkeypatch.setattr(store.disk, "write_at", _raise(errno.EIO))
    with pytest.raises(IOFailure) as info:
        store.put("k2", payload_for(2))
    assert info.value.details["errno"] == errno.EIO
    monkeypatch.setattr(store.disk, "write_at", _raise(errno.ENOSPC))
    with pytest.raises(NoSpace):
        store.put("k3", payload_for(3))
    monkeypatch.undo()
    monkeypatch.setattr(store.disk, "append", _raise(errno.EIO))  # the slot written, its journal entry not
    with pytest.raises(IOFailure):
        store.put("k4", payload_for(4))
    monkeypatch.undo()
    monkeypatch.setattr(store.disk, "read_at", _raise(errno.EIO))
    with pytest.raises(IOFailure):
        get(store, "kept")
    monkeypatch.undo()
    assert get(store, "kept") == (GetStatus.LOADED, bytes(payload_for(1)))
    free_before = store.stats()["free_slots"]
    store.put("k2", payload_for(2))  # the failed writes gave their slots back
    assert store.stats()["free_slots"] == free_before - 1
    assert set(on_disk(root)) == {"kept", "k2"}
    # The failed writes (of the slot, of the journal entry) and read ended their I/O sections
    # too: the close lets go of the slab at once, and a restart adopts it.
    store.close()
    again = open_store(root)
    assert again.stats()["slabs"] == 1 and again.stats()["slabs_owned"] == 1
    assert get(again, "k2") == (GetStatus.LOADED, bytes(payload_for(2)))


def test_a_full_disk_while_growing_is_no_space(root, monkeypatch) -> None:
    store = open_store(root)
    while store.stats()["free_slots"] or not store.usage()["records"]:
        store.put(f"k{store.usage()['records']}", payload_for(1))
    monkeypatch.setattr(store.disk, "grow", _raise(errno.ENOSPC))
    store.put("one-more", payload_for(2))  # the evicting daemon makes room in its slab
    assert store.counters["enospc_retries"] == 1 and store.counters["evicted_enospc"] == 2
    assert get(store, "one-more") == (GetStatus.LOADED, bytes(payload_for(2)))
    store.put("and-one", payload_for(3))
    store.release_lead()  # a daemon that does not evict has nothing to free
    with pytest.raises(NoSpace) as info:
        store.put("refused", payload_for(4))
    assert info.value.message == "no space left to grow a slab"
    assert not store.contains("refused")


def test_the_cap_holds_in_slots_and_the_slab_stays_near_it(root) -> None:
    store = open_store(root, records_cap=10)
    assert store.try_lead()
    for i in range(40):
        store.put(f"k{i}", payload_for(i))
        assert store.index.bytes <= 10 * SLOT
        assert len(on_disk(root)) <= 10
    assert store.contains("k39") and not store.contains("k0")
    slab = [n for n in os.listdir(slab_dir(root)) if n.endswith(".slab")][0]
    assert os.path.getsize(os.path.join(slab_dir(root), slab)) <= (10 + 8) * SLOT


def test_a_slot_being_read_is_not_reused_until_the_read_ends(root, monkeypatch) -> None:
    store = open_store(root)
    store.put("reading", payload_for(1))
    started, go = threading.Event(), threading.Event()
    read_at = store.disk.read_at

    def slow(*args, **kwargs):
        started.set()
        assert go.wait(30)
        return read_at(*args, **kwargs)

    monkeypatch.setattr(store.disk, "read_at", slow)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(get(store, "reading")))
    reader.start()
    assert started.wait(30)
    assert store.delete("reading")
    for i in range(store.stats()["free_slots"] + 3):  # every free slot and then some
        store.put(f"other{i}", payload_for(100 + i))
    go.set()
    reader.join(30)
    assert result == [(GetStatus.LOADED, bytes(payload_for(1)))]
    store.put("after", payload_for(7))  # the slot is free again now
    assert get(store, "after") == (GetStatus.LOADED, bytes(payload_for(7)))


def test_two_daemons_share_a_directory(root) -> None:
    a, b = open_store(root), open_store(root)
    assert a.stats()["slabs_owned"] == 1 and b.stats()["slabs_owned"] == 1 and b.stats()["slabs"] == 2
    a.put("from-a", payload_for(1))
    b.put("from-b", payload_for(2))
    assert get(b, "from-a") == (GetStatus.LOADED, bytes(payload_for(1)))  # found on a miss
    assert a.contains("from-b")
    assert b.delete("from-a")  # b frees a record in a's slab through its own journal
    a._refresh()
    assert not a.contains("from-a")
    assert set(on_disk(root)) == {"from-b"}
    a.put("reuse", payload_for(3))  # a reuses the slot b freed
    assert get(b, "reuse") == (GetStatus.LOADED, bytes(payload_for(3)))


def test_a_delete_finds_a_record_another_daemon_wrote_since_this_one_last_read(root) -> None:
    """A delete reads the other daemons' journals when the record is not indexed, as contains
    and get_into do: it answered False and kept the record (which a daemon sharing the files
    layout's directory removes with one unlink)."""
    a, b = open_store(root), open_store(root)
    b.put("from-b", payload_for(1))
    assert a.delete("from-b") and not a.contains("from-b")
    b._refresh()
    assert not b.contains("from-b") and on_disk(root) == {}


def test_a_reader_of_a_slot_reused_by_its_owner_gets_a_miss_not_corrupt(root) -> None:
    a, b = open_store(root), open_store(root)
    a.put("old", payload_for(1))
    assert b.contains("old")
    a.delete("old")
    a.put("new", payload_for(2))  # same slot, next generation; b has not read a's journal
    assert get(b, "old")[0] is GetStatus.MISS
    assert b.counters["corrupt"] == 0
    assert get(b, "new") == (GetStatus.LOADED, bytes(payload_for(2)))


def test_one_key_stored_by_two_daemons_keeps_one_copy(root) -> None:
    a, b = open_store(root), open_store(root)
    a.put("same", payload_for(5))
    b.put("same", payload_for(5))
    a._refresh()
    b._refresh()
    a._refresh()
    assert len(slab_journal.live_records(slab_dir(root))) == 1
    assert a.usage()["records"] == b.usage()["records"] == 1
    assert get(a, "same") == get(b, "same") == (GetStatus.LOADED, bytes(payload_for(5)))


def test_the_leader_evicts_in_others_slabs_and_their_owners_reuse_the_slots(root) -> None:
    writer = open_store(root)
    for i in range(10):
        writer.put(f"w{i}", payload_for(i))
    writer.release_lead()  # it led alone on the directory until now
    leader = open_store(root, records_cap=6)
    assert leader.try_lead() and leader.usage()["records"] == 10
    leader.maintain()
    assert leader.usage()["records"] <= 6
    writer._refresh()
    assert writer.usage()["records"] == leader.usage()["records"]
    free = writer.stats()["free_slots"]
    writer.put("fresh", payload_for(50))
    assert writer.stats()["free_slots"] == free - 1  # no growth: a freed slot was reused
    assert set(on_disk(root)) == {k for k in [f"w{i}" for i in range(10)] + ["fresh"] if writer.contains(k)}


def test_the_journal_is_compacted_and_readers_follow(root, monkeypatch) -> None:
    from kvswap.backends import slab_store

    monkeypatch.setattr(slab_store, "COMPACT_SLACK", 16)
    owner, reader = open_store(root), open_store(root)
    for round_ in range(30):
        owner.put(f"k{round_}", payload_for(round_))
        if round_ % 3:
            owner.delete(f"k{round_}")
        if round_ % 7 == 0:
            reader._refresh()
    assert owner.counters["journal_compactions"] >= 1
    path = owner._by_index[owner._primary.index].journal_path if owner._primary else ""
    assert os.path.getsize(path) // slab_journal.ENTRY_BYTES <= 2 * 10 + 16 + 1
    reader._refresh()
    kept = {f"k{i}" for i in range(30) if i % 3 == 0}
    assert {k for k in (f"k{i}" for i in range(30)) if reader.contains(k)} == kept
    owner.close()
    assert set(on_disk(root)) == kept
    assert open_store(root).usage()["records"] == len(kept)


def test_recency_survives_a_restart_through_touch_entries(root) -> None:
    store = open_store(root, records_cap=3)
    for i in range(3):
        store.put(f"k{i}", payload_for(i))
    store.touch_chain(["k0"], persist=True)  # k0 is now the newest
    store.close()
    again = open_store(root, records_cap=3)
    assert again.try_lead()
    again.put("k3", payload_for(3))
    assert again.contains("k0") and not again.contains("k1")


def test_the_old_layout_is_read_beside_the_new(root) -> None:
    old = FileBackend(root, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    for i in range(4):
        old.put(f"old{i}", payload_for(i))
    old_path = old.path_of("old0")[1]
    new = open_store(root)
    assert new.counters["legacy_records"] == 4
    assert get(new, "old1") == (GetStatus.LOADED, bytes(payload_for(1)))
    new.put("fresh", payload_for(9))
    assert set(on_disk(root)) == {"fresh"}  # new records go to slabs
    new.put("old0", payload_for(0))  # a rewrite moves the record into a slab
    assert not os.path.exists(old_path)
    assert new.delete("old2") and not os.path.exists(old.path_of("old2")[1])
    new.close()
    again = open_store(root)
    assert sorted(k for k in ["old0", "old1", "old2", "old3", "fresh"] if again.contains(k)) == [
        "fresh", "old0", "old1", "old3"]
    assert get(again, "old3") == (GetStatus.LOADED, bytes(payload_for(3)))


def test_a_delete_of_an_old_layout_record_before_the_scan_reaches_it_stays_deleted(root) -> None:
    old = FileBackend(root, layout="files").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)
    for i in range(3):
        old.put(f"old{i}", payload_for(i))
    new = FileBackend(root, layout="slab").open_store(NAMESPACE, DESCRIPTION, RECORD_BYTES)  # not scanned yet
    assert new.delete("old1") and not os.path.exists(old.path_of("old1")[1])
    new.scan()
    assert not new.contains("old1") and get(new, "old1")[0] is GetStatus.MISS
    assert new.contains("old0") and new.contains("old2") and new.counters["legacy_records"] == 2


def test_a_journal_of_another_namespace_is_ignored(root) -> None:
    store = open_store(root)
    store.put("k", payload_for(1))
    store.close()
    [journal_name] = [n for n in os.listdir(slab_dir(root)) if n.endswith(".journal")]
    other = slab_journal.header_entry(bytes.fromhex("0badf00d"), SLOT, RECORD_BYTES, b"\x01" * 16).encode()
    put = slab_journal.Entry(slab_journal.PUT, bytes.fromhex("0badf00d"), 0, 1, 1, bytes(16)).encode()
    with open(os.path.join(slab_dir(root), "0badf00d.journal"), "wb") as f:
        f.write(other + put)
    os.chmod(os.path.join(slab_dir(root), "0badf00d.journal"), 0o600)
    again = open_store(root)
    assert again.counters["journal_foreign"] == 1 and again.usage()["records"] == 1
    assert journal_name in os.listdir(slab_dir(root))


def test_journal_entries_round_trip() -> None:
    entries = [slab_journal.Entry(op, bytes([i, 0, 0, i]), i * 3, i + 1, -i * 10**9, bytes([i]) * 16)
               for i, op in enumerate([slab_journal.PUT, slab_journal.FREE, slab_journal.TOUCH] * 5)]
    blob = b"".join(e.encode() for e in entries)
    decoded, damaged, consumed = slab_journal.decode(blob + b"\x00" * 17)
    assert list(slab_journal.iter_entries(decoded)) == entries
    assert (damaged, consumed) == (0, len(blob))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=700), st.lists(st.integers(0, 9), max_size=5))
def test_decode_never_returns_an_entry_it_did_not_check(noise: bytes, cuts: list[int]) -> None:
    good = [slab_journal.Entry(slab_journal.PUT, b"abcd", i, 1, i, bytes([i]) * 16) for i in range(10)]
    blob = bytearray(b"".join(e.encode() for e in good))
    for c in set(cuts):
        blob[c * slab_journal.ENTRY_BYTES + 9] ^= 0x55  # a damaged entry: its checksum fails
    decoded, damaged, consumed = slab_journal.decode(bytes(blob) + noise)
    got = list(slab_journal.iter_entries(decoded))
    assert all(e in good for e in got)
    assert {e.slot for e in got} == set(range(10)) - set(cuts)
    assert consumed % slab_journal.ENTRY_BYTES == 0 and consumed <= len(blob) + len(noise)


class SlabStoreModel(RuleBasedStateMachine):
    """Two stores on one directory under a cap, against a dict: every read is the model's bytes
    or a miss of a key the model says was evicted; after every step the journals, replayed from
    the files alone, name exactly the records the stores say are there."""

    CAP = 6

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.root = os.path.join(self.tmp.name, "kv")
        self.stores = [open_store(self.root, records_cap=self.CAP), open_store(self.root, records_cap=self.CAP)]
        self.model: dict[str, bytes] = {}
        self.keys: list[str] = []

    @initialize(keys=st.lists(st.text("abcdef", min_size=1, max_size=4), min_size=8, max_size=8, unique=True))
    def choose_keys(self, keys: list[str]) -> None:
        self.keys = keys

    def _sync(self) -> None:
        for s in self.stores:
            s._refresh()
        # Evictions are the leader's; what left the directory left the model.
        present = set(on_disk(self.root))
        for k in list(self.model):
            if k not in present:
                del self.model[k]

    @rule(w=st.integers(0, 1), k=st.integers(0, 7), seed=st.integers(0, 1000))
    def put(self, w: int, k: int, seed: int) -> None:
        key = self.keys[k]
        data = payload_for(seed)
        if key in self.model:
            data = memoryview(self.model[key])  # same key, same bytes
        self.stores[w].put(key, data)
        self.model[key] = bytes(data)
        self._sync()

    @rule(w=st.integers(0, 1), k=st.integers(0, 7))
    def read(self, w: int, k: int) -> None:
        key = self.keys[k]
        status, data = get(self.stores[w], key)
        if key in self.model:
            assert (status, data) == (GetStatus.LOADED, self.model[key])
        else:
            assert status is GetStatus.MISS

    @rule(w=st.integers(0, 1), k=st.integers(0, 7))
    def delete(self, w: int, k: int) -> None:
        key = self.keys[k]
        self.stores[w].delete(key)
        self.model.pop(key, None)
        self._sync()

    @rule()
    def maintain(self) -> None:
        for s in self.stores:
            s.maintain()
        self._sync()

    @rule(w=st.integers(0, 1))
    def restart(self, w: int) -> None:
        self.stores[w].close()
        self.stores[w] = open_store(self.root, records_cap=self.CAP)
        self._sync()

    @invariant()
    def journals_match_the_stores(self) -> None:
        if not self.keys:
            return
        disk = on_disk(self.root)
        assert disk == self.model
        for s in self.stores:
            s._refresh()
            assert {k for k in self.keys if s.contains(k)} == set(self.model)

    def teardown(self) -> None:
        for s in self.stores:
            s.close()
        self.tmp.cleanup()


SlabStoreModel.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
test_slab_store_against_a_model = SlabStoreModel.TestCase


def test_a_free_read_before_its_put_keeps_the_record_gone(root) -> None:
    """Journals are read one after another: a leader's free of a record can be read before
    the owner's put of it. The put must not bring the record back."""
    store = open_store(root)
    sid = bytes.fromhex("00c0ffee")
    name = bytes.fromhex(record_name("k"))
    put = slab_journal.Entry(slab_journal.PUT, sid, 3, 1, 5, name).encode()
    free = slab_journal.Entry(slab_journal.FREE, sid, 3, 1, 0, name).encode()
    later = slab_journal.Entry(slab_journal.PUT, sid, 3, 2, 6, bytes.fromhex(record_name("k2"))).encode()
    for blob in (free, put):
        entries, _, _ = slab_journal.decode(blob)
        store._apply(entries)
    assert not store.contains("k")
    entries, _, _ = slab_journal.decode(later)
    store._apply(entries)  # the slot's next generation applies as usual
    assert store.index.stamp(record_name("k2")) == 6


def test_three_stores_writing_evicting_and_reading_at_once_agree_with_the_disk(root, monkeypatch) -> None:
    """Three stores on one directory, two writer threads each and a maintenance thread
    (one leads, under a cap; journals compacted often): once all have read every journal, they
    index the same records, exactly those a replay from the files finds, and a fresh store
    finds the same."""
    from kvswap.backends import slab_store

    monkeypatch.setattr(slab_store, "COMPACT_SLACK", 8)
    stores = [open_store(root, records_cap=24, rescan_interval_s=0.01) for _ in range(3)]
    errors: list[BaseException] = []

    def write(w: int, t: int) -> None:
        try:
            for i in range(60):
                for j in range(3):
                    stores[w].put(f"k{w}-{t}-{i}-{j}", payload_for(i))
                stores[w].contains(f"k{(w + 1) % 3}-{t}-{i}-0")
                status, data = get(stores[w], f"k{w}-{t}-{i}-0")
                assert status is GetStatus.MISS or data == bytes(payload_for(i))
        except BaseException as exc:  # reported below, with the thread's name
            errors.append(exc)

    def maintain() -> None:
        for _ in range(100):
            for s in stores:
                s.maintain()

    threads = [threading.Thread(target=write, args=(w, t)) for w in range(3) for t in range(2)]
    threads.append(threading.Thread(target=maintain))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for _ in range(2):
        for s in stores:
            s._refresh()
    names = [set(s._where) for s in stores]
    assert names[0] == names[1] == names[2]
    assert {r.name for r in slab_journal.live_records(slab_dir(root))} == names[0]
    assert [s.usage()["records"] for s in stores] == [len(names[0])] * 3
    assert set(open_store(root)._where) == names[0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=56, max_size=56), min_size=1, max_size=20))
def test_the_vectorised_checksum_is_the_entry_checksum(bodies: list[bytes]) -> None:
    words = np.frombuffer(b"".join(bodies), dtype="<u8").reshape(-1, 7)
    assert slab_journal._checksums(words).tolist() == [slab_journal.entry_checksum(b) for b in bodies]
