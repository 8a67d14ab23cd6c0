"""POSIX shared-memory segments, mode 0600, without Python's resource tracker.

Both sides use them: the engine creates its cache's segment (``HostKVCache``, the vLLM
connector's CPU cache) and the daemon attaches to it.

``multiprocessing.shared_memory`` registers every segment it *attaches* with a resource
tracker that unlinks it when the attaching process exits (Python < 3.13), which would let the
daemon destroy an engine's cache on shutdown. This module opens segments directly instead.

The daemon opens an engine's segment by descriptor (``attach(name, mapped=False)``); its mover
then either maps it and copies inside a fault guard, or copies with ``preadv``/``pwritev`` on
the descriptor, so a segment that its engine truncates is a typed error, never the daemon's
death by SIGBUS (daemon/movers/segment.py).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from typing import Final

import _posixshmem  # the same primitive multiprocessing.shared_memory uses

from .errors import InvalidLayout

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def check_name(name: object) -> str:
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None or name.startswith("."):
        raise InvalidLayout("shared-memory name must match [A-Za-z0-9_.-]{1,200}", name=str(name)[:64])
    return name


class SharedSegment:
    """One mapped segment. ``buffer`` is a writable memoryview of the whole mapping."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap | None, owner: bool, fd: int = -1) -> None:
        self.name = name
        #: The size when opened; :meth:`current_size` asks again.
        self.size = size
        self._mmap: mmap.mmap | None = mapping
        self.owner = owner
        #: The open descriptor of an unmapped attach (else -1).
        self.fd = fd

    @classmethod
    def create(cls, size: int, prefix: str = "kvswap") -> "SharedSegment":
        if size <= 0:
            raise ValueError("segment size must be positive")
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        return cls(name, size, mapping, owner=True)

    @classmethod
    def attach(cls, name: str, mapped: bool = True) -> "SharedSegment":
        """Open an existing segment read-write: mapped (``buffer``), or with ``mapped=False``
        only its descriptor (``fd``), for ``preadv``/``pwritev``. Raises
        :class:`InvalidLayout` if it is missing or empty; the caller checks its size against
        what it needs."""
        check_name(name)
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except OSError as exc:
            raise InvalidLayout(f"cannot open shared memory {name!r}: {exc.strerror}", name=name) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise InvalidLayout(f"shared memory {name!r} is empty", name=name)
            if not mapped:
                return cls(name, size, None, owner=False, fd=fd)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return cls(name, size, mapping, owner=False)

    def current_size(self) -> int:
        """The segment's size now (an unmapped attach asks the kernel: the engine may have
        resized it since)."""
        if self.fd >= 0:
            return os.fstat(self.fd).st_size
        return self.size

    @property
    def buffer(self) -> memoryview:
        if self._mmap is None:
            raise ValueError(f"segment {self.name} is closed")
        return memoryview(self._mmap)

    @property
    def closed(self) -> bool:
        return self._mmap is None and self.fd < 0

    def close(self) -> bool:
        """Unmap (or close the descriptor). Returns False when views into the mapping are still
        alive (the mapping then goes away with the last of them)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        if self._mmap is None:
            return True
        try:
            self._mmap.close()
        except BufferError:
            return False
        finally:
            self._mmap = None
        return True

    def unlink(self) -> None:
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
