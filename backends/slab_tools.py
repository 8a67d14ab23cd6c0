"""The offline tools' view of a namespace's slabs (``kvswap inspect | verify | gc``; the walk
of the rest of the directory is :mod:`.file_tools`).

The records of a slab are what its journals name (:func:`.slab_journal.live_records`, read
from the files alone). Verify reads each one where it lies and checks it as a daemon would.
Changing a slab (verify's ``remove``, gc's evictions) appends free entries to the slab's own
journal, which only its owner may write: the tools take the slab's lock first and leave slabs a
running daemon holds to it (a daemon removes a bad record when it reads it, and evicts by its
own cap). Freed slots give their blocks back to the file system (``fallocate`` punching a hole,
so a slab's size on disk is its blocks, not its length), and a slab whose tail is free is cut.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Iterator

from kvswap.protocol.errors import Corrupt

from . import record
from . import slab_journal as journal
from .disk import try_flock
from .file_layout import record_name
from .slab_store import SLAB_DIR

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give ``length`` bytes at ``offset`` back to the file system, keeping the file's length
    (False where the file system cannot)."""
    fallocate = _libc.fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, offset, length) == 0


def slab_dir(root: str, namespace: str) -> str:
    return os.path.join(root, namespace, SLAB_DIR)


def disk_bytes(path: str) -> int:
    """Bytes a file takes on disk (its blocks: a slab's free slots may be holes)."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def records(root: str, namespace: str) -> list[journal.SlotRecord]:
    return journal.live_records(slab_dir(root, namespace))


def slot_bytes_of(root: str, namespace: str) -> dict[str, int]:
    """slab path -> slot bytes, from each journal's header entry."""
    out = {}
    directory = slab_dir(root, namespace)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not name.endswith(".journal"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            entries, _, _ = journal.decode(f.read(journal.ENTRY_BYTES))
        for e in journal.iter_entries(entries):
            if e.op == journal.HEADER:
                out[os.path.join(directory, name[: -len(".journal")] + ".slab")] = e.slot
    return out


def check(rec: journal.SlotRecord, namespace: str, record_bytes: int | None, max_record_bytes: int,
          chunk_bytes: int) -> None:
    """Raise :class:`Corrupt` unless the slot holds a whole, valid record of ``namespace``
    under the name its journal gave it; checksummed in chunks (memory stays bounded)."""
    fd = os.open(rec.slab_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        header = record.decode_header(os.pread(fd, record.ALIGNED_HEADER, rec.offset))
        if header.namespace.hex() != namespace:
            raise Corrupt("record of another namespace")
        if record_name(header.key) != rec.name:
            raise Corrupt("record stored under another key's name", key=header.key)
        limit = record_bytes if record_bytes is not None else max_record_bytes
        if header.payload_len != limit if record_bytes is not None else header.payload_len > limit:
            raise Corrupt("record has the wrong size", size=header.payload_len)
        checksum = record.checksum_at(fd, rec.offset + header.header_len, header.payload_len, chunk_bytes)
        if checksum is None:
            raise Corrupt("the slab ends inside the record")
        if checksum != header.checksum:
            raise Corrupt("payload checksum mismatch")
    finally:
        os.close(fd)


class SlabEditor:
    """Frees slots of the slabs whose locks it could take (no daemon owns them); closes them
    on exit."""

    def __init__(self, root: str, namespace: str) -> None:
        self.dir = slab_dir(root, namespace)
        self._locks: dict[str, int | None] = {}
        self.slot_bytes = slot_bytes_of(root, namespace)

    def __enter__(self) -> "SlabEditor":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._locks.values():
            if fd is not None:
                os.close(fd)

    def can_edit(self, slab_path: str) -> bool:
        if slab_path not in self._locks:
            self._locks[slab_path] = try_flock(slab_path[: -len(".slab")] + ".lock")
        return self._locks[slab_path] is not None

    def free(self, recs: list[journal.SlotRecord]) -> int:
        """Append a free entry for each record (to its slab's journal) and punch its slot
        out; cut a slab's free tail. Returns the records freed. Caller checked ``can_edit``."""
        by_slab: dict[str, list[journal.SlotRecord]] = {}
        for rec in recs:
            by_slab.setdefault(rec.slab_path, []).append(rec)
        freed = 0
        gens = _generations(self.dir)
        for path, mine in by_slab.items():
            sid = bytes.fromhex(os.path.basename(path)[: -len(".slab")])
            blob = b"".join(journal.Entry(journal.FREE, sid, r.slot, gens[(sid, r.slot)], 0,
                                          bytes.fromhex(r.name)).encode() for r in mine)
            fd = os.open(path[: -len(".slab")] + ".journal", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                os.write(fd, blob)
                os.fsync(fd)
            finally:
                os.close(fd)
            freed += len(mine)
            self.give_back(path)
        return freed

    def give_back(self, path: str) -> None:
        """Punch every free slot of a slab out and cut its free tail."""
        slot = self.slot_bytes.get(path)
        if not slot:
            return
        live = {r.slot for r in journal.live_records(self.dir) if r.slab_path == path}
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            slots = os.fstat(fd).st_size // slot
            end = max(live) + 1 if live else 0
            if end < slots:
                os.ftruncate(fd, end * slot)
            for i in range(end):
                if i not in live:
                    punch_hole(fd, i * slot, slot)
        finally:
            os.close(fd)


def _generations(directory: str) -> dict[tuple[bytes, int], int]:
    """(slab id, slot) -> the newest generation any journal names."""
    out: dict[tuple[bytes, int], int] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".journal"):
            with open(os.path.join(directory, name), "rb") as f:
                entries, _, _ = journal.decode(f.read())
            for e in journal.iter_entries(entries):
                if e.op in (journal.PUT, journal.FREE):
                    key = (e.slab, e.slot)
                    out[key] = max(out.get(key, 0), e.gen)
    return out


def slab_files(root: str, namespace: str) -> Iterator[tuple[str, int]]:
    """(path, bytes on disk) of every slab, journal and lock file."""
    directory = slab_dir(root, namespace)
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        yield os.path.join(directory, name), disk_bytes(os.path.join(directory, name))
