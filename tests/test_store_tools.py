"""kvswap inspect / verify / gc over a real directory written by the file store."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections import Counter

from click.testing import CliRunner

from kvswap.backends import file_tools
from kvswap.backends.file_backend import FileBackend
from kvswap.backends.file_store import FileStore
from kvswap.daemon.tools.admin import main
from kvswap.protocol.layout import CacheLayout

LAYOUT_A = CacheLayout("m-aa", num_layers=1, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=32)
LAYOUT_B = CacheLayout("m-bb", num_layers=1, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=32)
RECORD = LAYOUT_A.record_bytes  # 2048
NS_A, NS_B = LAYOUT_A.fingerprint(), LAYOUT_B.fingerprint()
FILE = 256 + RECORD
METADATA = ("namespace.json", "evict.lock")


def make_store(root, layout: CacheLayout, n: int) -> FileStore:
    store = FileBackend(str(root), layout="files").open_store(layout.fingerprint(), layout.to_wire(), layout.record_bytes)
    prefix = layout.model_id[2:]
    for i in range(n):
        store.put(f"{prefix}-{i}", memoryview(bytes([i]) * RECORD))
        os.utime(store.path_of(f"{prefix}-{i}")[1], (1000 + i, 1000 + i))
    return store


def bytes_on_disk(root) -> int:
    """Every file under ``root`` but the namespaces' own metadata, by an independent walk."""
    return sum(os.lstat(os.path.join(d, f)).st_size for d, dirs, files in os.walk(root)
               for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))] if f not in METADATA)


def files_under(root) -> int:
    return sum(1 for d, dirs, files in os.walk(root) for f in files if f not in METADATA)


def misplace(path: str) -> str:
    """Move a record file into a fan-out directory that is not its own."""
    leaf = os.path.dirname(path)
    wrong = os.path.join(os.path.dirname(leaf), "00" if os.path.basename(leaf) != "00" else "01")
    os.makedirs(wrong, 0o700, exist_ok=True)
    moved = os.path.join(wrong, os.path.basename(path))
    os.rename(path, moved)
    return moved


def test_inspect_counts_records_bytes_and_ages(tmp_path) -> None:
    make_store(tmp_path, LAYOUT_A, 5)
    make_store(tmp_path, LAYOUT_B, 3)
    summaries = {s.namespace: s for s in file_tools.inspect(str(tmp_path), now=1000 + 30)}
    assert summaries[NS_A].records == 5 and summaries[NS_B].records == 3
    assert summaries[NS_A].bytes == 5 * FILE
    assert summaries[NS_A].ages["<1m"] == 5
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert sorted(d["records"] for d in data) == [3, 5]
    text = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert "m-aa" in text.output and "records    5" in text.output


def test_verify_finds_flipped_bytes_and_records_under_another_keys_name(tmp_path) -> None:
    store = make_store(tmp_path, LAYOUT_A, 6)
    flipped = store.path_of("aa-1")[1]
    data = bytearray(open(flipped, "rb").read())
    data[-1] ^= 0x40
    open(flipped, "wb").write(bytes(data))
    renamed = store.path_of("aa-2")[1]
    shutil.copy(store.path_of("aa-3")[1], renamed)  # a valid record under another key's name

    report = file_tools.verify(str(tmp_path))
    assert report.checked == 6 and report.good == 4
    assert sorted(p for p, _ in report.bad) == sorted([flipped, renamed])
    assert os.path.exists(flipped)  # report only, unless asked to remove

    result = CliRunner().invoke(main, ["verify", str(tmp_path), "--remove", "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["removed"] == 2
    assert not os.path.exists(flipped) and not os.path.exists(renamed)
    clean = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert clean.exit_code == 0 and "checked 4 records: 4 good, 0 bad" in clean.output


def test_verify_checks_or_reports_every_file(tmp_path) -> None:
    """The old verify walked records by name and rebuilt their paths: a record in another
    fan-out directory was skipped ("checked 1 records" of 2), and any other file unseen."""
    store = make_store(tmp_path, LAYOUT_A, 2)
    moved = misplace(store.path_of("aa-1")[1])
    ns = tmp_path / NS_A
    stray = os.path.join(os.path.dirname(store.path_of("aa-0")[1]), "notes.txt")
    open(stray, "wb").write(b"x" * 10)
    (ns / "zz").mkdir()
    (ns / "zz" / "inside").write_bytes(b"y" * 5)
    (tmp_path / "loose-file").write_bytes(b"z" * 3)
    dir_record = store.path_of("aa-9")[1]
    os.makedirs(dir_record)  # a directory where a record should be

    progress: list[int] = []
    report = file_tools.verify(str(tmp_path), progress=progress.append)
    assert (report.checked, report.good, [p for p, _ in report.bad]) == (2, 1, [dir_record])
    assert report.misplaced == [(moved, f"a record file outside its fan-out directory ({os.path.relpath(os.path.dirname(store.path_of('aa-1')[1]), ns)})")]
    assert sorted(report.unknown) == sorted([
        (stray, "not a record name"),
        (str(ns / "zz"), "a directory that is not part of the layout (1 file, 5 bytes)"),
        (str(tmp_path / "loose-file"), "not a namespace directory"),
    ])
    assert sum(progress) == file_tools.count_files(str(tmp_path)) == 6

    text = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert text.exit_code == 1
    assert "checked 2 records: 1 good, 1 bad; 1 misplaced, 3 unknown" in text.output
    assert f"misplaced  {moved}" in text.output and f"unknown  {stray}: not a record name" in text.output

    removed = CliRunner().invoke(main, ["verify", str(tmp_path), "--remove", "--json"])
    out = json.loads(removed.stdout)
    assert removed.exit_code == 1 and out["removed"] == 1  # the misplaced record; nothing unknown
    assert out["removal_failures"] == [[dir_record, "cannot remove: Is a directory"]]
    assert not os.path.exists(moved) and os.path.exists(stray) and os.path.isdir(dir_record)
    assert os.path.exists(ns / "zz" / "inside") and os.path.exists(tmp_path / "loose-file")


def test_gc_summary_counts_what_is_left_on_disk(tmp_path) -> None:
    """The old gc said "310.0 MiB -> 0.0 MiB" while a misplaced 10 MiB file stayed: it rebuilt
    the file's path, unlink found nothing there and it counted the bytes as gone."""
    store = make_store(tmp_path, LAYOUT_A, 3)
    moved = misplace(store.path_of("aa-2")[1])
    with open(moved, "r+b") as f:
        f.truncate(10 << 20)
    (tmp_path / NS_A / "tmp" / "half.tmp").write_bytes(b"t" * 100)
    before = bytes_on_disk(tmp_path)
    files = files_under(tmp_path)
    assert files == 4

    progress: list[int] = []
    report = file_tools.gc(str(tmp_path), 0, progress=progress.append)
    assert report.before_bytes == before and report.after_bytes == bytes_on_disk(tmp_path) == (10 << 20) + 100
    assert report.removed == 2 and report.removed_bytes == 2 * FILE
    assert report.skipped_files == [(moved, 10 << 20, "misplaced")]
    assert (report.temp_files, report.temp_bytes) == (1, 100)
    assert sum(progress) == 2 * files  # each file listed, then decided

    result = CliRunner().invoke(main, ["gc", str(tmp_path), "--max-bytes", "0", "--all"])
    assert result.exit_code == 1  # the budget does not hold: gc left a file it does not remove
    assert "10.0 MiB -> 10.0 MiB: removed 0 records" in result.output
    assert f"left  {moved}: 10.0 MiB, misplaced (kvswap verify --remove removes it)" in result.output
    assert "still holds 10.0 MiB, over --max-bytes 0.0 MiB" in result.output
    assert os.path.getsize(moved) == 10 << 20


def test_gc_evicts_oldest_first_and_skips_a_daemons_namespace(tmp_path) -> None:
    a = make_store(tmp_path, LAYOUT_A, 10)
    b = make_store(tmp_path, LAYOUT_B, 4)
    held = os.open(os.path.join(str(tmp_path), NS_B, "evict.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live daemon evicts for NS_B
    try:
        result = CliRunner().invoke(main, ["gc", str(tmp_path), "--max-bytes", str(8 * FILE), "--json"])
    finally:
        os.close(held)
    assert result.exit_code == 1, result.output  # a skipped namespace: the budget may not hold
    report = json.loads(result.stdout)
    assert report["skipped_namespaces"] == [NS_B]
    assert report["removed"] == 6  # 14 records, budget 8, NS_B's 4 untouchable
    assert report["after_bytes"] == 8 * FILE == bytes_on_disk(tmp_path)
    left = [i for i in range(10) if os.path.exists(a.path_of(f"aa-{i}")[1])]
    assert left == [6, 7, 8, 9]  # the most recently used survive
    assert all(os.path.exists(b.path_of(f"bb-{i}")[1]) for i in range(4))


def test_gc_progress_counts_every_file_and_a_clean_run_exits_0(tmp_path) -> None:
    """The old gc moved its bar only for removed records: a run that kept most stopped short."""
    make_store(tmp_path, LAYOUT_A, 6)
    progress: Counter[str] = Counter()
    report = file_tools.gc(str(tmp_path), 4 * FILE, progress=lambda n: progress.update(done=n))
    assert report.removed == 2 and report.after_bytes == 4 * FILE == bytes_on_disk(tmp_path)
    assert progress["done"] == 2 * 6 == 2 * files_under(tmp_path) + 2 * 2  # each file listed, then decided
    clean = CliRunner().invoke(main, ["gc", str(tmp_path), "--max-bytes", str(4 * FILE)])
    assert clean.exit_code == 0 and "removed 0 records" in clean.output


def test_operations_md_names_every_option_and_exit_code_of_the_tools() -> None:
    from pathlib import Path

    from kvswap.daemon.tools.store_commands import gc, verify

    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    section = text[text.index("### Offline tools"):text.index("### Capacity and eviction")]
    options = {opt for command in (verify, gc) for p in command.params for opt in p.opts
               if opt.startswith("--") and opt != "--json"}
    assert options == {"--remove", "--max-record-bytes", "--max-bytes", "--all", "--dry-run"}
    assert not [opt for opt in options if f"`{opt}" not in section]
    assert all(f"**{code}**" in section for code in (0, 1, 2))
    assert all(kind in section for kind in ("**record**", "**misplaced**", "**temp**", "**unknown**"))
