"""Which distributed store a remote URL names: pure parsing, no I/O, no client imports.

- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S&connect_timeout=S&max_connections=N]``
  (``rediss://`` for TLS) — one Redis server;
- ``redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][?...]`` (``rediss+cluster://``) — a Redis
  Cluster reached through one seed node;
- ``mooncake://MASTER_HOST:PORT[?metadata=URL&protocol=tcp|rdma&device=NAMES&segment=SIZE
  &buffer=SIZE&local_host=ADDR&slots=N&timeout=S&connect_timeout=S]`` — Mooncake Store.

A URL that is not one of these raises :class:`RemoteConfigError` (a ``ValueError``) naming the
valid forms. Sizes (``segment``, ``buffer``) follow the one size rule of
:func:`kvswap.common.units.parse_size`, the same as the daemon's size flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final
from urllib.parse import parse_qsl, unquote, urlsplit

from kvswap.common.units import SIZE_EXAMPLES, parse_size

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


class RemoteConfigError(ValueError):
    """A remote URL that cannot work: unknown scheme, malformed, or its client not installed."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{problem}; valid remote URLs: " + " | ".join(VALID_FORMS))
        self.problem = problem


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
    """A size setting, by the one size rule (:func:`kvswap.common.units.parse_size`)."""
    if name not in query:
        return default
    try:
        return parse_size(query[name])
    except ValueError:
        raise RemoteConfigError(f"{name} must be a non-negative size such as {SIZE_EXAMPLES}, got {query[name]!r}") from None


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _redact_raw(url: str) -> str:
    """The URL with any password replaced, for messages."""
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, _ = head.partition("://")
    return f"{scheme}://***@{tail}"


