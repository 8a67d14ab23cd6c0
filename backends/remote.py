"""The remote tier: which distributed store a URL names, and how a tier's health is tracked.

``open_remote(url)`` turns ``--remote-url`` into a :class:`~kvswap.backends.base.Backend`:

- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S&connect_timeout=S&max_connections=N]``
  (``rediss://`` for TLS) — one Redis server, through redis-py;
- ``redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][?...]`` (``rediss+cluster://``) — a Redis
  Cluster reached through one seed node;
- ``mooncake://MASTER_HOST:PORT[?metadata=URL&protocol=tcp|rdma&device=NAMES&segment=SIZE
  &buffer=SIZE&local_host=ADDR&slots=N&timeout=S&connect_timeout=S]`` — Mooncake Store.

Parsing is pure (:func:`parse_remote_url`); a URL that is not one of these raises
:class:`RemoteConfigError` (a ``ValueError``) naming the valid forms, and so does a form whose
client package is not installed. Nothing connects until the first operation or
``backend.probe()``, so a daemon starts while its remote store is down and the tier joins when
the store comes up.

Records in a remote store are the same bytes as a record file (header + payload, see
:mod:`.record`) under the key ``kvswap/<namespace>/<key>``; a reader verifies them like a file.

:class:`HealthGate` is the one piece of health logic both adapters share: a failure to reach the
store marks the tier unhealthy; while unhealthy every operation fails at once with
``Unavailable`` (no caller waits out a timeout), and one caller at a time re-probes the store
once the backoff (exponential, capped) has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Final
from urllib.parse import parse_qsl, unquote, urlsplit

from kvswap.protocol.errors import Corrupt, KvswapError, Unavailable

from . import record
from .base import Backend, Store

log = logging.getLogger(__name__)

#: Every remote key starts with this, then the namespace fingerprint and "/".
KEY_ROOT: Final = "kvswap"

VALID_FORMS: Final = (
    "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S&connect_timeout=S&max_connections=N]",
    "rediss://... (Redis over TLS, same form)",
    "redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][?timeout=S&connect_timeout=S&max_connections=N]",
    "mooncake://MASTER_HOST:PORT[?metadata=P2PHANDSHAKE|http://HOST:PORT/metadata|etcd://HOST:PORT"
    "&protocol=tcp|rdma&device=NAMES&segment=SIZE&buffer=SIZE&local_host=ADDR&slots=N&timeout=S"
    "&connect_timeout=S]",
)

#: Mooncake's client refuses a smaller contributed segment ("Total size must be at least").
MOONCAKE_MIN_SEGMENT: Final = 16 << 20

_SIZE_UNITS: Final = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
                      "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
                      "tib": 1 << 40}


class RemoteConfigError(ValueError):
    """A remote URL that cannot work: unknown scheme, malformed, or its client not installed."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}; valid remote URLs: " + " | ".join(VALID_FORMS))
        self.problem = problem


def remote_key(namespace: str, key: str) -> str:
    """``kvswap/<namespace>/<key>``. The namespace is a fixed-length hex fingerprint, so no key
    of one namespace can spell a key of another."""
    return f"{KEY_ROOT}/{namespace}/{key}"


# -- URL parsing (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class RedisSpec:
    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    cluster: bool = False
    #: Seconds one command may wait for its reply (socket read/write timeout).
    timeout: float = 5.0
    connect_timeout: float = 1.0
    max_connections: int = 64

    def redacted(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = "***@" if self.password else ""
        path = "" if self.cluster else f"/{self.db}"
        return f"{scheme}://{auth}{_host_port(self.host, self.port)}{path}"


@dataclass(frozen=True)
class MooncakeSpec:
    master_host: str
    master_port: int
    #: P2PHANDSHAKE (peers exchange metadata directly), or an http/etcd/redis metadata URL.
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    #: RDMA device names (comma list) for protocol=rdma; empty lets Mooncake pick.
    device: str = ""
    #: Memory this daemon contributes to the pool. 0: none (the pool is served by other
    #: clients, e.g. ``mooncake_client`` processes); puts fail with no_space if nobody does.
    segment: int = 0
    #: The client's own transfer buffer (used by Mooncake's copying calls; kvswap's reads and
    #: writes go through registered buffers instead).
    buffer: int = 16 << 20
    #: Address this client advertises to peers; empty: the local address that routes to the
    #: master (127.0.0.1 for a master on loopback).
    local_host: str = ""
    #: Registered staging slots per namespace: operations of one namespace in flight at once.
    slots: int = 8
    timeout: float = 5.0
    connect_timeout: float = 1.0

    def redacted(self) -> str:
        return f"mooncake://{_host_port(self.master_host, self.master_port)}?metadata={self.metadata}&protocol={self.protocol}"


RemoteSpec = RedisSpec | MooncakeSpec


def parse_remote_url(url: str) -> RemoteSpec:
    """Parse a remote URL; raise :class:`RemoteConfigError` for anything that is not one of
    :data:`VALID_FORMS`.

    >>> parse_remote_url("redis://cache:6380/2?timeout=0.5")
    RedisSpec(host='cache', port=6380, db=2, username=None, tls=False, cluster=False, timeout=0.5, connect_timeout=1.0, max_connections=64)
    >>> parse_remote_url("mooncake://10.0.0.5:50051?protocol=rdma&segment=4GiB").segment
    4294967296
    """
    if not isinstance(url, str) or not url.strip():
        raise RemoteConfigError("empty remote URL")
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise RemoteConfigError(f"malformed remote URL {_redact_raw(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster", "mooncake"):
        raise RemoteConfigError(f"unknown remote URL scheme {parts.scheme!r}")
    if not host:
        raise RemoteConfigError(f"remote URL {_redact_raw(url)!r} names no host")
    if parts.fragment:
        raise RemoteConfigError("remote URL must not have a #fragment")
    try:
        query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError:
        raise RemoteConfigError(f"malformed query string {parts.query!r}") from None
    if scheme == "mooncake":
        return _mooncake_spec(parts, host, port, query)
    return _redis_spec(scheme, parts, host, port, query)


def _redis_spec(scheme: str, parts, host: str, port: int | None, query: dict[str, str]) -> RedisSpec:
    cluster = scheme.endswith("+cluster")
    path = parts.path.strip("/")
    db = 0
    if path:
        if cluster:
            raise RemoteConfigError("a Redis Cluster has no database number: drop the /DB path")
        if not path.isdigit():
            raise RemoteConfigError(f"Redis database must be a number, got {path!r}")
        db = int(path)
    _reject_unknown(query, {"timeout", "connect_timeout", "max_connections"}, scheme)
    return RedisSpec(
        host=host, port=port or 6379, db=db,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        tls=scheme.startswith("rediss"), cluster=cluster,
        timeout=_positive_float(query, "timeout", 5.0),
        connect_timeout=_positive_float(query, "connect_timeout", 1.0),
        max_connections=_positive_int(query, "max_connections", 64))


def _mooncake_spec(parts, host: str, port: int | None, query: dict[str, str]) -> MooncakeSpec:
    if port is None:
        raise RemoteConfigError("mooncake:// needs the master's port (mooncake_master --rpc_port, 50051 by default)")
    if parts.path.strip("/"):
        raise RemoteConfigError("mooncake:// takes no path; settings go in the query string")
    if parts.username or parts.password:
        raise RemoteConfigError("mooncake:// takes no user or password")
    _reject_unknown(query, {"metadata", "protocol", "device", "segment", "buffer", "local_host", "slots", "timeout",
                            "connect_timeout"}, "mooncake")
    metadata = query.get("metadata", "P2PHANDSHAKE") or "P2PHANDSHAKE"
    if metadata != "P2PHANDSHAKE" and "://" not in metadata:
        raise RemoteConfigError(f"metadata must be P2PHANDSHAKE or a metadata server URL, got {metadata!r}")
    protocol = query.get("protocol", "tcp")
    if protocol not in ("tcp", "rdma"):
        raise RemoteConfigError(f"mooncake protocol must be tcp or rdma, got {protocol!r}")
    segment = _size(query, "segment", 0)
    if 0 < segment < MOONCAKE_MIN_SEGMENT:
        raise RemoteConfigError(f"mooncake segment must be 0 or at least 16MiB, got {query['segment']!r}")
    return MooncakeSpec(
        master_host=host, master_port=port, metadata=metadata, protocol=protocol, device=query.get("device", ""),
        segment=segment, buffer=_size(query, "buffer", 16 << 20),
        local_host=query.get("local_host", ""), slots=_positive_int(query, "slots", 8),
        timeout=_positive_float(query, "timeout", 5.0), connect_timeout=_positive_float(query, "connect_timeout", 1.0))


def _reject_unknown(query: dict[str, str], known: set[str], scheme: str) -> None:
    unknown = sorted(set(query) - known)
    if unknown:
        raise RemoteConfigError(f"unknown {scheme} setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")


def _positive_float(query: dict[str, str], name: str, default: float) -> float:
    if name not in query:
        return default
    try:
        value = float(query[name])
    except ValueError:
        raise RemoteConfigError(f"{name} must be a number of seconds, got {query[name]!r}") from None
    if not value > 0 or value == float("inf"):
        raise RemoteConfigError(f"{name} must be a positive number of seconds, got {query[name]!r}")
    return value


def _positive_int(query: dict[str, str], name: str, default: int) -> int:
    if name not in query:
        return default
    raw = query[name]
    if not raw.isdigit() or int(raw) < 1:
        raise RemoteConfigError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


def _size(query: dict[str, str], name: str, default: int) -> int:
    """``4GiB``, ``512MB``, ``1048576``: binary units whatever the spelling, as Mooncake reads them."""
    if name not in query:
        return default
    raw = query[name].strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    if not number or unit not in _SIZE_UNITS:
        raise RemoteConfigError(f"{name} must be a size such as 4GiB, 512MiB or a byte count, got {query[name]!r}")
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except ValueError:
        raise RemoteConfigError(f"{name} must be a size such as 4GiB, got {query[name]!r}") from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise RemoteConfigError(f"{name} must be a non-negative size, got {query[name]!r}")
    return int(value)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _redact_raw(url: str) -> str:
    """The URL with any password replaced, for messages."""
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, _ = head.partition("://")
    return f"{scheme}://***@{tail}"


def open_remote(url: str, **options: Any) -> Backend:
    """The backend a remote URL names. Raises :class:`RemoteConfigError` (a ``ValueError``)
    for a URL that is not one of :data:`VALID_FORMS` or whose client package is missing.
    Connects lazily: see the module docstring. ``options`` go to the backend's constructor
    (``backoff_initial_s``, ``backoff_max_s``, ``clock``)."""
    spec = parse_remote_url(url)
    if isinstance(spec, RedisSpec):
        try:
            from .redis_tier import RedisBackend
        except ImportError as exc:
            raise RemoteConfigError(f"{spec.redacted()} needs the redis package "
                                    f"(pip install 'kvswap[remote]'): {exc}") from None
        return RedisBackend(spec, **options)
    from .mooncake_tier import MooncakeBackend, mooncake_import_error
    problem = mooncake_import_error()
    if problem:
        raise RemoteConfigError(f"{spec.redacted()} needs Mooncake's client "
                                f"(pip install 'kvswap[remote]'): {problem}")
    return MooncakeBackend(spec, **options)


# -- health -----------------------------------------------------------------------------------


#: How long an operation waits, at most per wake-up, for a probe another thread is running.
PROBE_WAIT_S = 1.0


class HealthGate:
    """Whether a remote store is reachable, and when to try it again.

    Adapters wrap every operation: ``admit()`` before it, ``failed(exc)`` when it could not
    reach the store. The first failure marks the tier unhealthy; from then on ``admit()``
    raises ``Unavailable`` at once, except for one caller per backoff period, who runs the
    probe (reconnect + cheap request). A probe that succeeds makes the tier healthy again; one
    that fails doubles the backoff, up to ``backoff_max_s``.

    Before its first successful probe the tier has never been reached: ``healthy`` is False and
    the first operation probes (connects) at once; operations arriving meanwhile wait for that
    first connect instead of failing.
    """

    def __init__(self, name: str, probe: Callable[[], None], *, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        self.name = name
        self._probe = probe
        self._clock = clock
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        # A condition, so operations that arrive while a probe runs wait for its outcome
        # instead of failing as if the store were down.
        self._lock = threading.Condition()
        self._healthy = False
        self._ever_connected = False
        self._probing = False
        # Consecutive failures (operations and probes) since the store last answered.
        self._streak = 0
        self._next_probe_at = float("-inf")
        #: Operations and probes that could not reach the store.
        self.failures = 0
        #: Times the tier came back after being unhealthy (the first connection is not one).
        self.reconnects = 0
        #: Probes run (connects and re-probes).
        self.probes = 0
        #: The last failure, for logs and status.
        self.last_error = ""

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def retry_in_s(self) -> float:
        """Seconds until the next probe is allowed (0 when healthy or due)."""
        with self._lock:
            return 0.0 if self._healthy else max(0.0, self._next_probe_at - self._clock())

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"healthy": self._healthy, "failures": self.failures, "reconnects": self.reconnects,
                    "probes": self.probes, "last_error": self.last_error}

    def admit(self) -> None:
        """Return if the store may be called now; raise ``Unavailable`` if it is known to be
        unreachable. Runs the probe when one is due (only in one thread at a time)."""
        if self._healthy:
            return
        with self._lock:
            # The very first connect: wait for it rather than fail as if the store were down.
            # Once the store has been reached, a re-probe after an outage does not hold
            # callers up: they fail fast until it succeeds.
            while self._probing and not self._ever_connected:
                self._lock.wait(PROBE_WAIT_S)
            if self._healthy:
                return
            if self._probing:
                raise self._unavailable(max(0.0, self._next_probe_at - self._clock()))
            now = self._clock()
            if now < self._next_probe_at:
                raise self._unavailable(max(0.0, self._next_probe_at - now))
            self._probing = True
        self._run_probe()

    def check(self) -> bool:
        """Probe now if the tier is healthy (to notice an outage before an operation does) or a
        re-probe is due; return ``healthy``. For a periodic health loop; blocks at most the
        store's connect/request timeouts."""
        with self._lock:
            if self._probing or (not self._healthy and self._clock() < self._next_probe_at):
                return self._healthy
            self._probing = True
        try:
            self._run_probe()
        except Unavailable:
            pass
        return self._healthy

    def failed(self, exc: BaseException | str) -> Unavailable:
        """Record that an operation could not reach the store; return the error to raise."""
        message = _describe(exc)
        with self._lock:
            self.failures += 1
            self.last_error = message
            if self._healthy:
                self._healthy = False
                self._streak = 1
                self._next_probe_at = self._clock() + self.backoff_initial_s
                log.warning("remote tier %s is unreachable (%s); retrying in %.1fs", self.name, message,
                            self.backoff_initial_s)
            return self._unavailable(max(0.0, self._next_probe_at - self._clock()))

    def _run_probe(self) -> None:
        try:
            self._probe()
        except BaseException as exc:
            message = _describe(exc)
            with self._lock:
                self._probing = False
                self._lock.notify_all()
                self.probes += 1
                self.failures += 1
                self.last_error = message
                self._healthy = False
                # Each consecutive failure doubles the wait, up to the cap.
                self._streak += 1
                wait = self._wait_after(self._streak)
                self._next_probe_at = self._clock() + wait
                error = self._unavailable(wait)
            log.info("remote tier %s probe failed (%s); next try in %.1fs", self.name, message, wait)
            if not isinstance(exc, Exception):
                raise
            raise error from None
        with self._lock:
            self._probing = False
            self._lock.notify_all()
            self.probes += 1
            self._healthy = True
            self._streak = 0
            if self._ever_connected:
                self.reconnects += 1
                log.warning("remote tier %s is reachable again", self.name)
            self._ever_connected = True

    def _wait_after(self, streak: int) -> float:
        return min(self.backoff_initial_s * 2 ** min(streak - 1, 62), self.backoff_max_s)

    def _unavailable(self, retry_in: float) -> Unavailable:
        return Unavailable(f"remote tier {self.name} is unreachable: {self.last_error or 'not connected yet'}",
                           tier="remote", retry_in_s=round(retry_in, 3))


def _describe(exc: BaseException | str) -> str:
    if isinstance(exc, str):
        return exc
    text = getattr(exc, "message", None) or str(exc)
    details = getattr(exc, "details", None)
    if details:
        text += " (" + ", ".join(f"{k}={v}" for k, v in details.items()) + ")"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- what both adapters' stores share ---------------------------------------------------------


class GatedHealth:
    """``healthy``, ``failures`` and ``reconnects`` of an object's ``gate``, as the daemon
    reads them from remote backends and stores alike."""

    gate: HealthGate

    @property
    def healthy(self) -> bool:
        return self.gate.healthy

    @property
    def failures(self) -> int:
        return self.gate.failures

    @property
    def reconnects(self) -> int:
        return self.gate.reconnects


class RemoteStoreBase(GatedHealth, Store):
    """Namespace, key mapping, health view and the usage this process has seen, shared by the
    Redis and Mooncake stores. Adapters implement the raw operations."""

    tier = "remote"

    def __init__(self, gate: HealthGate, namespace: str, record_bytes: int) -> None:
        self.gate = gate
        self.namespace = namespace
        self.namespace_bytes = bytes.fromhex(namespace)
        self.record_bytes = record_bytes
        self.header_len = record.header_len_for(record_bytes)
        self.stored_bytes = self.header_len + record_bytes
        self.prefix = f"{KEY_ROOT}/{namespace}/"
        # Keys this process wrote or found, so usage() answers without scanning a shared
        # store. Other nodes' writes and the store's own eviction are not seen here.
        self._seen: set[str] = set()
        self._seen_lock = threading.Lock()
        #: Records that failed verification (and were removed).
        self.corrupt = 0

    def rkey(self, key: str) -> str:
        return self.prefix + key

    def header_for(self, key: str, payload: memoryview) -> bytes:
        if len(payload) != self.record_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, the namespace stores {self.record_bytes}")
        return record.encode_header(self.namespace_bytes, key, len(payload), record.payload_checksum(payload))

    def usage(self) -> dict[str, int]:
        with self._seen_lock:
            n = len(self._seen)
        return {"records": n, "bytes": n * self.stored_bytes}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.usage())
        out.update(healthy=self.healthy, failures=self.failures, reconnects=self.reconnects, corrupt=self.corrupt)
        return out

    def _remember(self, keys) -> None:
        with self._seen_lock:
            self._seen.update(keys)

    def _forget(self, keys) -> None:
        with self._seen_lock:
            self._seen.difference_update(keys)

    def _forget_all(self) -> None:
        with self._seen_lock:
            self._seen.clear()

    def _drop_corrupt(self, key: str, exc: Corrupt) -> None:
        """Count and remove a record that failed verification."""
        self.corrupt += 1
        log.warning("corrupt remote record %s: %s; removing it", self.rkey(key), exc.message)
        try:
            self.delete(key)
        except KvswapError as err:  # the status is still "corrupt"; the next reader retries
            log.warning("cannot remove corrupt record %s: %s", self.rkey(key), err.message)
