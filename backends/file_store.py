"""The file tier: one record per file under ``<root>/<namespace>/``.

Layout of a namespace directory::

    <root>/<namespace>/namespace.json     what the fingerprint stands for (model, dtype, ...)
    <root>/<namespace>/ab/cd/<name>.kvr   records; <name> = xxh3-128 hex of the key
    <root>/<namespace>/tmp/               records being written

A key never becomes a path: the file name is a hash of it, and the key itself is kept in the
record header, so two keys whose names collide are told apart on read. Records are written to
a unique temp file and renamed into place, so a reader (or a restart after SIGKILL) sees
either the whole record or none. Files are 0600, directories 0700.

``Disk`` holds every system call that touches record files; tests inject faults by patching
one of its methods.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import threading
from typing import Any, Final

import xxhash

from kvswap.protocol.errors import Corrupt, IOFailure, NoSpace

from . import record
from .base import Backend, GetStatus, Store

log = logging.getLogger(__name__)

RECORD_SUFFIX: Final = ".kvr"
TMP_SUFFIX: Final = ".tmp"
FSYNC_MODES: Final = ("none", "data", "strict")
_SPACE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


def record_name(key: str) -> str:
    return xxhash.xxh3_128_hexdigest(key.encode())


def _io_error(exc: OSError, action: str, path: str) -> Exception:
    if exc.errno in _SPACE_ERRNOS:
        return NoSpace(f"no space left to {action}", path=path)
    return IOFailure(f"cannot {action}: {exc.strerror or exc}", path=path, errno=exc.errno or 0)


class Disk:
    """The file-system seam: every system call on record files goes through here."""

    def __init__(self, fsync: str = "none") -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}")
        self.fsync = fsync

    def write_file(self, tmp: str, final: str, parts: list[memoryview | bytes]) -> int:
        """Write ``parts`` to ``tmp``, then rename it onto ``final``. Returns bytes written."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            total = sum(len(p) for p in parts)
            written = os.writev(fd, parts)
            while written < total:  # short writes happen on signals and some file systems
                rest = _skip(parts, written)
                written += os.writev(fd, rest)
            if self.fsync != "none":
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            self.remove(tmp)
            raise
        os.close(fd)
        try:
            os.rename(tmp, final)
        except BaseException:
            self.remove(tmp)
            raise
        if self.fsync == "strict":
            self.sync_dir(os.path.dirname(final))
        return total

    def read_file(self, path: str, parts: list[memoryview | bytearray]) -> tuple[int, int]:
        """Read into ``parts`` from offset 0. Returns (bytes read, file size)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            return os.preadv(fd, parts, 0), size
        finally:
            os.close(fd)

    def remove(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def make_dirs(self, path: str) -> None:
        make_private_dirs(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _skip(parts: list[memoryview | bytes], n: int) -> list[memoryview]:
    """The parts left after the first ``n`` bytes were written."""
    rest = []
    for part in parts:
        view = memoryview(part)
        if n >= len(view):
            n -= len(view)
            continue
        rest.append(view[n:])
        n = 0
    return rest


class FileBackend(Backend):
    tier = "file"

    def __init__(self, root: str, fsync: str = "none", disk: Disk | None = None) -> None:
        self.root = os.path.abspath(root)
        self.disk = disk or Disk(fsync)
        # Temp names carry host, pid and a per-process token, so writers sharing a directory
        # never collide and a restart can tell its predecessor's leftovers (same pid is common
        # in containers) from a live neighbour's.
        self.instance = secrets.token_hex(4)
        self._writer_tag = f"{socket.gethostname()}.{os.getpid()}.{self.instance}"

    def check_writable(self) -> None:
        """Create the root (0700) and prove we can write in it; raises ``OSError``."""
        make_private_dirs(self.root)
        probe = os.path.join(self.root, f".probe.{self._writer_tag}.{secrets.token_hex(4)}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> "FileStore":
        return FileStore(self, namespace, description, record_bytes)


class FileStore(Store):
    tier = "file"

    def __init__(self, backend: FileBackend, namespace: str, description: dict[str, Any], record_bytes: int) -> None:
        self.backend = backend
        self.disk = backend.disk
        self.namespace = namespace
        self.namespace_bytes = bytes.fromhex(namespace)
        self.record_bytes = record_bytes
        self.header_len = record.header_len_for(record_bytes)
        self.file_bytes = self.header_len + record_bytes
        self.dir = os.path.join(backend.root, namespace)
        self.tmp_dir = os.path.join(self.dir, "tmp")
        # name -> bytes on disk. A dict is enough for membership; the scan fills it after a
        # restart, and lookups fall back to the directory for names it has not seen.
        self._index: dict[str, int] = {}
        self._lock = threading.Lock()
        self._bytes = 0
        self.scan_complete = threading.Event()
        self._prepare(description)

    # -- layout on disk ---------------------------------------------------------------------

    def _prepare(self, description: dict[str, Any]) -> None:
        self.disk.make_dirs(self.tmp_dir)
        meta_path = os.path.join(self.dir, "namespace.json")
        if not os.path.exists(meta_path):
            body = json.dumps({"namespace": self.namespace, "record_bytes": self.record_bytes,
                               "record_format": record.FORMAT_VERSION, "layout": description},
                              indent=2, sort_keys=True).encode()
            tmp = os.path.join(self.tmp_dir, f"namespace.{self.backend._writer_tag}.{secrets.token_hex(4)}{TMP_SUFFIX}")
            self.disk.write_file(tmp, meta_path, [body])

    def path_of(self, key: str) -> tuple[str, str]:
        name = record_name(key)
        return name, os.path.join(self.dir, name[:2], name[2:4], name + RECORD_SUFFIX)

    def _tmp_path(self, name: str) -> str:
        return os.path.join(self.tmp_dir, f"{name}.{self.backend._writer_tag}.{secrets.token_hex(4)}{TMP_SUFFIX}")

    # -- Store ------------------------------------------------------------------------------

    def put(self, key: str, payload: memoryview) -> int:
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        name, path = self.path_of(key)
        header = record.encode_header(self.namespace_bytes, key, len(payload), record.payload_checksum(payload))
        try:
            self.disk.make_dirs(os.path.dirname(path))
            size = self.disk.write_file(self._tmp_path(name), path, [header, payload])
        except OSError as exc:
            raise _io_error(exc, "write a record", path) from None
        self._remember(name, size)
        return size

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        name, path = self.path_of(key)
        header_buf = bytearray(self.header_len)
        try:
            n, size = self.disk.read_file(path, [header_buf, out])
        except FileNotFoundError:
            self._forget(name)
            return GetStatus.MISS
        except OSError as exc:
            raise _io_error(exc, "read a record", path) from None
        try:
            if n != self.file_bytes or size != self.file_bytes:
                raise Corrupt("record has the wrong size", size=size, expected=self.file_bytes)
            header = record.decode_header(header_buf)
            record.verify(header, self.namespace_bytes, key, out)
        except Corrupt as exc:
            log.warning("corrupt record %s for key %s: %s; removing it", path, key, exc.message)
            self.disk.remove(path)
            self._forget(name)
            return GetStatus.CORRUPT
        self._remember(name, size)
        return GetStatus.LOADED

    def contains(self, key: str) -> bool:
        name, path = self.path_of(key)
        if name in self._index:
            return True
        # Not indexed: the start-up scan may not have reached it, or another daemon sharing
        # the directory wrote it. One stat settles it.
        if self.disk.exists(path):
            self._remember(name, self.file_bytes)
            return True
        return False

    def delete(self, key: str) -> bool:
        name, path = self.path_of(key)
        try:
            removed = self.disk.remove(path)
        except OSError as exc:
            raise _io_error(exc, "delete a record", path) from None
        self._forget(name)
        return removed

    def clear(self) -> int:
        removed = 0
        for path in self._record_paths():
            try:
                removed += self.disk.remove(path)
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc)
        with self._lock:
            self._index.clear()
            self._bytes = 0
        return removed

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"records": len(self._index), "bytes": self._bytes}

    # -- start-up scan ------------------------------------------------------------------------

    def scan(self) -> int:
        """Index every record in the directory and remove this host's dead writers' temp
        files. Safe to run while serving: ``contains`` falls back to the directory meanwhile."""
        self._reclaim_temp_files()
        found = 0
        for path in self._record_paths():
            name = os.path.basename(path)[: -len(RECORD_SUFFIX)]
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            self._remember(name, size)
            found += 1
        self.scan_complete.set()
        return found

    def _record_paths(self):
        for first in _listdir(self.dir):
            if len(first) != 2:
                continue
            level1 = os.path.join(self.dir, first)
            for second in _listdir(level1):
                level2 = os.path.join(level1, second)
                for entry in _listdir(level2):
                    if entry.endswith(RECORD_SUFFIX):
                        yield os.path.join(level2, entry)

    def _reclaim_temp_files(self) -> int:
        """A temp file is garbage once its writer is gone: same host and a dead pid. Temp
        files of live writers (other daemons sharing the directory) are left alone."""
        host, me, instance = socket.gethostname(), os.getpid(), self.backend.instance
        reclaimed = 0
        for entry in _listdir(self.tmp_dir):
            parts = entry.split(".")
            # <name>.<host...>.<pid>.<instance>.<rand>.tmp; host names may contain dots.
            if len(parts) < 6 or not entry.endswith(TMP_SUFFIX) or not parts[-4].isdigit():
                continue
            writer_host, pid, writer_instance = ".".join(parts[1:-4]), int(parts[-4]), parts[-3]
            dead = not _pid_alive(pid) if pid != me else writer_instance != instance
            if writer_host == host and dead:
                reclaimed += self.disk.remove(os.path.join(self.tmp_dir, entry))
        return reclaimed

    # -- index --------------------------------------------------------------------------------

    def _remember(self, name: str, size: int) -> None:
        with self._lock:
            old = self._index.get(name)
            self._index[name] = size
            self._bytes += size - (old or 0)

    def _forget(self, name: str) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            if old is not None:
                self._bytes -= old


def make_private_dirs(path: str) -> None:
    """``os.makedirs`` applies its mode to the leaf only; every level we create is 0700."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        make_private_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
