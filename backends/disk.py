"""The file-system seam: every system call that touches record files goes through ``Disk``.

Tests inject faults by patching one of its methods (ENOSPC on write, EIO on read, a slow
disk). Nothing above this class calls ``os`` on record files.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import stat
from typing import Final, Sequence

import numpy as np

from kvswap.common.units import PAGE_BYTES
from kvswap.protocol.errors import Corrupt

FSYNC_MODES: Final = ("none", "data", "strict")
DIRECT_IO_MODES: Final = ("auto", "on", "off")
_O_DIRECT: Final = getattr(os, "O_DIRECT", 0)


def aligned_empty(nbytes: int, align: int = PAGE_BYTES) -> np.ndarray:
    """An uninitialised uint8 array whose first byte is ``align``-aligned (O_DIRECT buffers,
    staging slots)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


def listdir_or_empty(path: str) -> list[str]:
    """Entries of ``path``; a directory that is gone (or never was) has none."""
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def try_flock(path: str) -> int | None:
    """Open ``path`` (0600) and take an exclusive flock without waiting. Returns the file
    descriptor that holds the lock (closing it releases the lock), or None if another holder
    has it or the file cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _address(part: memoryview | bytes | bytearray) -> int:
    """Where a buffer starts. It runs twice per record I/O, so the common case (a writable
    buffer: staging slots, header buffers) takes the cheap ctypes path (~0.3 us, against
    ~1.7 us through numpy, with the GIL held)."""
    if not len(part):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(part))
    except (TypeError, ValueError):  # read-only (bytes) or not contiguous
        return np.frombuffer(part, dtype=np.uint8).ctypes.data


def direct_compatible(parts: Sequence[memoryview | bytes | bytearray]) -> bool:
    """O_DIRECT needs buffer addresses, lengths and file offsets aligned to the device's
    logical block; a page is right for every device we meet (512 B devices accept it too)."""
    return all(len(p) % PAGE_BYTES == 0 and _address(p) % PAGE_BYTES == 0 for p in parts)


def _rest_after(parts: Sequence[memoryview | bytes | bytearray], n: int) -> list[memoryview]:
    """The parts left after the first ``n`` bytes were transferred."""
    rest = []
    for part in parts:
        view = memoryview(part).cast("B")
        if n >= len(view):
            n -= len(view)
            continue
        rest.append(view[n:])
        n = 0
    return rest


class Disk:
    def __init__(self, fsync: str = "none", direct: bool = False) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}")
        self.fsync = fsync
        #: Use O_DIRECT for records whose buffers allow it (the store decides per record).
        self.direct = direct and bool(_O_DIRECT)

    # -- records ----------------------------------------------------------------------------------

    def write_file(self, tmp: str, final: str, parts: list[memoryview | bytes], mtime_ns: int | None = None) -> int:
        """Write ``parts`` to ``tmp`` (created exclusively, 0600), then rename it onto ``final``.
        With ``mtime_ns``, the file gets that mtime (the record's recency) before the rename.
        Returns bytes written. On any failure the temp file is gone."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self.direct and direct_compatible(parts):
            flags |= _O_DIRECT
        fd = os.open(tmp, flags, 0o600)
        try:
            total = sum(len(p) for p in parts)
            written = os.writev(fd, parts)
            while written < total:  # short writes happen on signals and some file systems
                step = os.writev(fd, _rest_after(parts, written))
                if step <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                written += step
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
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
        """Read into ``parts`` from offset 0. Returns (bytes read, file size); fewer bytes than
        asked only at end of file."""
        # O_NOFOLLOW and O_NONBLOCK: a symlink planted in the store must not redirect a read,
        # and a FIFO must not block a read thread forever. Only regular files are records.
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        if self.direct and direct_compatible(parts):
            flags |= _O_DIRECT
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Corrupt("a symlink where a record should be") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Corrupt("not a regular file where a record should be")
            size = st.st_size
            want = sum(len(p) for p in parts)
            done = os.preadv(fd, parts, 0)
            while 0 < done < want and done < size:  # a short read is not the end of the file
                step = os.preadv(fd, _rest_after(parts, done), done)
                if step <= 0:
                    break
                done += step
            return done, size
        finally:
            os.close(fd)

    # -- slabs: records at fixed offsets in files kept open (slab_store.py) ------------------------

    def open_slab(self, path: str, writable: bool) -> tuple[int, int | None]:
        """Open a slab file (created 0600 when ``writable``): a buffered descriptor and, where
        direct I/O is on, an O_DIRECT one for aligned transfers (None otherwise)."""
        flags = (os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise Corrupt("not a regular file where a slab should be")
        direct = None
        if self.direct:
            try:
                direct = os.open(path, (flags & ~os.O_CREAT) | _O_DIRECT)
            except OSError:
                direct = None
        return fd, direct

    def grow(self, fd: int, size: int) -> None:
        """Make a slab file ``size`` bytes long with its blocks allocated now, so a full disk
        shows up here and never halfway through a record."""
        os.posix_fallocate(fd, 0, size)

    def write_at(self, fd: int, direct_fd: int | None, parts: list[memoryview | bytes], offset: int) -> int:
        """Write ``parts`` at ``offset``; O_DIRECT where the buffers allow it. ``fsync`` other
        than none makes the bytes durable before it returns. Returns bytes written."""
        use = direct_fd if direct_fd is not None and direct_compatible(parts) else fd
        total = sum(len(p) for p in parts)
        written = os.pwritev(use, parts, offset)
        while written < total:
            step = os.pwritev(use, _rest_after(parts, written), offset + written)
            if step <= 0:
                raise OSError(errno.EIO, "write made no progress")
            written += step
        if self.fsync != "none":
            os.fdatasync(use)
        return total

    def read_at(self, fd: int, direct_fd: int | None, parts: list[memoryview | bytearray], offset: int) -> int:
        """Read into ``parts`` from ``offset``; returns bytes read (fewer only at end of file)."""
        use = direct_fd if direct_fd is not None and direct_compatible(parts) else fd
        want = sum(len(p) for p in parts)
        done = os.preadv(use, parts, offset)
        while 0 < done < want:
            step = os.preadv(use, _rest_after(parts, done), offset + done)
            if step <= 0:
                break
            done += step
        return done

    def append(self, fd: int, data: bytes, durable: bool) -> None:
        """Append journal entries (``fd`` is O_APPEND); ``durable`` syncs them."""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fdatasync(fd)

    def read_from(self, fd: int, offset: int) -> bytes:
        """Everything in ``fd`` from ``offset`` to its end."""
        chunks: list[bytes] = []
        while True:
            chunk = os.pread(fd, 1 << 24, offset)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            offset += len(chunk)

    def touch(self, path: str, mtime_ns: int | None = None) -> None:
        """Mark a record as used (its mtime: now, or the recency stamp given), so recency
        survives a restart."""
        if mtime_ns is None:
            os.utime(path)
        else:
            os.utime(path, ns=(mtime_ns, mtime_ns))

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

    def free_bytes(self, path: str) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    # -- probing ----------------------------------------------------------------------------------

    @staticmethod
    def probe_direct(directory: str) -> bool:
        """Whether O_DIRECT writes and reads work in ``directory`` (tmpfs and some network file
        systems refuse them)."""
        if not _O_DIRECT:
            return False
        path = os.path.join(directory, f".direct-probe.{os.getpid()}.{secrets.token_hex(4)}")
        block = aligned_empty(PAGE_BYTES)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            return os.pwritev(fd, [block.data], 0) == PAGE_BYTES and os.preadv(fd, [block.data], 0) == PAGE_BYTES
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(path)


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
