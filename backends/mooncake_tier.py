"""The remote tier on Mooncake Store, through ``mooncake.store.MooncakeDistributedStore``.

Mooncake Store is a pool of memory segments that clients contribute, with one master holding
the object map. The daemon is one client: it contributes ``segment`` bytes (0 by default: the
pool is served by other clients such as ``mooncake_client``) and moves records with the
zero-copy batch calls, ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``,
from and into *registered* memory:

- each namespace owns a registered arena of ``slots`` record-sized slots; a record's header is
  written into a slot and its payload comes from the caller's buffer when that buffer lies in
  memory registered with :meth:`MooncakeBackend.register_buffer` (the daemon's staging pool),
  else it is copied into the slot first;
- reads land the header in the slot and the payload straight in the caller's buffer (or the
  slot, then copied), and are verified like a record file.

One object = one record (header + payload) under ``kvswap/<namespace>/<key>``. Mooncake keeps
the first copy of a key (a put of an existing key is a no-op), which is right for keys that are
hashes of their content; a record that fails verification is force-removed and reported
``corrupt``, so the next put stores a good copy.

Health: Mooncake's client retries and waits internally (a call against a hung master waits for
its RPC timeout). The backend sets that timeout from the URL (``MC_RPC_TIMEOUT_MS``, only where
the environment does not already set it), checks the master's port with a plain TCP connect
before ``setup`` (so a dead master costs a refused connect, not Mooncake's minutes of setup
retries), and sends every failure through the shared :class:`~kvswap.backends.remote_base.HealthGate`.
The client re-registers with a restarted master by itself; the master's object map does not
survive a restart, so records stored before it are misses afterwards.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import socket
import threading
import time
from typing import Any, Callable, Final, Iterable, Sequence, TypeVar

import numpy as np

from kvswap.protocol.errors import Corrupt, IOFailure, KvswapError, NoSpace

from . import record
from .base import Backend, GetStatus
from .remote_base import GatedHealth, HealthGate, RemoteStoreBase
from .remote_url import MooncakeSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

# Mooncake's ErrorCode values (mooncake-store/include/types.h); Python gets them as ints.
NO_AVAILABLE_HANDLE: Final = -200
INVALID_PARAMS: Final = -600
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705
TRANSFER_FAIL: Final = -800
RPC_FAIL: Final = -900
RPC_TIMEOUT: Final = -901
UNAVAILABLE_IN_CURRENT_STATUS: Final = -1010
TENANT_QUOTA_EXCEEDED: Final = -1700
CODE_NAMES: Final = {
    -1: "INTERNAL_ERROR", NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE", INVALID_PARAMS: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY", OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", TRANSFER_FAIL: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT", UNAVAILABLE_IN_CURRENT_STATUS: "UNAVAILABLE_IN_CURRENT_STATUS",
    TENANT_QUOTA_EXCEEDED: "TENANT_QUOTA_EXCEEDED",
}
#: Codes that mean the master (or the path to it) is gone, not that one object is.
_UNREACHABLE_CODES: Final = frozenset({RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_STATUS, -1011})
_NO_SPACE_CODES: Final = frozenset({NO_AVAILABLE_HANDLE, TENANT_QUOTA_EXCEEDED})

_import_error: str | None = None


def mooncake_import_error() -> str:
    """Why ``mooncake.store`` cannot be imported here ("" if it can). The usual reason on a
    bare machine is the missing ``libibverbs.so.1`` (Debian: ``libibverbs1``), which the
    client links even for TCP."""
    global _import_error
    if _import_error is None:
        try:
            import mooncake.store  # noqa: F401  (the import is the check)
            _import_error = ""
        except ImportError as exc:
            _import_error = str(exc) or type(exc).__name__
    return _import_error


def code_name(code: int) -> str:
    return f"{CODE_NAMES.get(code, 'error')} ({code})"


def buffer_address(view: memoryview | bytes | bytearray | np.ndarray) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _local_address_towards(host: str, port: int) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class MooncakeBackend(GatedHealth, Backend):
    """``mooncake://``. Connects (``setup``) on first use or :meth:`probe`."""

    tier = "remote"

    def __init__(self, spec: MooncakeSpec, *, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.url = spec.redacted()
        self.master = f"{spec.master_host}:{spec.master_port}"
        self.local_host = spec.local_host or _local_address_towards(spec.master_host, spec.master_port)
        self.gate = HealthGate(self.url, self._reach, backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
                               clock=clock)
        self._client: Any = None
        self._set_up = False
        self._lock = threading.Lock()
        # (address, size, owner) of memory registered (or to register once set up) with the client.
        self._regions: list[tuple[int, int, Any]] = []
        self._registered: set[int] = set()
        # A key no one stores: asking for it makes the master answer (a cached hit cannot).
        self._probe_key = f"kvswap/.probe/{secrets.token_hex(8)}"

    # -- health ---------------------------------------------------------------------------------

    def probe(self) -> bool:
        """Probe the master now (see :meth:`HealthGate.probe`); returns ``healthy``."""
        return self.gate.probe()

    def _reach(self) -> None:
        # A refused or silent port fails here within connect_timeout, before Mooncake's own
        # (much longer) connect retries get a chance to block this thread.
        with socket.create_connection((self.spec.master_host, self.spec.master_port), self.spec.connect_timeout):
            pass
        with self._lock:
            if not self._set_up:
                self._setup()
            client = self._client
        found = client.batch_is_exist([self._probe_key])
        if not found or found[0] < 0:
            raise IOFailure(f"master {self.master} did not answer an existence query", code=found[0] if found else None)
        self._register_pending()

    def _setup(self) -> None:
        s = self.spec
        # Mooncake reads these once, from the environment; an operator's own values win.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(int(s.timeout * 1000)))
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(int(s.connect_timeout * 1000)))
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        from mooncake.store import MooncakeDistributedStore

        if self._client is None:
            self._client = MooncakeDistributedStore()
        rc = self._client.setup(self.local_host, s.metadata, s.segment, s.buffer, s.protocol, s.device, self.master)
        if rc != 0:
            raise IOFailure(f"Mooncake setup against {self.master} failed", code=rc)
        self._set_up = True
        if s.segment == 0:
            log.info("mooncake tier %s: this daemon contributes no memory (segment=0); the pool's other clients "
                     "hold the records", self.url)

    # -- registered memory ----------------------------------------------------------------------

    def register_buffer(self, buf: memoryview | bytearray | np.ndarray) -> None:
        """Register memory the caller keeps alive (the daemon's staging pool), so records whose
        payload lies in it move without a copy. Registered now if connected, else on connect."""
        view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
        if not view.c_contiguous:
            raise ValueError("only contiguous buffers can be registered")
        with self._lock:
            self._regions.append((buffer_address(view), view.nbytes, buf))
        if self._set_up:
            self._register_pending()

    def unregister_buffer(self, buf: memoryview | bytearray | np.ndarray) -> None:
        addr = buffer_address(buf.data if isinstance(buf, np.ndarray) else memoryview(buf))
        with self._lock:
            self._regions = [r for r in self._regions if r[0] != addr]
            was_registered = addr in self._registered
            self._registered.discard(addr)
            client = self._client
        if was_registered and client is not None:
            client.unregister_buffer(addr)

    def registered_address(self, view: memoryview) -> int | None:
        """The address of ``view`` if all of it lies in registered memory, else None."""
        if not view.c_contiguous or not len(view):
            return None
        addr = buffer_address(view)
        end = addr + view.nbytes
        for start, size, _ in self._regions:
            if start <= addr and end <= start + size and start in self._registered:
                return addr
        return None

    def _register_pending(self) -> None:
        with self._lock:
            client = self._client
            pending = [(a, n) for a, n, _ in self._regions if a not in self._registered]
            for addr, size in pending:
                rc = client.register_buffer(addr, size)
                if rc != 0:
                    raise IOFailure("Mooncake refused to register a buffer", code=rc, size=size)
                self._registered.add(addr)

    # -- calls ----------------------------------------------------------------------------------

    def call(self, op: Callable[[Any], T]) -> T:
        """Run ``op(client)`` behind the health gate. Mooncake reports through return codes;
        callers pass those to :meth:`raise_for`."""
        self.gate.admit()
        client = self._client
        try:
            return op(client)
        except KvswapError:
            raise
        except Exception as exc:  # the binding raises only on bad arguments
            raise IOFailure(f"Mooncake call failed: {exc}", tier="remote") from None

    def raise_for(self, code: int, action: str, key: str = "") -> None:
        """Raise the kvswap error for a negative Mooncake code."""
        if code in _UNREACHABLE_CODES:
            raise self.gate.failed(f"{action}: {code_name(code)}")
        if code in _NO_SPACE_CODES:
            raise NoSpace(f"Mooncake pool has no room to {action}: {code_name(code)} (mount more segments, or give "
                          f"this daemon one with segment=SIZE)", tier="remote", key=key)
        raise IOFailure(f"Mooncake could not {action}: {code_name(code)}", tier="remote", key=key, code=code)

    # -- Backend --------------------------------------------------------------------------------

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> "MooncakeStore":
        return MooncakeStore(self, namespace, record_bytes)

    def close(self) -> None:
        """Unregister memory and leave the pool. With the master gone, Mooncake's client spends
        its RPC timeouts trying to unmount its segment before it returns."""
        with self._lock:
            client, self._client, self._set_up = self._client, None, False
            registered, self._registered = self._registered, set()
        if client is None:
            return
        for addr in registered:
            client.unregister_buffer(addr)
        client.close()


class MooncakeStore(RemoteStoreBase):
    """Records of one namespace in Mooncake Store. ``direct_puts`` / ``direct_gets`` count the
    records that moved without a copy (their buffer was registered)."""

    def __init__(self, backend: MooncakeBackend, namespace: str, record_bytes: int) -> None:
        super().__init__(backend.gate, namespace, record_bytes)
        self.backend = backend
        self.slots = backend.spec.slots
        # Registered staging: slot i is arena[i*stored_bytes : (i+1)*stored_bytes].
        self._arena = np.zeros(self.slots * self.stored_bytes, dtype=np.uint8)
        self._arena_addr = buffer_address(self._arena)
        self.direct_puts = 0
        self.direct_gets = 0
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(self.slots):
            self._free.put(i)
        backend.register_buffer(self._arena)

    # -- slots ----------------------------------------------------------------------------------

    def _take(self, wanted: int) -> list[int]:
        """One slot (waiting for it), then as many more as are free now, up to ``wanted``. A
        thread never waits while it holds a slot, so two batches cannot deadlock."""
        slots = [self._free.get()]
        while len(slots) < wanted:
            try:
                slots.append(self._free.get_nowait())
            except queue.Empty:
                break
        return slots

    def _give(self, slots: list[int]) -> None:
        for i in slots:
            self._free.put(i)

    def _slot(self, i: int) -> memoryview:
        return self._arena.data[i * self.stored_bytes:(i + 1) * self.stored_bytes]

    def _slot_addr(self, i: int) -> int:
        return self._arena_addr + i * self.stored_bytes

    # -- Store ----------------------------------------------------------------------------------

    def put(self, key: str, payload: memoryview) -> int:
        return self.put_many([(key, payload)])[0]

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        return self.get_many([key], [out])[0]

    def put_many(self, items: Iterable[tuple[str, memoryview]]) -> list[int]:
        items = list(items)
        hl = self.header_len
        done = 0
        while done < len(items):
            slots = self._take(len(items) - done)
            batch = items[done:done + len(slots)]
            try:
                keys, ptrs, sizes = [], [], []
                for slot, (key, payload) in zip(slots, batch):
                    payload = memoryview(payload).cast("B")
                    view, base = self._slot(slot), self._slot_addr(slot)
                    view[:hl] = self.header_for(key, payload)
                    direct = self.backend.registered_address(payload)
                    if direct is None:  # not registered memory: copy it next to the header
                        view[hl:] = payload
                        ptrs.append([base])
                        sizes.append([self.stored_bytes])
                    else:
                        ptrs.append([base, direct])
                        sizes.append([hl, len(payload)])
                    keys.append(self.rkey(key))
                codes = self.backend.call(lambda c: c.batch_put_from_multi_buffers(keys, ptrs, sizes))
            finally:
                self._give(slots)
            stored = [key for (key, _), code in zip(batch, codes) if code == 0 or code == OBJECT_ALREADY_EXISTS]
            self._remember(stored)
            self.direct_puts += sum(1 for p in ptrs if len(p) == 2)
            for (key, _), code in zip(batch, codes):
                if code != 0 and code != OBJECT_ALREADY_EXISTS:
                    self.backend.raise_for(code, "store a record", key)
            done += len(batch)
        return [self.stored_bytes] * len(items)

    def get_many(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[GetStatus]:
        hl = self.header_len
        statuses: list[GetStatus] = []
        done = 0
        while done < len(keys):
            slots = self._take(len(keys) - done)
            batch = list(zip(keys[done:done + len(slots)], outs[done:done + len(slots)]))
            try:
                ptrs, sizes, direct = [], [], []
                for slot, (key, out) in zip(slots, batch):
                    if len(out) != self.record_bytes:
                        raise ValueError(f"buffer of {len(out)} bytes, the namespace stores {self.record_bytes}")
                    base = self._slot_addr(slot)
                    addr = self.backend.registered_address(out)
                    direct.append(addr is not None)
                    if addr is None:
                        ptrs.append([base])
                        sizes.append([self.stored_bytes])
                    else:
                        ptrs.append([base, addr])
                        sizes.append([hl, self.record_bytes])
                rkeys = [self.rkey(key) for key, _ in batch]
                codes = self.backend.call(lambda c: c.batch_get_into_multi_buffers(rkeys, ptrs, sizes))
                for slot, (key, out), code, zero_copy in zip(slots, batch, codes, direct):
                    statuses.append(self._finish_get(key, out, slot, code, zero_copy))
            finally:
                self._give(slots)
            done += len(batch)
        return statuses

    def _finish_get(self, key: str, out: memoryview, slot: int, code: int, zero_copy: bool) -> GetStatus:
        if code == OBJECT_NOT_FOUND:
            self._forget((key,))
            return GetStatus.MISS
        if code in (INVALID_PARAMS, TRANSFER_FAIL):
            # The stored object is longer (INVALID_PARAMS) or shorter (TRANSFER_FAIL) than our
            # buffers, or a transfer failed: its size tells which.
            size = self.backend.call(lambda c: c.get_size(self.rkey(key)))
            if size == OBJECT_NOT_FOUND:
                self._forget((key,))
                return GetStatus.MISS
            if size >= 0 and size != self.stored_bytes:
                self._drop_corrupt(key, Corrupt("record has the wrong size", size=size, expected=self.stored_bytes))
                return GetStatus.CORRUPT
        if code < 0:
            self.backend.raise_for(code, "read a record", key)
        view = self._slot(slot)
        payload = out if zero_copy else view[self.header_len:]
        try:
            if code != self.stored_bytes:
                raise Corrupt("record has the wrong size", size=code, expected=self.stored_bytes)
            header = record.decode_header(view[:self.header_len])
            record.verify(header, self.namespace_bytes, key, payload)
        except Corrupt as exc:
            self._drop_corrupt(key, exc)
            return GetStatus.CORRUPT
        if zero_copy:
            self.direct_gets += 1
        else:
            out[:] = payload
        self._remember((key,))
        return GetStatus.LOADED

    def contains(self, key: str) -> bool:
        code = self.backend.call(lambda c: c.is_exist(self.rkey(key)))
        if code < 0:
            self.backend.raise_for(code, "look a record up", key)
        return code == 1

    def contains_prefix(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        found = self.backend.call(lambda c: c.batch_is_exist([self.rkey(k) for k in keys]))
        for i, code in enumerate(found):
            if code < 0:
                # batch_is_exist reports any failure as -1; the master being gone is the usual one.
                raise self.backend.gate.failed("existence query failed")
            if code != 1:
                return i
        return len(keys)

    def delete(self, key: str) -> bool:
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        # force: a reader's lease (10 s after any read) would otherwise refuse the removal.
        codes = self.backend.call(lambda c: c.batch_remove([self.rkey(k) for k in keys], True))
        self._forget(keys)
        for key, code in zip(keys, codes):
            if code < 0 and code != OBJECT_NOT_FOUND:
                self.backend.raise_for(code, "remove a record", key)
        return sum(1 for code in codes if code == 0)

    def clear(self) -> int:
        pattern = "^" + re.escape(self.prefix)
        removed = self.backend.call(lambda c: c.remove_by_regex(pattern, True))
        if removed < 0:
            self.backend.raise_for(removed, "clear the namespace")
        self._forget_all()
        return removed

    def close(self) -> None:
        self.backend.unregister_buffer(self._arena)
