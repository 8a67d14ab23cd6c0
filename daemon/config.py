"""The daemon's configuration: one object with typed defaults and no side effects.

The CLI (``kvswapd``) is a thin layer that fills this object from flags and ``KVSWAP_*``
environment variables; code and tests build it directly and call ``run(config)``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from .tiers import Locations

from kvswap.backends.file_backend import FILE_LAYOUTS
from kvswap.backends.file_store import DIRECT_IO_MODES, FSYNC_MODES
from kvswap.protocol.limits import DEFAULT_TIMEOUT_MS
from kvswap.common.units import PAGE_BYTES

MiB = 1024 * 1024

#: ``KVSWAP_*`` variables that are not kvswapd settings but are read by other parts, so the
#: daemon does not warn about them: the launcher hands ``KVSWAP_ENDPOINTS`` and
#: ``KVSWAP_METRICS_URLS`` to the server it starts; ``KVSWAP_GPU_BACKEND`` picks the GPU
#: framework the movers attach with (daemon/movers/cuda_attach.py); ``KVSWAP_NATIVE_COPY=0``
#: turns off the native shared-memory copy (daemon/movers/native.py).
OTHER_ENV_VARS: Final = frozenset({"KVSWAP_ENDPOINTS", "KVSWAP_METRICS_URLS", "KVSWAP_GPU_BACKEND",
                                   "KVSWAP_NATIVE_COPY"})


class ConfigError(ValueError):
    """A setting (or a combination) that cannot work; ``settings`` names the fields involved,
    so the command line can say where each value came from."""

    def __init__(self, message: str, *settings: str) -> None:
        super().__init__(message)
        self.settings = settings


#: The default RAM tier takes this share of physical memory, up to DEFAULT_HOST_TIER_MAX.
DEFAULT_HOST_TIER_SHARE = 8
DEFAULT_HOST_TIER_MAX = 4 * 1024 * MiB


def default_host_tier_bytes() -> int:
    """1/8 of physical memory, at most 4 GiB: room for the records an engine is likely to ask
    for again soon, leaving the machine's memory to the engine. The pool reserves it at
    registration but faults it in only as records fill it, so an idle daemon costs nothing."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1024 * MiB
    return min(DEFAULT_HOST_TIER_MAX, physical // DEFAULT_HOST_TIER_SHARE // MiB * MiB)


def default_storage_dir() -> str:
    """FastDeploy's variable names the directory where it is set, so a daemon started beside
    FastDeploy lands on the same store."""
    return os.environ.get("FILE_BACKEND_STORAGE_DIR") or "./kvswap-store"


@dataclass
class Config:
    #: Address the control socket and the metrics endpoint bind to.
    host: str = "127.0.0.1"
    #: CURVE on the control socket: the daemon's secret key file (``kvswap keygen``). Set
    #: together with ``authorized_keys``; then only clients whose public key is listed connect.
    curve_secret_key_file: str = ""
    #: CURVE: directory of the public key files (``*.key``) of the clients allowed to connect.
    authorized_keys: str = ""
    #: The engine's cache-queue port: the ZMQ ROUTER socket engines send commands to.
    cache_queue_port: int = 55500
    #: HTTP port for /metrics, /healthz and /readyz.
    metrics_port: int = 55600
    storage_dir: str = field(default_factory=default_storage_dir)
    #: none: rely on checksums (a record lost to power failure is a miss); data: fdatasync
    #: every record; strict: also fsync its directory.
    fsync: str = "none"
    #: Cap on the bytes the file tier holds in this namespace (0: no cap). Least recently used
    #: records are evicted to stay under it.
    storage_max_bytes: int = 0
    #: Keep at least this much free space on the storage file system (0: no floor).
    storage_min_free_bytes: int = 0
    #: auto: use O_DIRECT for records when the file system supports it; on: require it; off.
    #: auto by default: measured here, persisted swap_out ran ~1.2 GB/s with O_DIRECT and
    #: ~0.46 GB/s buffered (dirty-page throttling), and O_DIRECT keeps swapped-out KV from
    #: evicting the page cache; hot records belong in the host tier instead.
    direct_io: str = "auto"
    #: slab: records in fixed-size slots of preallocated files, found through journals (one
    #: positioned I/O per record; the index is replayed in seconds at a million records);
    #: files: one file per record (the layout before slabs). A slab store reads old files too.
    file_layout: str = "slab"
    #: How often the evicting daemon re-lists the directory to count records other daemons
    #: wrote (0: only at start-up). Set it when several daemons share the directory.
    storage_rescan_interval_s: float = 0.0
    #: How often background eviction checks the watermarks.
    maintenance_interval_s: float = 1.0
    #: Bytes of RAM for the host tier (0: no host tier). On by default: 1/8 of the machine's
    #: memory, at most 4 GiB (see default_host_tier_bytes).
    host_tier_bytes: int = field(default_factory=lambda: default_host_tier_bytes())
    #: The remote tier: ``redis://HOST:PORT/DB``, ``redis+cluster://HOST:PORT`` or
    #: ``mooncake://MASTER:PORT?metadata=...&protocol=tcp|rdma`` ("" : no remote tier).
    remote_url: str = ""
    #: Comma list of tiers swap_out writes to ("": every configured tier).
    store_locations: str = ""
    #: Comma list of tiers swap_in and lookup search, in order ("": all, in tier order).
    retrieve_locations: str = ""
    #: Copy a record found in a lower tier into the host tier (when host is retrieved from).
    promote_to_host: bool = True
    #: How often an unhealthy (or healthy) remote tier is probed in the background.
    remote_check_interval_s: float = 2.0
    #: /readyz answers 200 while a store or retrieve location cannot serve (the remote tier is
    #: unreachable): for operators who prefer degraded serving to being taken out of rotation.
    ready_when_degraded: bool = False
    #: Threads writing records. Writes of separate files overlap well on SSDs and network
    #: file systems (four threads measured 4.5x one thread here with fsync on).
    write_threads: int = 4
    #: Threads reading records; reads have their own pool so writes never starve them.
    read_threads: int = 4
    #: How much lower than the event loop the I/O and upkeep threads are scheduled (a nice
    #: value, 0..19; 0: same priority); the copy thread gets half. Measured in data_threads.py:
    #: with 10, ping p99 under a swap_out stream fell from 10.7 to 4.6 ms on 2 cores.
    data_thread_nice: int = 10
    #: Staging memory for swap_out: copied blocks wait here for their write. When it is full
    #: swap_out answers busy.
    write_staging_bytes: int = 256 * MiB
    #: Staging memory for swap_in and reads of in-flight records.
    read_staging_bytes: int = 64 * MiB
    #: Deadline for a request that brings none.
    default_timeout_ms: int = DEFAULT_TIMEOUT_MS
    #: On SIGTERM, how long to let in-flight requests and writes finish.
    drain_timeout_s: float = 30.0
    #: Requests being handled at once; beyond this the daemon answers busy.
    max_inflight_requests: int = 1024
    #: Requests one client connection may have in flight; beyond this it is answered busy, so
    #: one engine cannot take every slot of ``max_inflight_requests``.
    max_inflight_per_client: int = 256
    #: Bytes the decoded requests not yet answered may hold, all connections together (one
    #: connection: the share ``max_inflight_per_client`` is of ``max_inflight_requests``);
    #: beyond it the daemon answers busy. The largest valid request holds about 1.9 MB.
    max_inflight_request_bytes: int = 64 * MiB
    #: Connections the control socket keeps open at once; a handshake beyond it is refused
    #: (that client's requests time out). Bounds what ZMQ holds for connections (docs/security.md).
    max_connections: int = 16
    #: How often to check that the registered engine process still lives.
    engine_check_interval_s: float = 1.0
    log_level: str = "info"
    #: text: human-readable lines; json: one object per line (ts, level, logger, msg) for collectors.
    log_format: str = "text"
    #: Address the metrics endpoint binds to ("": the same as ``host``). Lets a sidecar keep
    #: the control socket on loopback while probes and Prometheus reach the metrics port.
    metrics_host: str = ""
    #: KV events (daemon/kv_events.py): the ZMQ PUB address kvswapd binds and publishes what
    #: each tier stores and removes on, in vLLM's format ("": off). Loopback or ipc:// only.
    kv_events_endpoint: str = ""
    #: The ROUTER address answering replay requests from the buffer ("": no replay).
    kv_events_replay_endpoint: str = ""
    #: The first frame of every events message (subscribers filter on it).
    kv_events_topic: str = ""
    #: Bytes of past event batches kept for replay; the oldest go first.
    kv_events_buffer_bytes: int = 64 * MiB
    #: map: events as tagged maps (vLLM 0.32's decoder); array: tagged arrays (earlier vLLM).
    kv_events_encoding: str = "map"
    #: Prefill/decode disaggregation (peer.py): the ZMQ endpoint other daemons reach this
    #: daemon's control socket on ("": peer transfer off). Turns on peer_export, peer_release
    #: and lookup's ``peer`` field, exporting and importing alike.
    peer_address: str = ""
    #: How record bytes move between daemons: mooncake (Mooncake's transfer engine), inline (in
    #: the reply frames), auto (mooncake where it imports and starts, else inline).
    peer_transport: str = "auto"
    #: The transfer engine's protocol: tcp, or rdma where the hosts have RDMA NICs.
    peer_te_protocol: str = "tcp"
    #: Memory for records in transit, on each side: the buffer an exporter holds records in for
    #: peers under a lease (registered with the transfer engine), and an importer's receive
    #: buffer. 64 MiB: a few dozen blocks of a large model's KV per pull.
    peer_export_bytes: int = 64 * MiB
    #: How long an exporter holds records for a peer that never says it read them.
    peer_lease_s: float = 10.0
    #: CURVE between daemons: the peers' public key file ("": this daemon's own public key, for
    #: a cluster whose daemons share one keypair). The importer connects with this daemon's own
    #: keypair (``curve_secret_key_file``), so the peers must list its public key as authorized.
    peer_server_key_file: str = ""
    #: none, prefill or decode: checked at start-up against the tiers (a prefill must retrieve
    #: from the remote pool, a decode must store to it) and reported in ``hello``.
    pd_role: str = "none"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that cannot work."""
        for name in ("cache_queue_port", "metrics_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        if self.cache_queue_port == self.metrics_port != 0:
            # Refused here: at bind time it reads as "metrics port already in use", a collision
            # with itself that sends the operator looking for another process.
            raise ConfigError(f"cache_queue_port and metrics_port are both {self.metrics_port}; they need two "
                              "different ports", "cache_queue_port", "metrics_port")
        for name in ("host", "metrics_host"):
            problem = _bind_address_problem(getattr(self, name), may_be_empty=name == "metrics_host")
            if problem:
                raise ConfigError(f"{name} {getattr(self, name)!r} {problem}", name)
        if self.fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_MODES)}, got {self.fsync!r}")
        for name in ("write_threads", "read_threads", "max_inflight_requests", "max_inflight_per_client",
                     "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0 <= self.data_thread_nice <= 19:
            raise ValueError(f"data_thread_nice must be in 0..19, got {self.data_thread_nice}")
        if self.max_inflight_request_bytes < MiB:
            raise ValueError("max_inflight_request_bytes must be at least 1 MiB")
        for name in ("write_staging_bytes", "read_staging_bytes"):
            if getattr(self, name) < PAGE_BYTES:
                raise ValueError(f"{name} must be at least {PAGE_BYTES}")
        if self.file_layout not in FILE_LAYOUTS:
            raise ValueError(f"file_layout must be one of {', '.join(FILE_LAYOUTS)}, got {self.file_layout!r}")
        if self.direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {', '.join(DIRECT_IO_MODES)}, got {self.direct_io!r}")
        if self.storage_max_bytes < 0 or self.storage_min_free_bytes < 0:
            raise ValueError("storage limits must be >= 0")
        if self.maintenance_interval_s <= 0:
            raise ValueError("maintenance_interval_s must be positive")
        if self.host_tier_bytes < 0:
            raise ValueError("host_tier_bytes must be >= 0")
        if self.remote_url:
            from kvswap.backends.remote import parse_remote_url

            parse_remote_url(self.remote_url)  # RemoteConfigError is a ValueError naming the valid forms
        self.locations()
        if self.default_timeout_ms < 1:
            raise ValueError("default_timeout_ms must be positive")
        if bool(self.curve_secret_key_file) != bool(self.authorized_keys):
            raise ValueError("curve_secret_key_file and authorized_keys go together: CURVE needs the daemon's "
                             "secret key and the directory of authorized client keys")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        self._validate_kv_events()
        self._validate_peer()

    def _validate_peer(self) -> None:
        if self.peer_transport not in PEER_TRANSPORTS:
            raise ValueError(f"peer_transport must be one of {', '.join(PEER_TRANSPORTS)}, got {self.peer_transport!r}")
        if self.peer_address:
            problem = _peer_address_problem(self.peer_address)
            if problem:
                raise ConfigError(f"peer_address {self.peer_address!r} {problem}", "peer_address")
        if self.peer_te_protocol not in ("tcp", "rdma"):
            raise ValueError(f"peer_te_protocol must be tcp or rdma, got {self.peer_te_protocol!r}")
        if self.peer_export_bytes < MiB:
            raise ValueError("peer_export_bytes must be at least 1 MiB")
        if not 0 < self.peer_lease_s <= 600:
            raise ValueError(f"peer_lease_s must be in (0, 600], got {self.peer_lease_s}")
        if self.peer_server_key_file and not self.curve:
            raise ConfigError("peer_server_key_file is a CURVE setting: it needs curve_secret_key_file and "
                              "authorized_keys", "peer_server_key_file", "curve_secret_key_file")
        if self.pd_role not in PD_ROLES:
            raise ValueError(f"pd_role must be one of {', '.join(PD_ROLES)}, got {self.pd_role!r}")
        if self.pd_role == "none":
            return
        if not self.peer_address:
            raise ConfigError(f"pd_role {self.pd_role} needs --peer-address: the endpoint the other role's daemons "
                              "reach this one on (e.g. tcp://10.0.0.5:55500)", "pd_role", "peer_address")
        locations = self.locations()
        if self.pd_role == "prefill" and "remote" not in locations.retrieve:
            raise ConfigError("pd_role prefill needs remote among the retrieve locations: a prefill that retrieves "
                              "nothing from the pool recomputes every turn the decode nodes stored there; set "
                              "--remote-url and --retrieve-locations (e.g. host,remote)", "pd_role",
                              "retrieve_locations", "remote_url")
        if self.pd_role == "decode" and "remote" not in locations.store:
            raise ConfigError("pd_role decode needs remote among the store locations: a decode node that stores "
                              "nowhere the next turn's prefill retrieves from leaves it to recompute; set "
                              "--remote-url and --store-locations (e.g. host,remote)", "pd_role",
                              "store_locations", "remote_url")

    def _validate_kv_events(self) -> None:
        from kvswap.protocol.kv_events import ENCODINGS

        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint (the stream it replays)",
                              "kv_events_replay_endpoint", "kv_events_endpoint")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            problem = _events_endpoint_problem(getattr(self, name))
            if problem:
                raise ConfigError(f"{name} {getattr(self, name)!r} {problem}", name)
        if self.kv_events_endpoint and self.kv_events_endpoint == self.kv_events_replay_endpoint:
            raise ConfigError("kv_events_endpoint and kv_events_replay_endpoint need two different addresses",
                              "kv_events_endpoint", "kv_events_replay_endpoint")
        if self.kv_events_encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {', '.join(ENCODINGS)}, got {self.kv_events_encoding!r}")
        if self.kv_events_buffer_bytes < 0:
            raise ValueError("kv_events_buffer_bytes must be >= 0")
        if len(self.kv_events_topic.encode()) > 256:
            raise ValueError("kv_events_topic must be at most 256 bytes")

    @property
    def metrics_bind_host(self) -> str:
        return self.metrics_host or self.host

    @property
    def curve(self) -> bool:
        return bool(self.curve_secret_key_file)

    def configured_tiers(self) -> list[str]:
        return [t for t, on in (("host", self.host_tier_bytes > 0), ("file", True), ("remote", bool(self.remote_url)))
                if on]

    def locations(self) -> "Locations":
        """Where swaps store and retrieve; raises ``ValueError`` for a bad combination."""
        from .tiers import Locations

        return Locations.resolve(self.configured_tiers(), self.store_locations, self.retrieve_locations,
                                 self.promote_to_host)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _events_endpoint_problem(endpoint: str) -> str:
    """Why kvswapd will not bind ``endpoint`` for KV events ("" if it will). Events name what
    the engine stored, token ids included (a prompt's content), and their sockets have no CURVE
    yet, so they stay on this host: loopback TCP, ipc:// or inproc://. Routers elsewhere read
    them through the engine's own stream (the vLLM connector forwards them) or a relay."""
    if not endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return ""
    if not endpoint.startswith("tcp://"):
        return "must be tcp://HOST:PORT (loopback), ipc://PATH or inproc://NAME"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        return "needs a port: tcp://127.0.0.1:PORT"
    if not is_loopback(host.strip("[]")):
        return ("is not a loopback address: KV events carry token ids and their sockets have no CURVE, so "
                "bind them to 127.0.0.1, ::1 or ipc:// (see docs/configuration.md, KV events)")
    return ""


#: Values of ``peer_transport`` and ``pd_role``.
PEER_TRANSPORTS: Final = ("auto", "mooncake", "inline")
PD_ROLES: Final = ("none", "prefill", "decode")


def peer_host(address: str) -> str:
    """A peer address's host, as the transfer engine names its segment: ``tcp://10.0.0.5:55500``
    -> ``10.0.0.5`` (``tcp://[::1]:1`` -> ``::1``)."""
    return address[len("tcp://"):].rpartition(":")[0].strip("[]")


def _peer_address_problem(endpoint: str) -> str:
    """Why ``endpoint`` cannot be a ``--peer-address`` ("" if it can): another host's daemon
    connects to it, so it is ``tcp://HOST:PORT`` with a host it can reach (not a wildcard)."""
    if not endpoint.startswith("tcp://"):
        return "must be tcp://HOST:PORT, the address other daemons reach this daemon's control socket on"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return "needs a host and a port: tcp://10.0.0.5:55500"
    if host.strip("[]") in ("0.0.0.0", "::", "*"):
        return "names every interface; give the address peers connect to (this host's own address)"
    return ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind_address_problem(host: str, may_be_empty: bool = False) -> str:
    """Why ``host`` cannot be bound ("" if it can be tried): the control socket (ZMQ) and the
    metrics server (asyncio) both take an IP address or a resolvable host name. IPv6 works
    (``::1``, ``::``); ZMQ needs its IPv6 option for it, which the server sets. An unset
    ``metrics_host`` ("") means "as ``host``"."""
    if not host:
        return "" if may_be_empty else "is empty: give an address to bind, e.g. 127.0.0.1"
    if host == "localhost":
        return ""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    if host.startswith("[") and host.endswith("]"):
        return "needs no brackets: write an IPv6 address bare, as ::1"
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return "is not an IP address or a host name that resolves (give an address of this host, e.g. 127.0.0.1)"
    return ""
