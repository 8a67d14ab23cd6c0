"""The file tier: one record per file under ``<root>/<namespace>/``.

Layout of a namespace directory::

    <root>/<namespace>/namespace.json     what the fingerprint stands for (model, dtype, ...)
    <root>/<namespace>/ab/cd/<name>.kvr   records; <name> = xxh3-128 hex of the key
    <root>/<namespace>/tmp/               records being written
    <root>/<namespace>/evict.lock         flock'ed by the one daemon that evicts

A key never becomes a path: the file name is a hash of it, and the key itself is kept in the
record header, so two keys whose names collide are told apart on read. Records are written to
a unique temp file and renamed into place, so a reader (or a restart after SIGKILL) sees
either the whole record or none; the index is updated after the rename and files are deleted
last. Files are 0600, directories 0700.

Capacity: with ``max_bytes`` set, a write first reserves its bytes; if the directory would go
over the cap, records are evicted down to the low watermark before the write starts, so the
directory never holds more than the cap. Background eviction keeps usage under the high
watermark (and free space above ``min_free_bytes``). Which record goes first is the rule of
:mod:`.chains`: stranded records, then the least recent record no other record follows, so a
chain loses its tail before its head and never keeps a record no lookup can reach; a record
whose predecessor was evicted is not written (``no_space``). A record being read is pinned and
never evicted; a file that cannot be deleted is set aside and counted, so one bad file cannot
wedge eviction. Recency survives a restart through the files' mtimes: a write gives its file
the record's recency stamp, and a swap_in re-stamps its hit prefix. The chain links are in
memory only, learned again from requests after a restart.

Shared directories: several daemons (and hosts, on NFS) may use one root. Temp names are
unique per writer, a rename that replaces another writer's copy of the same record is a
success, ``contains`` falls back to the directory for records others wrote, and exactly one
daemon per namespace evicts: the holder of ``evict.lock`` (flock). When it dies the kernel
drops the lock and the next daemon's maintenance pass takes over.

(Just over 500 lines: put, get, scan and eviction share one index, one lock and one set of
counters; the byte I/O is disk.py's, the bookkeeping file_index.py's and the chain rule
chains.py's already.)
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Container, Final, Iterator, Sequence

from kvswap.common.units import PAGE_BYTES
from kvswap.protocol.errors import Corrupt, IOFailure, NoSpace

from . import record
from .base import Backend, GetStatus, Store
from .events import RecordEvents
from .chains import chain_broken
from .disk import DIRECT_IO_MODES, FSYNC_MODES, Disk, aligned_empty, make_private_dirs, try_flock
from .file_index import RecordIndex
from .file_layout import (LOCK_NAME, RECORD_SUFFIX, TMP_SUFFIX, reclaim_temp_files, record_name, record_names,
                          scan_record_files)

if TYPE_CHECKING:
    from .file_backend import FileBackend

__all__ = ["FSYNC_MODES", "DIRECT_IO_MODES", "LOCK_NAME", "RECORD_SUFFIX", "TMP_SUFFIX", "Capacity", "Disk",
           "FileStore", "make_private_dirs", "record_name", "scan_record_files"]

log = logging.getLogger(__name__)

_SPACE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


def _io_error(exc: OSError, action: str, path: str) -> Exception:
    if exc.errno in _SPACE_ERRNOS:
        return NoSpace(f"no space left to {action}", path=path)
    return IOFailure(f"cannot {action}: {exc.strerror or exc}", path=path, errno=exc.errno or 0)


@dataclass(frozen=True)
class Capacity:
    """How much the file tier may hold. 0 means no limit."""

    max_bytes: int = 0
    min_free_bytes: int = 0
    #: Background eviction starts above ``high * max_bytes`` and stops at ``low * max_bytes``.
    high: float = 0.95
    low: float = 0.85

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.min_free_bytes < 0:
            raise ValueError("capacity limits must be >= 0")
        if not 0 < self.low < self.high <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")


class FileStore(Store):
    tier = "file"

    def __init__(self, backend: FileBackend, namespace: str, description: dict[str, Any], record_bytes: int) -> None:
        self.backend = backend
        self.disk = backend.disk
        self.capacity = backend.capacity
        self.namespace = namespace
        self.namespace_bytes = bytes.fromhex(namespace)
        self.record_bytes = record_bytes
        self.header_len = record.header_len_for(record_bytes)
        self.file_bytes = self.header_len + record_bytes
        self.dir = os.path.join(backend.root, namespace)
        self.tmp_dir = os.path.join(self.dir, "tmp")
        self.index = RecordIndex(backend.eviction)
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self.scan_complete = threading.Event()
        self.scan_seconds = 0.0
        self._reserved = 0
        self._thread_buffers = threading.local()
        self._dirs_made: set[str] = set()
        self._admission = threading.Lock()
        self._lock_fd: int | None = None
        #: Set by :meth:`close`; a closed store never takes the eviction lock (a scan or a
        #: maintenance pass that was under way when it closed would keep it, and its
        #: descriptor, for good: issue 22). ``_lead_lock`` orders the two.
        self._closed = False
        self._lead_lock = threading.Lock()
        self._last_rescan = 0.0
        #: record name -> key, kept only with KV events on (:meth:`watch`).
        self._keys: dict[str, str] = {}
        self._prepare(description)

    # -- layout on disk ---------------------------------------------------------------------------

    def _prepare(self, description: dict[str, Any]) -> None:
        meta_path = os.path.join(self.dir, "namespace.json")
        try:
            self.disk.make_dirs(self.tmp_dir)
            if not os.path.exists(meta_path):
                body = json.dumps({"namespace": self.namespace, "record_bytes": self.record_bytes,
                                   "record_format": record.FORMAT_VERSION, "layout": description},
                                  indent=2, sort_keys=True).encode()
                self.disk.write_file(self._tmp_path("namespace"), meta_path, [body])
        except OSError as exc:
            raise _io_error(exc, "prepare the namespace directory", self.dir) from None

    def path_of(self, key: str) -> tuple[str, str]:
        name = record_name(key)
        return name, self._path(name)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name[:2], name[2:4], name + RECORD_SUFFIX)

    def _tmp_path(self, name: str) -> str:
        return os.path.join(self.tmp_dir, f"{name}.{self.backend._writer_tag}.{secrets.token_hex(4)}{TMP_SUFFIX}")

    # -- KV events: the index says which names come and go; events need their keys ---------------

    def watch(self, events: RecordEvents) -> None:
        super().watch(events)
        if events.enabled:
            self._keys = {}
            self.index.watch(self)

    def entered(self, names: Sequence[str], key: str | None = None) -> None:
        """(the index's watcher, under its lock) Records now indexed: announced by key, where
        it is known (a write, a hit; a scan learns keys from headers before it merges)."""
        if key is not None:
            self._keys[names[0]] = key
        keys = [k for k in map(self._keys.get, names) if k is not None]
        self.events.stored(self.tier, self.namespace, keys)

    def left(self, names: Sequence[str]) -> None:
        keys = [k for k in (self._keys.pop(name, None) for name in names) if k is not None]
        self.events.removed(self.tier, self.namespace, keys)

    def emptied(self) -> None:
        self._keys.clear()
        self.events.cleared(self.tier, self.namespace)

    def _learn_keys(self, found: list[tuple[str, int, int]]) -> None:
        """Read the key of each listed record the events do not know yet from its header, and
        the name it was announced by before a restart, its annotation (KV events only: one
        small read per record the scan finds). A record whose header does not read stays
        unnamed: it is never announced, and its removal is not either."""
        if not self.events.enabled:
            return
        for name, _, _ in found:
            if name in self._keys:
                continue
            try:
                head = self._read_header(name)
                header = record.decode_header(head)
            except (OSError, Corrupt):
                continue
            if record_name(header.key) == name and header.namespace == self.namespace_bytes:
                self._keys[name] = header.key
                annotation = record.decode_annotation(head)
                if annotation:
                    self.events.recall(self.namespace, header.key, annotation)

    # -- Store ------------------------------------------------------------------------------------

    def put(self, key: str, payload: memoryview) -> int:
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        name = record_name(key)
        worth, stamp = self.index.stamp_for_write(name)
        if not worth:
            # Refused, so records after it that other write threads already stored are stranded.
            self._drop_stranded()
            raise self._chain_broken(key)
        header = self._header(key, payload)
        try:
            self._admit(self.file_bytes)
            try:
                # The file's mtime is its recency stamp, so a restart orders records as the index did.
                size = self._write_record(name, header, payload, stamp)
            finally:
                with self._admission:
                    self._reserved -= self.file_bytes
        except BaseException:
            self.index.release(name)
            self._drop_stranded()
            raise
        if not self.index.add(name, size, stamp, key):
            # Its predecessor was evicted while it was being written: nothing can reach it.
            self._discard(name)
            self._drop_stranded()
            raise self._chain_broken(key)
        return size

    def _drop_stranded(self) -> None:
        """A record that was not stored strands those of its chain already written after it
        (by other write threads): no lookup can reach them, so they go now rather than at the
        next eviction."""
        while (victim := self.index.take_stranded()) is not None:
            name, _ = victim
            try:
                if self._remove_record(name):
                    self._count("evicted_stranded", 1)
            except OSError as exc:
                log.warning("cannot remove stranded record %s: %s", name, exc)

    def _chain_broken(self, key: str) -> NoSpace:
        self._count("chain_refused", 1)
        return chain_broken(key, "file")

    def _header(self, key: str, payload: memoryview) -> memoryview | bytes:
        # With KV events on, the header keeps the record's name (engine hashes, tokens) where it
        # has room, so a restart announces it under the same name.
        annotation = self.events.annotation(self.namespace, key) if self.events.enabled else b""
        header = record.encode_header(self.namespace_bytes, key, len(payload), record.payload_checksum(payload),
                                      annotation=annotation)
        if self.disk.direct and len(header) % PAGE_BYTES == 0:
            aligned = self._header_buffer("write")  # O_DIRECT needs an aligned header buffer too
            aligned[:] = header
            return aligned
        return header

    # -- where records lie: one file each here; the slab layout (slab_store.py) overrides these --

    def _write_record(self, name: str, header: memoryview | bytes, payload: memoryview, stamp: int) -> int:
        """Store one record's bytes where ``name`` is found again; returns the bytes it takes.
        Raises the store's typed errors."""
        path = self._path(name)
        for attempt in (1, 2):
            try:
                self._make_record_dir(os.path.dirname(path))
                return self.disk.write_file(self._tmp_path(name), path, [header, payload], mtime_ns=stamp)
            except OSError as exc:
                if exc.errno in _SPACE_ERRNOS and attempt == 1 and self.is_leader:
                    # The disk filled under us (other tenants, or no cap set): make room, retry once.
                    self._count("enospc_retries", 1)
                    if self.evict(2 * self.file_bytes, "enospc"):
                        continue
                raise _io_error(exc, "write a record", path) from None
        raise AssertionError("unreachable")

    def _remove_record(self, name: str) -> bool:
        """Remove a record's bytes (not its index entry); True if they were there. Raises
        ``OSError``."""
        return self.disk.remove(self._path(name))

    def _persist_stamps(self, touched: Sequence[tuple[str, int]]) -> None:
        """Keep records' new recency stamps across a restart (here: their files' mtimes)."""
        for name, stamp in touched:
            try:
                self.disk.touch(self._path(name), stamp)
            except OSError:
                pass  # recency on disk is a hint; a read-only directory still serves reads

    def _location(self, name: str) -> str:
        """Where a record lies, for error details and logs."""
        return self._path(name)

    def _read_header(self, name: str) -> bytes:
        with open(self._path(name), "rb") as f:
            return f.read(self.header_len)

    def _header_buffer(self, use: str) -> memoryview:
        """An aligned header-sized buffer, one per thread and use, reused for every record (a
        fresh one per record cost a page-sized allocation on the hot path)."""
        buf = getattr(self._thread_buffers, use, None)
        if buf is None:
            buf = _aligned(self.header_len)
            setattr(self._thread_buffers, use, buf)
        return buf

    def _make_record_dir(self, path: str) -> None:
        """The 65,536 leaf directories are created once; remembering them saves a stat per
        write. Nothing removes them while the store is open."""
        if path not in self._dirs_made:
            self.disk.make_dirs(path)
            self._dirs_made.add(path)

    def _admit(self, nbytes: int) -> None:
        """Reserve room for a write, evicting first if the cap would be passed. Only the
        evicting daemon enforces the cap at write time; in a shared directory the others rely
        on its background passes."""
        cap = self.capacity.max_bytes
        while True:
            with self._admission:
                projected = self.index.bytes + self._reserved + nbytes
                over = cap and projected > cap and self.scan_complete.is_set()
                if not over or not (self.is_leader or self.try_lead()):
                    self._reserved += nbytes
                    return
                need = projected - int(cap * self.capacity.low)
            if not self.evict(need, "capacity"):
                raise NoSpace("the store is at its cap and nothing can be evicted (all records pinned or stuck)",
                              max_bytes=cap, used=self.index.bytes)

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        if len(out) != self.record_bytes:
            raise ValueError(f"output buffer of {len(out)} bytes, records hold {self.record_bytes}")
        name, path = self.path_of(key)
        header_buf = self._header_buffer("read") if self.disk.direct else bytearray(self.header_len)
        self.index.pin(name)
        try:
            try:
                try:
                    n, size = self.disk.read_file(path, [header_buf, out])
                except FileNotFoundError:
                    self.index.remove(name)
                    return GetStatus.MISS
                except OSError as exc:
                    raise _io_error(exc, "read a record", path) from None
                if n != self.file_bytes or size != self.file_bytes:
                    raise Corrupt("record has the wrong size", size=size, expected=self.file_bytes)
                header = record.decode_header(memoryview(header_buf))
                record.verify(header, self.namespace_bytes, key, out)
            except Corrupt as exc:
                log.warning("corrupt record %s for key %s: %s; removing it", path, key, exc.message)
                self._count("corrupt", 1)
                self._discard(name)
                return GetStatus.CORRUPT
        finally:
            self.index.unpin(name)
        self.index.touch(name)  # its file's mtime follows when the hit prefix is touched as a whole
        return GetStatus.LOADED

    def contains(self, key: str) -> bool:
        name, path = self.path_of(key)
        if name in self.index:
            return True
        # Not indexed: the start-up scan may not have reached it, or another daemon sharing
        # the directory wrote it. One stat settles it.
        if self.disk.exists(path):
            self.index.add(name, self.file_bytes, key=key)
            return True
        return False

    def cached_prefix(self, keys: Sequence[str], also_present: Container[str] = ()) -> int:
        """Leading keys indexed here or in ``also_present``. Names are made in pieces that grow
        fourfold (64, 256, ...), so a chain that misses early costs few hashes and a long hit
        few calls."""
        done, piece = 0, 64
        while done < len(keys):
            part = keys[done:done + piece]
            hits = self.index.present_prefix(record_names(part), _member_of(part, also_present))
            done += hits
            if hits < len(part):
                break
            piece *= 4
        return done

    def expect_chain(self, keys: Sequence[str]) -> None:
        """A swap_out is about to write ``keys``, one chain head first: their stamps make the
        tail older than the head (see :mod:`.chains`)."""
        self.index.touch_chain([record_name(k) for k in keys], reserve=True)

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """A hit prefix, touched as a whole (head newest); with ``persist`` (a swap_in) the
        files' mtimes take the new stamps, so the order survives a restart."""
        touched = self.index.touch_chain([record_name(k) for k in keys])
        if persist:
            self._persist_stamps(touched)

    def delete(self, key: str) -> bool:
        name = record_name(key)
        try:
            removed = self._remove_record(name)
        except OSError as exc:
            raise _io_error(exc, "delete a record", self._location(name)) from None
        self.index.remove(name)
        return removed

    def clear(self) -> int:
        removed = 0
        for path in self._record_paths():
            try:
                removed += self.disk.remove(path)
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc)
        self.index.clear()
        return removed

    def usage(self) -> dict[str, int]:
        return {"records": len(self.index), "bytes": self.index.bytes}

    def close(self) -> None:
        """Give up the eviction lock for good. Writes and reads still in flight finish; a scan
        under way stops at its next record."""
        with self._lead_lock:
            self._closed = True
            self._release_lead()

    def _discard(self, name: str) -> None:
        """Remove a bad record; if even that fails, it is still never served (the check fails
        again next time)."""
        try:
            self._remove_record(name)
        except OSError as exc:
            log.warning("cannot remove corrupt record %s: %s", self._location(name), exc)
        self.index.remove(name)

    # -- eviction ---------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self._lock_fd is not None

    def try_lead(self) -> bool:
        """Become the namespace's evicting daemon if nobody holds ``evict.lock`` (never once
        the store is closed)."""
        if self._lock_fd is not None:
            return True
        with self._lead_lock:
            if self._closed:
                return False
            if self._lock_fd is not None:
                return True
            fd = try_flock(os.path.join(self.dir, LOCK_NAME))
            if fd is None:
                return False
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{self.backend._writer_tag}\n".encode())
            except OSError:
                os.close(fd)
                return False
            self._lock_fd = fd
        self._count("leader_elections", 1)
        log.info("this daemon now evicts for namespace %s", self.namespace)
        return True

    def release_lead(self) -> None:
        with self._lead_lock:
            self._release_lead()

    def _release_lead(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing drops the flock

    def evict(self, need_bytes: int, reason: str) -> int:
        """Delete least recently used, unpinned records until ``need_bytes`` are freed or none
        are left. Returns bytes freed."""
        freed = 0
        while freed < need_bytes:
            victim = self.index.take_victim()
            if victim is None:
                break
            name, size = victim
            try:
                if self._remove_record(name):
                    self._count(f"evicted_{reason}", 1)
                freed += size  # a file already gone (another writer's delete) frees its bytes too
            except OSError as exc:
                log.warning("cannot evict %s: %s; setting it aside", self._location(name), exc)
                self._count("eviction_failures", 1)
                self.index.mark_stuck(name, size)
        return freed

    def maintain(self, now: float | None = None) -> None:
        """One background pass: claim leadership if free; as leader (or, with KV events on, as
        any daemon) refresh the index when it is due; as leader evict down to the watermarks."""
        if not self.scan_complete.is_set():
            return
        leading = self.try_lead()
        now = time.monotonic() if now is None else now
        interval = self.backend.rescan_interval_s
        # The evicting daemon rescans to count what others wrote; with KV events on, every
        # daemon does, to announce what others wrote or removed.
        if (leading or self.events.enabled) and interval and now - self._last_rescan >= interval:
            self._rescan()
            self._last_rescan = now
        if not leading:
            return
        cap = self.capacity
        if cap.max_bytes and self.index.bytes > cap.high * cap.max_bytes:
            self.evict(self.index.bytes - int(cap.low * cap.max_bytes), "capacity")
        if cap.min_free_bytes:
            try:
                free = self.disk.free_bytes(self.dir)
            except OSError:
                return
            if free < cap.min_free_bytes:
                self.evict(cap.min_free_bytes - free + max(self.index.bytes // 20, self.file_bytes), "min_free")

    def _rescan(self) -> None:
        """See what other writers sharing the directory added and removed."""
        found = list(self._list_records())
        self._learn_keys(found)
        self.index.replace_all(found)

    def free_bytes(self) -> int | None:
        try:
            return self.disk.free_bytes(self.dir)
        except OSError:
            return None

    # -- start-up scan ------------------------------------------------------------------------------

    def scan(self) -> int:
        """Index every record in the directory and reclaim dead writers' temp files. Safe to
        run while serving: ``contains`` falls back to the directory meanwhile. A store closed
        before or during the scan stops it (its index is of no use any more) and never leads.
        Returns how many records it found."""
        if self._closed:
            return 0
        started = time.monotonic()
        self._count("temp_reclaimed", reclaim_temp_files(self.tmp_dir, self.backend.instance, self.disk))
        found = list(self._list_records(stop_if_closed=True))
        if self._closed:
            return len(found)
        self._learn_keys(found)
        self.index.merge_scanned(found)
        self.scan_seconds = time.monotonic() - started
        self._last_rescan = time.monotonic()
        self.scan_complete.set()
        self.try_lead()  # a daemon alone on its directory evicts from the first write on
        return len(found)

    def _list_records(self, stop_if_closed: bool = False) -> Iterator[tuple[str, int, int]]:
        """``(name, size, mtime_ns)`` of every record file; counts progress as it goes. With
        ``stop_if_closed`` (the start-up scan) it ends early once the store is closed."""
        with self._counter_lock:
            self.counters["scan_records"] = 0
        for name, size, mtime_ns in scan_record_files(self.dir):
            if stop_if_closed and self._closed:
                return
            self._count("scan_records", 1)
            yield name, size, mtime_ns

    def _record_paths(self) -> Iterator[str]:
        for name, _, _ in self._list_records():
            yield self._path(name)

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += n

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.usage())
        out.update({"leader": self.is_leader, "scan_complete": self.scan_complete.is_set(),
                    "scan_seconds": round(self.scan_seconds, 3), "stuck": self.index.stuck,
                    "unreachable": self.index.unreachable(),
                    "max_bytes": self.capacity.max_bytes, "min_free_bytes": self.capacity.min_free_bytes,
                    "direct_io": self.disk.direct})
        out.update(self.counters)
        return out


def _member_of(keys: Sequence[str], present: Container[str]) -> Callable[[int], bool]:
    """Whether ``keys[i]`` is in ``present``, as a function of ``i``."""
    return lambda i: keys[i] in present


def _aligned(nbytes: int) -> memoryview:
    return aligned_empty(nbytes).data
