"""``kvswap inspect | verify | gc`` on a directory in the slab layout: records counted from the
journals, flipped bytes found where they lie, bad records and evictions freed through the
slab's own journal only where no daemon owns the slab, and freed slots given back to the disk."""

from __future__ import annotations

import os

from kvswap.backends import file_tools, slab_journal, slab_tools

from test_slab_store import NAMESPACE, SLOT, open_store, payload_for, slab_dir


def _flip(rec: slab_journal.SlotRecord, at: int) -> None:
    with open(rec.slab_path, "r+b") as f:
        f.seek(rec.offset + at)
        byte = f.read(1)[0]
        f.seek(rec.offset + at)
        f.write(bytes([byte ^ 0x01]))


def test_inspect_counts_slab_records_and_their_bytes(tmp_path) -> None:
    root = str(tmp_path / "kv")
    store = open_store(root)
    for i in range(7):
        store.put(f"k{i}", payload_for(i))
    store.delete("k0")
    [summary] = file_tools.inspect(root)
    assert (summary.records, summary.bytes, summary.unknown) == (6, 6 * SLOT, 0)
    assert summary.ages["<1m"] == 6 and summary.slab_bytes > 0


def test_verify_finds_a_flipped_byte_and_frees_it_only_where_no_daemon_owns_the_slab(tmp_path) -> None:
    root = str(tmp_path / "kv")
    store = open_store(root)
    for i in range(5):
        store.put(f"k{i}", payload_for(i))
    recs = slab_journal.live_records(slab_dir(root))
    _flip(recs[2], 256 + 10)
    report = file_tools.verify(root, remove=True)
    assert (report.checked, report.good, len(report.bad)) == (5, 4, 1)
    assert report.bad[0] == (f"{recs[2].slab_path}#{recs[2].slot}", "payload checksum mismatch")
    assert report.removed == 0 and len(report.removal_failures) == 1  # the store holds the slab
    assert len(slab_journal.live_records(slab_dir(root))) == 5
    store.close()
    report = file_tools.verify(root, remove=True)
    assert report.removed == 1 and not report.removal_failures
    assert {r.name for r in slab_journal.live_records(slab_dir(root))} == {r.name for r in recs} - {recs[2].name}
    again = open_store(root)
    assert again.usage()["records"] == 4
    assert file_tools.verify(root).problems is False


def test_gc_evicts_the_oldest_slab_records_and_gives_their_blocks_back(tmp_path) -> None:
    root = str(tmp_path / "kv")
    store = open_store(root)
    for i in range(40):
        store.put(f"k{i}", payload_for(i))
    store.close()
    [slab] = [os.path.join(slab_dir(root), n) for n in os.listdir(slab_dir(root)) if n.endswith(".slab")]
    before = slab_tools.disk_bytes(slab)
    report = file_tools.gc(root, max_bytes=before // 2)
    assert report.removed > 0 and not report.failures and not report.skipped_namespaces
    kept = {r.name for r in slab_journal.live_records(slab_dir(root))}
    assert len(kept) == 40 - report.removed
    again = open_store(root)
    # The oldest went: every kept record is newer than every removed one.
    present = [i for i in range(40) if again.contains(f"k{i}")]
    assert present == list(range(40 - len(present), 40))
    assert slab_tools.disk_bytes(slab) < before


def test_gc_leaves_a_namespace_a_daemon_evicts_for(tmp_path) -> None:
    root = str(tmp_path / "kv")
    store = open_store(root)
    for i in range(10):
        store.put(f"k{i}", payload_for(i))
    assert store.is_leader
    report = file_tools.gc(root, max_bytes=0)
    assert report.removed == 0 and report.skipped_namespaces == [NAMESPACE]
    assert len(slab_journal.live_records(slab_dir(root))) == 10
