"""kvswap inspect / verify / gc over a real directory written by the file store."""

from __future__ import annotations

import fcntl
import json
import os
import shutil

from click.testing import CliRunner

from kvswap.backends import file_tools
from kvswap.backends.file_store import FileBackend, FileStore
from kvswap.daemon.tools.admin import main

RECORD = 2048
NS_A, NS_B = "aa" * 16, "bb" * 16


def make_store(root, namespace: str, n: int) -> FileStore:
    store = FileBackend(str(root)).open_store(namespace, {"model_id": f"m-{namespace[:2]}"}, RECORD)
    for i in range(n):
        store.put(f"{namespace[:2]}-{i}", memoryview(bytes([i]) * RECORD))
        os.utime(store.path_of(f"{namespace[:2]}-{i}")[1], (1000 + i, 1000 + i))
    return store


def test_inspect_counts_records_bytes_and_ages(tmp_path) -> None:
    make_store(tmp_path, NS_A, 5)
    make_store(tmp_path, NS_B, 3)
    summaries = {s.namespace: s for s in file_tools.inspect(str(tmp_path), now=1000 + 30)}
    assert summaries[NS_A].records == 5 and summaries[NS_B].records == 3
    assert summaries[NS_A].bytes == 5 * (256 + RECORD)
    assert summaries[NS_A].ages["<1m"] == 5
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert sorted(d["records"] for d in data) == [3, 5]
    text = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert "m-aa" in text.output and "records    5" in text.output


def test_verify_finds_flipped_bytes_and_misplaced_records(tmp_path) -> None:
    store = make_store(tmp_path, NS_A, 6)
    flipped = store.path_of("aa-1")[1]
    data = bytearray(open(flipped, "rb").read())
    data[-1] ^= 0x40
    open(flipped, "wb").write(bytes(data))
    misplaced = store.path_of("aa-2")[1]
    shutil.copy(store.path_of("aa-3")[1], misplaced)  # a valid record under another key's name

    report = file_tools.verify(str(tmp_path))
    assert report.checked == 6 and report.good == 4
    assert sorted(p for p, _ in report.bad) == sorted([flipped, misplaced])
    assert os.path.exists(flipped)  # report only, unless asked to remove

    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--remove", "--json"])
    assert result.exit_code == 1
    assert json.loads(result.output)["removed"] == 2
    assert not os.path.exists(flipped) and not os.path.exists(misplaced)
    clean = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert clean.exit_code == 0 and "4 good, 0 bad" in clean.output


def test_gc_evicts_oldest_first_and_skips_a_daemons_namespace(tmp_path) -> None:
    a = make_store(tmp_path, NS_A, 10)
    b = make_store(tmp_path, NS_B, 4)
    file_bytes = 256 + RECORD
    held = os.open(os.path.join(str(tmp_path), NS_B, "evict.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live daemon evicts for NS_B
    try:
        result = CliRunner().invoke(main, ["gc", str(tmp_path), "--max-bytes", str(8 * file_bytes), "--json"])
    finally:
        os.close(held)
    assert result.exit_code == 1, result.output  # a skipped namespace: the budget may not hold
    report = json.loads(result.output)
    assert report["skipped_namespaces"] == [NS_B]
    assert report["removed"] == 6  # 14 records, budget 8, NS_B's 4 untouchable
    assert report["after_bytes"] == 8 * file_bytes
    left = [i for i in range(10) if os.path.exists(a.path_of(f"aa-{i}")[1])]
    assert left == [6, 7, 8, 9]  # the most recently used survive
    assert all(os.path.exists(b.path_of(f"bb-{i}")[1]) for i in range(4))
