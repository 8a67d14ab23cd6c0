"""Offline operations on a storage directory: inspect, verify, gc.

They read the same layout the file store writes and never need a daemon. They are safe next to
running daemons: verify only removes records that fail their checks (a daemon would remove them
on read anyway), and gc skips any namespace whose eviction lock a daemon holds. They read files
as the daemon does (no symlinks followed, no FIFO waited on, nothing larger than a record), so
a planted file is reported, not followed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kvswap.protocol.errors import Corrupt

from . import record
from .disk import Disk, listdir_or_empty, try_flock
from .file_store import LOCK_NAME, RECORD_SUFFIX, TMP_SUFFIX, record_name, scan_record_files

#: Age buckets for ``inspect`` (upper bounds, seconds).
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1m", 60), ("<1h", 3600), ("<1d", 86400), ("<7d", 7 * 86400), (">=7d", float("inf")))

Progress = Callable[[int], None]


@dataclass(frozen=True)
class RecordFile:
    namespace: str
    path: str
    size: int
    mtime: float


def namespaces(root: str) -> list[str]:
    """Namespace directories under ``root`` (those with a ``namespace.json``)."""
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [e for e in entries if os.path.isfile(os.path.join(root, e, "namespace.json"))]


def record_files(root: str, namespace: str) -> Iterator[RecordFile]:
    base = os.path.join(root, namespace)
    for name, size, mtime_ns in scan_record_files(base):
        yield RecordFile(namespace, os.path.join(base, name[:2], name[2:4], name + RECORD_SUFFIX), size,
                         mtime_ns / 1e9)


def count_records(root: str) -> int:
    return sum(1 for ns in namespaces(root) for _ in record_files(root, ns))


# -- inspect -------------------------------------------------------------------------------------


@dataclass
class NamespaceSummary:
    namespace: str
    description: dict[str, Any]
    records: int = 0
    bytes: int = 0
    temp_files: int = 0
    ages: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _ in AGE_BUCKETS})


def inspect(root: str, progress: Progress | None = None, now: float | None = None) -> list[NamespaceSummary]:
    now = time.time() if now is None else now
    out = []
    for ns in namespaces(root):
        try:
            description = json.loads(read_record_file(os.path.join(root, ns, "namespace.json"),
                                                      MAX_DESCRIPTION_BYTES))
        except (ValueError, Corrupt):  # not JSON, or not a regular file of sane size
            description = {"error": "namespace.json is not valid JSON"}
        summary = NamespaceSummary(ns, description)
        for rec in record_files(root, ns):
            summary.records += 1
            summary.bytes += rec.size
            age = now - rec.mtime
            summary.ages[next(name for name, bound in AGE_BUCKETS if age < bound)] += 1
            if progress:
                progress(1)
        summary.temp_files = sum(1 for e in listdir_or_empty(os.path.join(root, ns, "tmp")) if e.endswith(TMP_SUFFIX))
        out.append(summary)
    return out


# -- verify --------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    checked: int = 0
    good: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    removed: int = 0


#: Largest file ``verify`` reads as a record where the namespace does not say its record size.
DEFAULT_MAX_RECORD_FILE_BYTES = 256 * 1024 * 1024
#: Largest ``namespace.json`` read.
MAX_DESCRIPTION_BYTES = 1024 * 1024

_READER = Disk()


def read_record_file(path: str, max_bytes: int) -> bytearray:
    """The bytes of one record file, read the way the daemon reads records (``Disk.read_file``:
    O_NOFOLLOW, O_NONBLOCK, regular files only), so a symlink (to /dev/zero, say) or a FIFO
    planted under a record's name is :class:`Corrupt`, never followed and never waited on; and
    a file over ``max_bytes`` is :class:`Corrupt` before it is read."""
    head = bytearray(record.ALIGNED_HEADER)
    _, size = _READER.read_file(path, [head])
    if size > max_bytes:
        raise Corrupt(f"a file of {size} bytes, larger than a record of this namespace ({max_bytes})", size=size)
    data = bytearray(size)
    done, now = _READER.read_file(path, [data])
    if done != size or now != size:
        raise Corrupt("the file changed while it was read", size=now)
    return data


def max_record_file_bytes(root: str, namespace: str) -> int:
    """The size of a whole record of ``namespace`` (from its ``namespace.json``), or
    DEFAULT_MAX_RECORD_FILE_BYTES where that does not say."""
    try:
        payload = json.loads(read_record_file(os.path.join(root, namespace, "namespace.json"),
                                              MAX_DESCRIPTION_BYTES))["record_bytes"]
    except (OSError, ValueError, KeyError, TypeError, Corrupt):
        return DEFAULT_MAX_RECORD_FILE_BYTES
    if not isinstance(payload, int) or isinstance(payload, bool) or payload <= 0:
        return DEFAULT_MAX_RECORD_FILE_BYTES
    return record.header_len_for(payload) + payload


def check_record(path: str, namespace: str, max_bytes: int = DEFAULT_MAX_RECORD_FILE_BYTES) -> None:
    """Raise :class:`Corrupt` unless the file is a whole, valid record of ``namespace`` stored
    under the name its key hashes to."""
    data = read_record_file(path, max_bytes)
    header = record.decode_header(data)
    if header.namespace.hex() != namespace:
        raise Corrupt("record of another namespace")
    if os.path.basename(path)[: -len(RECORD_SUFFIX)] != record_name(header.key):
        raise Corrupt("record stored under another key's name", key=header.key)
    if len(data) != header.header_len + header.payload_len:
        raise Corrupt("record has the wrong size", size=len(data))
    record.verify(header, header.namespace, header.key, memoryview(data)[header.header_len:])


def verify(root: str, remove: bool = False, progress: Progress | None = None) -> VerifyReport:
    report = VerifyReport()
    for ns in namespaces(root):
        max_bytes = max_record_file_bytes(root, ns)
        for rec in record_files(root, ns):
            report.checked += 1
            try:
                check_record(rec.path, ns, max_bytes)
                report.good += 1
            except Corrupt as exc:
                report.bad.append((rec.path, exc.message))
                if remove:
                    try:
                        os.unlink(rec.path)
                        report.removed += 1
                    except FileNotFoundError:
                        pass
            except FileNotFoundError:
                report.checked -= 1  # evicted while we looked
            if progress:
                progress(1)
    return report


# -- gc ------------------------------------------------------------------------------------------


@dataclass
class GcReport:
    before_bytes: int = 0
    after_bytes: int = 0
    removed: int = 0
    skipped_namespaces: list[str] = field(default_factory=list)
    failures: int = 0


def gc(root: str, max_bytes: int, progress: Progress | None = None, dry_run: bool = False) -> GcReport:
    """Delete least recently used records (by mtime, which reads refresh) across all namespaces
    until the directory holds at most ``max_bytes``. Namespaces a running daemon evicts for are
    left to it and reported. ``dry_run``: delete nothing; the report says what would go."""
    report = GcReport()
    locks = []
    candidates: list[RecordFile] = []
    try:
        for ns in namespaces(root):
            records = list(record_files(root, ns))
            report.before_bytes += sum(r.size for r in records)
            fd = try_flock(os.path.join(root, ns, LOCK_NAME))
            if fd is None:
                report.skipped_namespaces.append(ns)
                report.after_bytes += sum(r.size for r in records)
                continue
            locks.append(fd)
            candidates.extend(records)
        total = report.before_bytes
        candidates.sort(key=lambda r: r.mtime)
        for rec in candidates:
            if total <= max_bytes:
                report.after_bytes += rec.size
                continue
            try:
                if not dry_run:
                    os.unlink(rec.path)
                report.removed += 1
                total -= rec.size
            except FileNotFoundError:
                total -= rec.size
            except OSError:
                report.failures += 1
                report.after_bytes += rec.size
            if progress:
                progress(1)
    finally:
        for fd in locks:
            os.close(fd)
    return report
