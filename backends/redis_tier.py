"""The remote tier on Redis (one server or a Redis Cluster), through redis-py.

One record is one Redis string: the record header followed by the payload, exactly the bytes
of a record file, under ``kvswap/<namespace>/<key>``. A read checks header and checksum like
the file tier, and a record that fails is deleted and reported ``corrupt``.

Every socket has a timeout and redis-py's own retries are off: a failure goes to the
:class:`~kvswap.backends.remote_base.HealthGate`, which marks the tier unhealthy, makes later calls
fail fast with ``Unavailable`` and re-probes with ``PING`` after its backoff. Batches of small
records go out as pipelines (one round trip), cut so that one carries at most ``PIPELINE_BYTES``;
records of ``PIPELINE_BYTES`` and more go one command each.

Redis's own eviction (``maxmemory-policy allkeys-lru``) is how the pool makes room; a record
it evicted is a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Final, Iterable, Iterator, Sequence, TypeVar

import redis
import redis.cluster
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvswap.protocol.errors import Corrupt, IOFailure, NoSpace

from . import record
from .base import Backend, GetStatus
from .remote_base import GatedHealth, HealthGate, RemoteStoreBase
from .remote_url import RedisSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Most bytes of values one pipeline carries (each way). Pipelines save round trips, which
#: matters for small records; for records of a MiB and more the link is the limit, and redis-py
#: moved them faster one command at a time (benchmarks/remote_throughput.py: 1 MiB puts 0.96 vs
#: 0.69 GB/s pipelined by 8), so those go one per command.
PIPELINE_BYTES: Final = 1 << 20
#: Keys per EXISTS/UNLINK batch.
KEY_BATCH: Final = 512

#: Errors that mean "could not reach the store", as opposed to the store refusing a command.
_UNREACHABLE: Final = (rex.ConnectionError, rex.TimeoutError, rex.ClusterDownError, rex.SlotNotCoveredError,
                       rex.RedisClusterException, OSError)


class RedisBackend(GatedHealth, Backend):
    """``redis://`` and ``redis+cluster://``. Connects on first use (or :meth:`probe`)."""

    tier = "remote"

    def __init__(self, spec: RedisSpec, *, backoff_initial_s: float = 0.5, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.url = spec.redacted()
        self.gate = HealthGate(self.url, self._reach, backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
                               clock=clock)
        self._client: Any = None
        self._client_lock = threading.Lock()

    # -- health ---------------------------------------------------------------------------------

    def probe(self) -> bool:
        """Probe the server now (see :meth:`HealthGate.probe`); returns ``healthy``."""
        return self.gate.probe()

    def _reach(self) -> None:
        with self._client_lock:
            if self._client is None:
                self._client = self._make_client()
            elif not self.gate.healthy:  # after an outage; a healthy tier's sockets are in use
                if self.spec.cluster:
                    # A cluster client caches the slot map and node connections: learn them afresh.
                    self._close_client()
                    self._client = self._make_client()
                else:
                    # Drop pooled sockets that died with the server, so commands dial anew.
                    self._client.connection_pool.disconnect()
            client = self._client
        client.ping()

    def _make_client(self) -> Any:
        s = self.spec
        common: dict[str, Any] = dict(
            username=s.username, password=s.password, socket_timeout=s.timeout, socket_connect_timeout=s.connect_timeout,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        if s.cluster:
            return redis.cluster.RedisCluster(host=s.host, port=s.port, ssl=s.tls, max_connections=s.max_connections,
                                              require_full_coverage=True, **common)
        connection_class = redis.SSLConnection if s.tls else redis.Connection
        pool = redis.BlockingConnectionPool(host=s.host, port=s.port, db=s.db, max_connections=s.max_connections,
                                            timeout=s.timeout, connection_class=connection_class, **common)
        return redis.Redis(connection_pool=pool)

    def _close_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing sockets of a dead server may fail; nothing to keep
                pass
            self._client = None

    def call(self, op: Callable[[Any], T]) -> T:
        """Run ``op(client)`` behind the health gate, mapping redis-py errors to kvswap's."""
        self.gate.admit()
        client = self._client
        if client is None:  # closed under us
            raise self.gate.failed("client closed")
        try:
            return op(client)
        except rex.OutOfMemoryError as exc:
            raise NoSpace(f"{self.url} is out of memory: {exc}", tier="remote") from None
        except _UNREACHABLE as exc:
            raise self.gate.failed(exc) from None
        except rex.RedisError as exc:
            raise IOFailure(f"{self.url} refused a command: {exc}", tier="remote") from None

    # -- Backend --------------------------------------------------------------------------------

    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> "RedisStore":
        return RedisStore(self, namespace, record_bytes)

    def close(self) -> None:
        with self._client_lock:
            self._close_client()


class RedisStore(RemoteStoreBase):
    """Records of one namespace in Redis."""

    def __init__(self, backend: RedisBackend, namespace: str, record_bytes: int) -> None:
        super().__init__(backend.gate, namespace, record_bytes)
        self.backend = backend

    # -- single records -------------------------------------------------------------------------

    def put(self, key: str, payload: memoryview) -> int:
        value = self.header_for(key, payload) + payload
        self.backend.call(lambda c: c.set(self.rkey(key), value))
        self._remember((key,))
        return len(value)

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        data = self.backend.call(lambda c: c.get(self.rkey(key)))
        return self._load(key, data, out)

    def contains(self, key: str) -> bool:
        return bool(self.backend.call(lambda c: c.exists(self.rkey(key))))

    def delete(self, key: str) -> bool:
        removed = self.backend.call(lambda c: c.delete(self.rkey(key)))
        self._forget((key,))
        return bool(removed)

    def clear(self) -> int:
        """Every key under this namespace's prefix, found with SCAN (on every primary of a
        cluster) and removed with UNLINK, so a large namespace never blocks the server."""
        def op(c: Any) -> int:
            removed = 0
            for batch in _batches(c.scan_iter(match=self.prefix + "*", count=1000), KEY_BATCH):
                removed += c.unlink(*batch)
            return removed
        removed = self.backend.call(op)
        self._forget_all()
        return removed

    # -- batches --------------------------------------------------------------------------------

    def put_many(self, items: Iterable[tuple[str, memoryview]]) -> list[int]:
        step = PIPELINE_BYTES // self.stored_bytes
        if step <= 1:
            return [self.put(key, payload) for key, payload in items]
        sizes: list[int] = []
        for chunk in _batches(items, step):
            values = [(key, self.header_for(key, payload) + payload) for key, payload in chunk]

            self._pipelined("set", [(self.rkey(key), value) for key, value in values])
            self._remember(key for key, _ in values)
            sizes.extend(len(v) for _, v in values)
        return sizes

    def get_many(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[GetStatus]:
        step = PIPELINE_BYTES // self.stored_bytes
        if step <= 1:
            return [self.get_into(key, out) for key, out in zip(keys, outs)]
        statuses: list[GetStatus] = []
        for start in range(0, len(keys), step):
            chunk = keys[start:start + step]
            for i, data in enumerate(self._pipelined("get", [(self.rkey(key),) for key in chunk])):
                statuses.append(self._load(chunk[i], data, outs[start + i]))
        return statuses

    def contains_prefix(self, keys: Sequence[str]) -> int:
        for start in range(0, len(keys), KEY_BATCH):
            chunk = keys[start:start + KEY_BATCH]
            for i, present in enumerate(self._pipelined("exists", [(self.rkey(key),) for key in chunk])):
                if not present:
                    return start + i
        return len(keys)

    def _pipelined(self, command: str, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``command(*args)`` for each args tuple in one pipeline (one round trip)."""
        def op(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for args in calls:
                getattr(pipe, command)(*args)
            return pipe.execute()
        return self.backend.call(op)

    def delete_many(self, keys: Iterable[str]) -> int:
        removed = 0
        for chunk in _batches(keys, KEY_BATCH):
            names = [self.rkey(k) for k in chunk]
            removed += self.backend.call(lambda c: c.delete(*names))
            self._forget(chunk)
        return removed

    # -- verification ---------------------------------------------------------------------------

    def _load(self, key: str, data: bytes | None, out: memoryview) -> GetStatus:
        if data is None:
            self._forget((key,))
            return GetStatus.MISS
        try:
            if len(data) != self.stored_bytes:
                raise Corrupt("record has the wrong size", size=len(data), expected=self.stored_bytes)
            payload = record.decode_record(data, self.namespace_bytes, key)
        except Corrupt as exc:
            self._drop_corrupt(key, exc)
            return GetStatus.CORRUPT
        out[:] = payload
        self._remember((key,))
        return GetStatus.LOADED


def _batches(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
