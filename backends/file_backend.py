"""The file tier's backend: the directory under ``FILE_BACKEND_STORAGE_DIR``, its disk and fsync
settings, its capacity, and which layout its namespaces' stores use (:data:`FILE_LAYOUTS`).

It lives apart from the stores so that both layouts can build on :mod:`.file_store` (the slab
store subclasses the file store) while this module picks between them.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
from typing import Any, Final

from .base import Backend
from .disk import DIRECT_IO_MODES, Disk, make_private_dirs
from .file_store import Capacity, FileStore
from .slab_store import SlabStore

__all__ = ["FILE_LAYOUTS", "Capacity", "FileBackend"]

log = logging.getLogger(__name__)

#: "slab": records in slots of files kept open (slab_store.py); "files": one file per record
#: (file_store.py; the layout before slabs).
FILE_LAYOUTS: Final = ("slab", "files")


class FileBackend(Backend):
    tier = "file"

    def __init__(self, root: str, fsync: str = "none", disk: Disk | None = None, capacity: Capacity | None = None,
                 direct_io: str = "off", rescan_interval_s: float = 0.0, eviction: str = "chain",
                 layout: str = "files") -> None:
        if direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {DIRECT_IO_MODES}")
        if layout not in FILE_LAYOUTS:
            raise ValueError(f"layout must be one of {FILE_LAYOUTS}")
        #: "slab" (records in slots of files kept open, slab_store.py) or "files" (one file per
        #: record, this module; the layout before slabs).
        self.layout = layout
        self.root = os.path.abspath(root)
        self.disk = disk or Disk(fsync)
        self.capacity = capacity or Capacity()
        self.direct_io = direct_io
        #: How often the evicting daemon re-lists the directory to see other writers' records
        #: (0: only at start-up; set it when the directory is shared).
        self.rescan_interval_s = rescan_interval_s
        #: Eviction order (:data:`.chains.POLICIES`); "lru" only to measure against.
        self.eviction = eviction
        # Temp names carry host, pid and a per-process token, so writers sharing a directory
        # never collide and a restart can tell its predecessor's leftovers (same pid is common
        # in containers) from a live neighbour's.
        self.instance = secrets.token_hex(4)
        self._writer_tag = f"{socket.gethostname()}.{os.getpid()}.{self.instance}"

    def check_writable(self) -> None:
        """Create the root (0700), prove we can write in it, and settle O_DIRECT; raises
        ``OSError``."""
        make_private_dirs(self.root)
        probe = os.path.join(self.root, f".probe.{self._writer_tag}.{secrets.token_hex(4)}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
        if self.direct_io != "off":
            works = Disk.probe_direct(self.root)
            if self.direct_io == "on" and not works:
                raise OSError(errno.EINVAL, "O_DIRECT is not supported here (--direct-io on)")
            self.disk.direct = works
            log.info("direct I/O %s in %s", "on" if works else "unavailable, using buffered I/O", self.root)

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> "FileStore":
        if self.layout == "slab":
            return SlabStore(self, namespace, description, record_bytes)
        return FileStore(self, namespace, description, record_bytes)
