"""Offline operations on a storage directory: inspect, verify, gc.

They read the same layout the file store writes and never need a daemon. They are safe next to
running daemons: verify only removes records that fail their checks (a daemon would remove them
on read anyway) and record files outside their fan-out directory (a daemon never finds them),
and gc skips any namespace whose eviction lock a daemon holds. They read files as the daemon
does (no symlinks followed, no FIFO waited on), and verify never reads a file larger than a
record a daemon accepts (``max_record_bytes``, which a directory's own ``namespace.json`` can
narrow only where it proves itself), and checksums payloads in chunks, so its memory stays
bounded whatever the directory holds.

Every entry of the directory is accounted for: a record file at its place (``ab/cd/<name>.kvr``
for a name that starts ``abcd``) is a *record*; a record file anywhere else in its namespace is
*misplaced*; a temp file under ``tmp/`` is *temp*; anything else (another name, a directory that
is not part of the layout, a symlink, a loose file in the root) is *unknown*. Only a
namespace's ``namespace.json`` and ``evict.lock`` (its metadata) and the root's ``lost+found``
are not entries.

(Over 500 lines: inspect, verify and gc share one walk of the directory that accounts for every
file, and verify's checks are the record format's; each command's own code is short.)
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterator

from kvswap.protocol.errors import Corrupt, KvswapError
from kvswap.protocol.layout import CacheLayout

from . import record, slab_tools
from .disk import Disk, try_flock
from .file_layout import LOCK_NAME, RECORD_SUFFIX, TMP_SUFFIX, record_name

#: Age buckets for ``inspect`` (upper bounds, seconds).
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1m", 60), ("<1h", 3600), ("<1d", 86400), ("<7d", 7 * 86400), (">=7d", float("inf")))

Progress = Callable[[int], None]

_HEX32: Final = re.compile(r"[0-9a-f]{32}")  # record names (xxh3-128 hex) and namespace fingerprints
_SHARD: Final = re.compile(r"[0-9a-f]{2}")
#: Files of the slab layout: <id>.slab, <id>.journal, <id>.lock, and a journal being compacted.
_SLAB_FILE: Final = re.compile(r"[0-9a-f]{8}\.(slab|journal|lock|journal\.[0-9a-f]{8}\.tmp)")
DESCRIPTION_NAME: Final = "namespace.json"
#: A namespace directory's own files, which are not entries.
METADATA: Final = frozenset({DESCRIPTION_NAME, LOCK_NAME})
#: The root's entries that are not the store's (a mount point's ``lost+found``).
ROOT_IGNORED: Final = frozenset({"lost+found"})


@dataclass(frozen=True)
class Entry:
    #: "record", "misplaced", "temp", "slab" (a slab layout's file: its records are what the
    #: journals name, :mod:`.slab_tools`) or "unknown" (see the module docstring).
    kind: str
    path: str
    #: Bytes (``lstat``); for a directory, the bytes of every file under it.
    size: int
    mtime: float
    #: A regular file (not a symlink, FIFO or directory).
    regular: bool
    #: For misplaced and unknown entries: what is wrong.
    why: str = ""


def _listing(path: str) -> list[os.DirEntry[str]] | str:
    """The entries of a directory, sorted; a directory that is gone has none; one that cannot
    be listed is the reason why."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        return f"cannot be listed: {exc.strerror or exc}"


def _lstat(entry: os.DirEntry[str]) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None


def _tree(path: str) -> tuple[int, int]:
    """(files, bytes) under a directory, symlinks not followed."""
    files = size = 0
    for top, dirs, names in os.walk(path):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            try:
                size += os.lstat(os.path.join(top, name)).st_size
                files += 1
            except OSError:
                continue
    return files, size


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _unknown(entry: os.DirEntry[str], st: os.stat_result, why: str = "") -> Entry:
    if stat.S_ISDIR(st.st_mode):
        files, size = _tree(entry.path)
        what = f"{why or 'a directory that is not part of the layout'} ({_plural(files, 'file')}, {size:,} bytes)"
        return Entry("unknown", entry.path, size, st.st_mtime, False, what)
    if stat.S_ISLNK(st.st_mode):
        what = f"{why}, a symlink (not followed)" if why else "a symlink (not followed)"
    elif stat.S_ISREG(st.st_mode):
        what = why or "not a record name"
    else:
        what = f"{why}, not a regular file" if why else "not a regular file"
    return Entry("unknown", entry.path, st.st_size, st.st_mtime, stat.S_ISREG(st.st_mode), what)


def _classify(entry: os.DirEntry[str], shard: str) -> Entry | None:
    """An entry of a namespace directory; ``shard`` is the fan-out path it sits in ("ab/cd",
    "ab", or "" at the namespace's top)."""
    st = _lstat(entry)
    if st is None:
        return None
    name = entry.name
    regular = stat.S_ISREG(st.st_mode)
    if name.endswith(RECORD_SUFFIX) and _HEX32.fullmatch(name[: -len(RECORD_SUFFIX)]):
        place = f"{name[:2]}/{name[2:4]}"
        if shard == place:
            size = _tree(entry.path)[1] if stat.S_ISDIR(st.st_mode) else st.st_size
            return Entry("record", entry.path, size, st.st_mtime, regular)
        if regular:
            return Entry("misplaced", entry.path, st.st_size, st.st_mtime, True,
                         f"a record file outside its fan-out directory ({place})")
    return _unknown(entry, st)


def _unlistable(path: str, why: str) -> Entry:
    return Entry("unknown", path, 0, 0.0, False, why)


def namespaces(root: str) -> list[str]:
    """Namespace directories under ``root``: real directories (not symlinks) named as a
    fingerprint or holding a ``namespace.json``."""
    found = _listing(root)
    if isinstance(found, str):
        return []
    return [e.name for e in found if e.is_dir(follow_symlinks=False)
            and (_HEX32.fullmatch(e.name) or os.path.lexists(os.path.join(e.path, DESCRIPTION_NAME)))]


def root_strays(root: str) -> Iterator[Entry]:
    """Entries of the root that are not namespace directories (all *unknown*)."""
    found = _listing(root)
    if isinstance(found, str):
        yield _unlistable(root, found)
        return
    known = set(namespaces(root)) | ROOT_IGNORED
    for entry in found:
        if entry.name not in known and (st := _lstat(entry)) is not None:
            yield _unknown(entry, st, "not a namespace directory")


def walk_namespace(root: str, namespace: str) -> Iterator[Entry]:
    """Every entry of one namespace directory, from a walk of what is there (paths are never
    rebuilt from names, so a file in the wrong place is found where it is)."""
    base = os.path.join(root, namespace)
    top = _listing(base)
    if isinstance(top, str):
        yield _unlistable(base, top)
        return
    for entry in top:
        is_dir = entry.is_dir(follow_symlinks=False)
        if entry.name in METADATA and not is_dir:
            continue
        if entry.name == "tmp" and is_dir:
            inner = _listing(entry.path)
            if isinstance(inner, str):
                yield _unlistable(entry.path, inner)
                continue
            for temp in inner:
                if (st := _lstat(temp)) is None:
                    continue
                if stat.S_ISREG(st.st_mode) and temp.name.endswith(TMP_SUFFIX):
                    yield Entry("temp", temp.path, st.st_size, st.st_mtime, True)
                else:
                    yield _unknown(temp, st, "not a temp file")
        elif is_dir and entry.name == slab_tools.SLAB_DIR:
            inner = _listing(entry.path)
            if isinstance(inner, str):
                yield _unlistable(entry.path, inner)
                continue
            for item in inner:
                if (st := _lstat(item)) is None:
                    continue
                if stat.S_ISREG(st.st_mode) and _SLAB_FILE.fullmatch(item.name):
                    yield Entry("slab", item.path, st.st_blocks * 512, st.st_mtime, True)
                else:
                    yield _unknown(item, st, "not a slab file")
        elif is_dir and _SHARD.fullmatch(entry.name):
            level1 = _listing(entry.path)
            if isinstance(level1, str):
                yield _unlistable(entry.path, level1)
                continue
            for second in level1:
                if second.is_dir(follow_symlinks=False) and _SHARD.fullmatch(second.name):
                    leaves = _listing(second.path)
                    if isinstance(leaves, str):
                        yield _unlistable(second.path, leaves)
                        continue
                    for leaf in leaves:
                        if (found := _classify(leaf, f"{entry.name}/{second.name}")) is not None:
                            yield found
                elif (found := _classify(second, entry.name)) is not None:
                    yield found
        elif (found := _classify(entry, "")) is not None:
            yield found


def count_files(root: str) -> int:
    """Entries the tools walk (what their progress counts)."""
    return sum(1 for _ in root_strays(root)) + sum(1 for ns in namespaces(root) for _ in walk_namespace(root, ns))


#: Largest ``namespace.json`` read.
MAX_DESCRIPTION_BYTES = 1024 * 1024

_READER = Disk()


def read_record_file(path: str, max_bytes: int) -> bytearray:
    """The bytes of one small file (``namespace.json``), read the way the daemon reads records
    (``Disk.read_file``: O_NOFOLLOW, O_NONBLOCK, regular files only), so a symlink (to
    /dev/zero, say) or a FIFO is :class:`Corrupt`, never followed and never waited on; and a
    file over ``max_bytes`` is :class:`Corrupt` before it is read."""
    head = bytearray(record.ALIGNED_HEADER)
    _, size = _READER.read_file(path, [head])
    if size > max_bytes:
        raise Corrupt(f"a file of {size} bytes, larger than a record of this namespace ({max_bytes})", size=size)
    data = bytearray(size)
    done, now = _READER.read_file(path, [data])
    if done != size or now != size:
        raise Corrupt("the file changed while it was read", size=now)
    return data


def read_description(root: str, namespace: str) -> tuple[dict[str, Any] | None, str | None]:
    """A namespace's ``namespace.json`` as a dict, or None and what is wrong with it."""
    try:
        body = json.loads(read_record_file(os.path.join(root, namespace, DESCRIPTION_NAME), MAX_DESCRIPTION_BYTES))
    except FileNotFoundError:
        return None, "is missing"
    except Corrupt as exc:
        return None, "cannot be read: " + exc.message.replace(" where a record should be", "")
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror or exc}"
    except ValueError:
        return None, "is not valid JSON"
    if not isinstance(body, dict):
        return None, "is not a JSON object"
    return body, None


# -- inspect -------------------------------------------------------------------------------------


@dataclass
class NamespaceSummary:
    namespace: str
    description: dict[str, Any]
    records: int = 0
    bytes: int = 0
    temp_files: int = 0
    misplaced: int = 0
    unknown: int = 0
    #: Bytes the slab layout's files take on disk (slots, free ones included, and journals).
    slab_bytes: int = 0
    ages: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _ in AGE_BUCKETS})


def inspect(root: str, progress: Progress | None = None, now: float | None = None) -> list[NamespaceSummary]:
    now = time.time() if now is None else now
    tick = progress or (lambda n: None)
    for _ in root_strays(root):
        tick(1)
    out = []
    for ns in namespaces(root):
        description, problem = read_description(root, ns)
        summary = NamespaceSummary(ns, description if description is not None else {"error": f"namespace.json {problem}"})
        for entry in walk_namespace(root, ns):
            if entry.kind == "record":
                summary.records += 1
                summary.bytes += entry.size
                age = now - entry.mtime
                summary.ages[next(name for name, bound in AGE_BUCKETS if age < bound)] += 1
            elif entry.kind == "temp":
                summary.temp_files += 1
            elif entry.kind == "slab":
                summary.slab_bytes += entry.size
            elif entry.kind == "misplaced":
                summary.misplaced += 1
            else:
                summary.unknown += 1
            tick(1)
        slots = slab_tools.slot_bytes_of(root, ns)
        for rec in slab_tools.records(root, ns):
            summary.records += 1
            summary.bytes += slots.get(rec.slab_path, 0)
            age = now - rec.stamp / 1e9
            summary.ages[next(name for name, bound in AGE_BUCKETS if age < bound)] += 1
            tick(1)
        out.append(summary)
    return out


# -- verify --------------------------------------------------------------------------------------

#: Largest record payload ``verify`` reads unless told otherwise: what a daemon with the default
#: staging accepts (a record's page-rounded slot must fit ``--read-staging-bytes``, 64 MiB, and
#: ``--write-staging-bytes``, 256 MiB; ``kvswap verify`` computes its default from the daemon's
#: config, and a test holds the two equal).
DEFAULT_MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
#: Payload bytes checksummed per read: verify's memory does not grow with a record's size.
CHUNK_BYTES: Final = 1024 * 1024


@dataclass(frozen=True)
class RecordSize:
    """What verify expects of a namespace's record files."""

    #: The payload size ``namespace.json`` proves (its layout fingerprints to the directory's
    #: name), or None: each record is then held to its own header and ``max_record_bytes``.
    record_bytes: int | None
    #: The proven size is over ``max_record_bytes``: its records are not read.
    over_limit: bool = False
    problems: tuple[str, ...] = ()


def record_size(root: str, namespace: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> RecordSize:
    """The record size of ``namespace``. ``namespace.json`` is a file in the directory, which a
    corruption or anyone who can write there controls, so its ``record_bytes`` counts only where
    its layout fingerprints to the namespace's name: then the layout (which the fingerprint
    covers) is the namespace's, and so is the record size it makes. It never raises what
    verify reads past ``max_record_bytes``."""
    body, problem = read_description(root, namespace)
    if body is None:
        return RecordSize(None, problems=(str(problem),))
    try:
        layout = CacheLayout.from_wire(body.get("layout"))
        fingerprint = layout.fingerprint()
    except (KvswapError, TypeError, ValueError) as exc:
        reason = exc.message if isinstance(exc, KvswapError) else str(exc)
        return RecordSize(None, problems=(f"its layout does not fingerprint to this directory ({reason})",))
    if fingerprint != namespace:
        return RecordSize(None, problems=(f"its layout does not fingerprint to this directory (it makes {fingerprint})",))
    size = layout.record_bytes
    declared = body.get("record_bytes")
    problems = () if declared == size and type(declared) is int else (
        f"it says record_bytes {declared!r}, its layout makes {size}",)
    return RecordSize(size, size > max_record_bytes, problems)


@dataclass
class VerifyReport:
    #: Record files at their places that were read and checked.
    checked: int = 0
    good: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    #: Files removed with ``remove``: bad records and misplaced record files.
    removed: int = 0
    #: Record files of namespaces whose records are over ``max_record_bytes`` (not read).
    unchecked: int = 0
    misplaced: list[tuple[str, str]] = field(default_factory=list)
    unknown: list[tuple[str, str]] = field(default_factory=list)
    namespace_problems: list[tuple[str, str]] = field(default_factory=list)  # (namespace.json, what)
    removal_failures: list[tuple[str, str]] = field(default_factory=list)
    temp_files: int = 0

    @property
    def problems(self) -> bool:
        return bool(self.bad or self.misplaced or self.unknown or self.namespace_problems or self.removal_failures)


def _open_record(path: str) -> int:
    """Open a record file as ``Disk.read_file`` does: O_NOFOLLOW and O_NONBLOCK, regular files
    only, so a planted symlink or FIFO is :class:`Corrupt`, never followed or waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Corrupt("a symlink where a record should be") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Corrupt("not a regular file where a record should be")
    return fd


def check_record(path: str, namespace: str, record_bytes: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
    """Raise :class:`Corrupt` unless the file is a whole, valid record of ``namespace`` stored
    under the name its key hashes to. Its size is checked before anything is read: against
    ``record_bytes`` where the namespace proves it, else against ``max_record_bytes``. The
    payload is checksummed in chunks of :data:`CHUNK_BYTES`."""
    fd = _open_record(path)
    try:
        size = os.fstat(fd).st_size
        if record_bytes is not None:
            expected = record.header_len_for(record_bytes) + record_bytes
            if size != expected:
                how = "larger" if size > expected else "shorter"
                raise Corrupt(f"a file of {size} bytes, {how} than a record of this namespace ({expected})", size=size)
        elif size > (limit := record.header_len_for(max_record_bytes) + max_record_bytes):
            raise Corrupt(f"a file of {size} bytes, larger than any record a daemon accepts ({limit}; see "
                          "--max-record-bytes)", size=size)
        header = record.decode_header(os.pread(fd, min(size, record.ALIGNED_HEADER), 0))
        if header.namespace.hex() != namespace:
            raise Corrupt("record of another namespace")
        if os.path.basename(path)[: -len(RECORD_SUFFIX)] != record_name(header.key):
            raise Corrupt("record stored under another key's name", key=header.key)
        if size != header.header_len + header.payload_len:
            raise Corrupt("record has the wrong size", size=size)
        checksum = record.checksum_at(fd, header.header_len, size - header.header_len, CHUNK_BYTES)
        if checksum is None:
            raise Corrupt("the file changed while it was read")
        if checksum != header.checksum:
            raise Corrupt("payload checksum mismatch")
    finally:
        os.close(fd)


def _remove(path: str, report: VerifyReport) -> None:
    try:
        os.unlink(path)
        report.removed += 1
    except FileNotFoundError:
        pass
    except OSError as exc:
        report.removal_failures.append((path, f"cannot remove: {exc.strerror or exc}"))


def verify(root: str, remove: bool = False, progress: Progress | None = None,
           max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> VerifyReport:
    """Check every record file at its place; report every other entry. ``remove``: delete bad
    records and misplaced record files (no daemon reads either); unknown files are never
    removed."""
    report = VerifyReport()
    tick = progress or (lambda n: None)
    for entry in root_strays(root):
        report.unknown.append((entry.path, entry.why))
        tick(1)
    for ns in namespaces(root):
        size = record_size(root, ns, max_record_bytes)
        unchecked = 0
        for entry in walk_namespace(root, ns):
            if entry.kind == "record" and size.over_limit:
                unchecked += 1
            elif entry.kind == "record":
                report.checked += 1
                try:
                    check_record(entry.path, ns, size.record_bytes, max_record_bytes)
                    report.good += 1
                except Corrupt as exc:
                    report.bad.append((entry.path, exc.message))
                    if remove:
                        _remove(entry.path, report)
                except FileNotFoundError:
                    report.checked -= 1  # evicted while we looked
                except OSError as exc:  # a read error is no proof of a bad record: reported, kept
                    report.bad.append((entry.path, f"cannot be read: {exc.strerror or exc}"))
            elif entry.kind == "misplaced":
                report.misplaced.append((entry.path, entry.why))
                if remove:
                    _remove(entry.path, report)
            elif entry.kind == "temp":
                report.temp_files += 1
            elif entry.kind != "slab":
                report.unknown.append((entry.path, entry.why))
            tick(1)
        unchecked += _verify_slabs(root, ns, size, remove, report, tick, max_record_bytes)
        problems = list(size.problems)
        if size.over_limit:
            problems.append(f"records of {size.record_bytes} bytes, over --max-record-bytes ({max_record_bytes}): "
                            f"{_plural(unchecked, 'record')} not checked")
        report.unchecked += unchecked
        meta = os.path.join(root, ns, DESCRIPTION_NAME)
        report.namespace_problems.extend((meta, p) for p in problems)
    return report


def _verify_slabs(root: str, ns: str, size: RecordSize, remove: bool, report: VerifyReport, tick: Progress,
                  max_record_bytes: int) -> int:
    """Check every record the namespace's journals name; ``remove`` frees bad ones in slabs
    no daemon owns (a daemon frees them when it reads them). Returns the records not read."""
    recs = slab_tools.records(root, ns)
    if size.over_limit:
        tick(len(recs))
        return len(recs)
    bad = []
    for rec in recs:
        where = f"{rec.slab_path}#{rec.slot}"
        report.checked += 1
        try:
            slab_tools.check(rec, ns, size.record_bytes, max_record_bytes, CHUNK_BYTES)
            report.good += 1
        except Corrupt as exc:
            report.bad.append((where, exc.message))
            bad.append(rec)
        except OSError as exc:
            report.bad.append((where, f"cannot be read: {exc.strerror or exc}"))
        tick(1)
    if remove and bad:
        with slab_tools.SlabEditor(root, ns) as editor:
            mine = [r for r in bad if editor.can_edit(r.slab_path)]
            for r in bad:
                if r not in mine:
                    report.removal_failures.append((f"{r.slab_path}#{r.slot}", "its slab belongs to a running daemon, "
                                                    "which removes the record when it reads it"))
            report.removed += editor.free(mine)
    return 0


# -- gc ------------------------------------------------------------------------------------------


@dataclass
class GcReport:
    #: Bytes of every entry of the directory (records, misplaced, unknown and temp files) when
    #: gc listed it, and what is left of them: what gc removed (or would) is all that differs.
    before_bytes: int = 0
    after_bytes: int = 0
    removed: int = 0
    removed_bytes: int = 0
    skipped_namespaces: list[str] = field(default_factory=list)
    #: Files gc does not remove, left on disk: (path, bytes, what).
    skipped_files: list[tuple[str, int, str]] = field(default_factory=list)
    temp_files: int = 0
    temp_bytes: int = 0
    #: Records whose removal failed (permissions, a read-only file system).
    failures: int = 0
    max_bytes: int = 0

    @property
    def over_budget(self) -> bool:
        return self.after_bytes > self.max_bytes

    @property
    def problems(self) -> bool:
        return bool(self.over_budget or self.skipped_namespaces or self.skipped_files or self.failures)


def gc(root: str, max_bytes: int, progress: Progress | None = None, dry_run: bool = False) -> GcReport:
    """Delete least recently used records (by mtime, which reads refresh) across all namespaces
    until the directory holds at most ``max_bytes``, counting every file in it. Only record
    files at their places are removed; namespaces a running daemon evicts for are left to it,
    and misplaced, unknown and temp files are left alone; all are counted in what is left and
    reported. ``dry_run``: delete nothing; the report says what would go.

    Progress: two steps per entry, one when it is listed and one when it is decided (kept,
    removed, or left because gc does not remove it)."""
    report = GcReport(max_bytes=max_bytes)
    tick = progress or (lambda n: None)
    locks = []
    candidates: list[Entry] = []
    slab_candidates: list[tuple[float, str, Any, int]] = []
    try:
        for entry in root_strays(root):
            report.before_bytes += entry.size
            report.skipped_files.append((entry.path, entry.size, entry.why))
            tick(2)
        for ns in namespaces(root):
            fd = try_flock(os.path.join(root, ns, LOCK_NAME))
            if fd is None:
                report.skipped_namespaces.append(ns)
            else:
                locks.append(fd)
            for entry in walk_namespace(root, ns):
                report.before_bytes += entry.size
                if entry.kind == "record" and entry.regular and fd is not None:
                    candidates.append(entry)
                    tick(1)
                    continue
                if entry.kind == "slab":
                    tick(2)  # the slab layout's files: their records are candidates below
                    continue
                if entry.kind == "temp":
                    report.temp_files += 1
                    report.temp_bytes += entry.size
                elif entry.kind == "misplaced":
                    report.skipped_files.append((entry.path, entry.size, "misplaced"))
                elif entry.kind == "unknown":
                    report.skipped_files.append((entry.path, entry.size, entry.why))
                elif not entry.regular:
                    report.skipped_files.append((entry.path, entry.size, "not a regular file where a record should be"))
                tick(2)  # a record of a skipped namespace: counted, left to its daemon
            if fd is not None:
                slots = slab_tools.slot_bytes_of(root, ns)
                slab_candidates.extend((rec.stamp / 1e9, ns, rec, slots.get(rec.slab_path, 0))
                                       for rec in slab_tools.records(root, ns))
        total = report.before_bytes
        total = _gc_slabs(root, slab_candidates, candidates, total, max_bytes, dry_run, report, tick)
        candidates.sort(key=lambda r: r.mtime)
        for rec in candidates:
            if total > max_bytes:
                try:
                    if not dry_run:
                        os.unlink(rec.path)
                    report.removed += 1
                    report.removed_bytes += rec.size
                    total -= rec.size
                except FileNotFoundError:
                    total -= rec.size  # gone from where it was listed: a daemon evicted it
                except OSError:
                    report.failures += 1
            tick(1)
        report.after_bytes = total
    finally:
        for fd in locks:
            os.close(fd)
    return report


def _gc_slabs(root: str, slab_candidates: list[tuple[float, str, Any, int]], files: list[Entry], total: int,
              max_bytes: int, dry_run: bool, report: GcReport, tick: Progress) -> int:
    """Evict slab records older than the newest record file that would go, oldest first, in
    slabs no daemon owns: a free entry each, their slots punched out. Returns what is left."""
    if not slab_candidates:
        return total
    slab_candidates.sort(key=lambda c: c[0])
    file_times = sorted(e.mtime for e in files)
    chosen: dict[str, list[Any]] = {}
    editors: dict[str, slab_tools.SlabEditor] = {}
    if not dry_run:
        # Slots allocated ahead and never written, or freed by evictions, count as the slab's
        # bytes: give them back first, then see what is still over.
        for ns in sorted({c[1] for c in slab_candidates}):
            editor = editors.setdefault(ns, slab_tools.SlabEditor(root, ns))
            for path in sorted({c[2].slab_path for c in slab_candidates if c[1] == ns}):
                if editor.can_edit(path):
                    before = slab_tools.disk_bytes(path)
                    editor.give_back(path)
                    total -= before - slab_tools.disk_bytes(path)
    try:
        for when, ns, rec, slot in slab_candidates:
            tick(1)
            if total <= max_bytes:
                continue
            if file_times and file_times[0] < when:
                continue  # an older record file goes first (the file loop below)
            editor = editors.get(ns) or editors.setdefault(ns, slab_tools.SlabEditor(root, ns))
            if not editor.can_edit(rec.slab_path):
                continue
            chosen.setdefault(ns, []).append(rec)
            report.removed += 1
            report.removed_bytes += slot
            total -= slot
        if not dry_run:
            for ns, recs in chosen.items():
                editors[ns].free(recs)
    finally:
        for editor in editors.values():
            editor.__exit__()
    return total
