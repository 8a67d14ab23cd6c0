"""Where a daemon's records lie on disk, found from the files alone (no daemon, no index), in
either file layout, for tests that check the bytes on disk, damage a record in place, or count
what a cap leaves:

- ``files``: one file per record, ``<namespace>/ab/cd/<name>.kvr`` (records being written are
  ``<namespace>/tmp/*.tmp``);
- ``slab``: records in fixed-size slots of ``<namespace>/slabs/<id>.slab``, live where the
  journals say (:func:`kvswap.backends.slab_journal.live_records`: what a restart would serve).

A slab directory may hold old-layout files beside its slabs (they are read too), so every
function here reads both. ``root`` is a storage directory or one namespace's directory.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvswap.backends import record, slab_journal
from kvswap.backends.disk import Disk
from kvswap.backends.file_layout import RECORD_SUFFIX, TMP_SUFFIX, record_name
from kvswap.backends.slab_store import SLAB_DIR
from kvswap.protocol import Corrupt

#: The daemon's ``--file-layout`` values, for tests parametrized over both.
LAYOUTS = ("slab", "files")


@dataclass(frozen=True)
class DiskRecord:
    """One record on disk: ``length`` bytes (header, then payload) at ``offset`` of ``path``."""

    path: Path
    offset: int
    length: int
    #: What it takes against the cap: its file's size, or its slot's.
    footprint: int
    name: str
    #: Its recency stamp as a restart reads it: its file's mtime, or its put's stamp raised by
    #: the touches of that put's generation.
    stamp: int

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.length)

    def write(self, at: int, data: bytes) -> None:
        """Overwrite ``data`` at ``at`` bytes into the record (from its end when negative), in
        place: a slab's other slots keep their bytes."""
        start = at if at >= 0 else self.length + at
        assert 0 <= start and start + len(data) <= self.length, (at, len(data), self.length)
        with open(self.path, "r+b") as f:
            f.seek(self.offset + start)
            f.write(data)

    def flip(self, at: int, mask: int = 0xFF) -> None:
        """XOR one byte of the record with ``mask`` (``at`` as in :meth:`write`)."""
        start = at if at >= 0 else self.length + at
        self.write(start, bytes([self.read()[start] ^ mask]))


@dataclass
class _Journals:
    """What the records' places do not say, from every journal of a slab directory: each
    slab's geometry, and the stamps touches gave each slot's generations."""

    #: slab path -> (slot bytes, record bytes), from its journal's header entry.
    geometry: dict[str, tuple[int, int]]
    #: (slab path, slot) -> the newest generation a put gave it.
    put_gen: dict[tuple[str, int], int]
    #: (slab path, slot, generation) -> the newest stamp a touch gave it.
    touched: dict[tuple[str, int, int], int]


def _read_journals(slab_dir: str) -> _Journals:
    out = _Journals({}, {}, {})
    for name in os.listdir(slab_dir):
        if not name.endswith(".journal"):
            continue
        try:
            with open(os.path.join(slab_dir, name), "rb") as f:
                entries, _, _ = slab_journal.decode(f.read())
        except FileNotFoundError:
            continue
        for e in slab_journal.iter_entries(entries):
            path = os.path.join(slab_dir, e.slab.hex() + ".slab")
            if e.op == slab_journal.HEADER:
                out.geometry[path] = (e.slot, e.stamp)
            elif e.op == slab_journal.PUT:
                out.put_gen[(path, e.slot)] = max(e.gen, out.put_gen.get((path, e.slot), 0))
            elif e.op == slab_journal.TOUCH:
                out.touched[(path, e.slot, e.gen)] = max(e.stamp, out.touched.get((path, e.slot, e.gen), 0))
    return out


def records_on_disk(root: Path | str) -> list[DiskRecord]:
    """Every record under ``root``: each record file, and each slot the journals name."""
    found: list[DiskRecord] = []
    for here, _, names in os.walk(root):
        if os.path.basename(here) == SLAB_DIR:
            live = slab_journal.live_records(here)
            journals = _read_journals(here)  # read after: it has every journal live_records read
            for rec in live:
                slot_bytes, record_bytes = journals.geometry[rec.slab_path]
                gen = journals.put_gen[(rec.slab_path, rec.slot)]
                stamp = max(rec.stamp, journals.touched.get((rec.slab_path, rec.slot, gen), 0))
                found.append(DiskRecord(Path(rec.slab_path), rec.offset, record.header_len_for(record_bytes) + record_bytes,
                                        slot_bytes, rec.name, stamp))
            continue
        for name in names:
            if name.endswith(RECORD_SUFFIX):
                path = Path(here) / name
                try:
                    st = path.stat()
                except FileNotFoundError:  # evicted since the walk listed it
                    continue
                found.append(DiskRecord(path, 0, st.st_size, st.st_size, name[: -len(RECORD_SUFFIX)], st.st_mtime_ns))
    return found


def find_record(root: Path | str, key: str) -> DiskRecord | None:
    """``key``'s record on disk, or None."""
    name = record_name(key)
    return next((r for r in records_on_disk(root) if r.name == name), None)


def record_of(root: Path | str, key: str) -> DiskRecord:
    """``key``'s record on disk; fails the test if there is none."""
    found = find_record(root, key)
    assert found is not None, f"no record on disk holds {key}"
    return found


def record_bytes_on_disk(root: Path | str) -> int:
    """What the records under ``root`` take against a cap: the record files' bytes (published
    ``.kvr`` and in-progress ``.tmp``) and a slot per live slab record. A slab file itself is
    preallocated space, not records: its free slots count as nothing."""
    total = sum(r.footprint for r in records_on_disk(root))
    for here, _, names in os.walk(root):
        if os.path.basename(here) == SLAB_DIR:
            continue  # a journal being compacted is a .tmp there, not a record
        for name in names:
            if name.endswith(TMP_SUFFIX):
                try:
                    total += os.stat(os.path.join(here, name)).st_size
                except FileNotFoundError:
                    pass
    return total


def checked_records(root: Path | str) -> tuple[dict[str, bytes], list[str]]:
    """Every record under ``root`` read back and checked with the record format alone
    (header, length, checksum): ``key -> payload`` of the good ones, and a line for each one
    that fails its check. A key found twice fails the test."""
    good: dict[str, bytes] = {}
    bad: list[str] = []
    for rec in records_on_disk(root):
        data = rec.read()
        try:
            header = record.decode_header(data)
            payload = data[header.header_len:]
            record.verify(header, header.namespace, header.key, payload)
        except Corrupt as exc:
            bad.append(f"{rec.path.name}@{rec.offset}: {exc.message}")
            continue
        assert header.key not in good, f"two records on disk hold {header.key}"
        good[header.key] = payload
    return good, bad


def fail_reads_of(disk: Disk, rec: DiskRecord) -> Callable[[], None]:
    """Make ``disk`` fail every read of ``rec`` with EIO (a bad sector under one record), in
    either layout: ``Disk.read_file`` of its file, or ``Disk.read_at`` of its slot. Returns
    what undoes it."""
    read_file, read_at = disk.read_file, disk.read_at
    target = os.stat(rec.path)

    def is_target(st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)

    def failing_file(path, parts):
        if os.path.abspath(path) == os.path.abspath(rec.path):
            raise OSError(errno.EIO, "Input/output error")
        return read_file(path, parts)

    def failing_at(fd, direct_fd, parts, offset):
        if offset == rec.offset and is_target(os.fstat(fd)):
            raise OSError(errno.EIO, "Input/output error")
        return read_at(fd, direct_fd, parts, offset)

    disk.read_file, disk.read_at = failing_file, failing_at  # type: ignore[method-assign]

    def undo() -> None:
        disk.read_file, disk.read_at = read_file, read_at  # type: ignore[method-assign]

    return undo


class GatedRecordWrites:
    """Holds every record write until the test opens ``gate``, in either layout: the files
    layout writes a record with ``Disk.write_file`` (so does namespace.json), the slab layout
    with ``Disk.write_at``. ``started`` is released as each write arrives."""

    def __init__(self, disk: Disk) -> None:
        self.disk = disk
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self._write_file, self._write_at = disk.write_file, disk.write_at
        disk.write_file, disk.write_at = self._held(self._write_file), self._held(self._write_at)  # type: ignore[method-assign]

    def _held(self, write: Callable[..., int]) -> Callable[..., int]:
        def held(*args, **kwargs) -> int:
            self.started.release()
            assert self.gate.wait(30), "test never opened the write gate"
            return write(*args, **kwargs)

        return held

    def __enter__(self) -> "GatedRecordWrites":
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()  # a held write must not outlive a failed test (the daemon waits for it)
