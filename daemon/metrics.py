"""Prometheus instruments of one daemon, in a registry that daemon owns (so a test can run
two daemons in one process), and the HTTP endpoint that serves them with health checks."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable, Iterable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.metrics import MetricWrapperBase

from kvswap import __version__

from . import fds

log = logging.getLogger(__name__)

#: Request latency buckets, seconds: sub-millisecond pings to multi-second swaps.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvswap_requests", "Requests answered, by op and outcome (ok or error).",
                                ["op", "outcome"], registry=r)
        self.errors = Counter("kvswap_errors", "Error replies, by op and error code.", ["op", "code"], registry=r)
        self.latency = Histogram("kvswap_request_duration_seconds", "Time from receipt to answer, by op.", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kvswap_requests_in_flight", "Requests received and not yet answered.", registry=r)
        self.bytes = Counter("kvswap_bytes", "Payload bytes moved: out = engine to storage, in = storage to engine.",
                             ["direction"], registry=r)
        self.blocks = Counter("kvswap_blocks", "Blocks handled by swap_out and swap_in, by per-key status.",
                              ["op", "status"], registry=r)
        self.lookup_keys = Counter("kvswap_lookup_keys", "Keys answered by lookup: hit (in the stored prefix) or miss.",
                                   ["result"], registry=r)
        self.corrupt = Counter("kvswap_corrupt_records", "Records that failed their header or checksum check and "
                               "were removed.", ["tier"], registry=r)
        self.write_failures = Counter("kvswap_write_failures", "Records that could not be written, by error code.",
                                      ["code"], registry=r)
        self.late_copies = Counter("kvswap_late_copies", "Requests answered at their deadline while a copy of "
                                   "engine memory had not stopped within 0.5 s (should stay 0).", registry=r)
        self.expired_on_arrival = Counter("kvswap_expired_on_arrival", "Requests read after their deadline_ns "
                                          "and answered timeout without starting.", registry=r)
        self.pending_writes = Gauge("kvswap_pending_writes", "Records copied from the engine and not yet written.",
                                    registry=r)
        self.registered = Gauge("kvswap_registered", "1 while an engine cache is registered.", registry=r)
        self.registrations = Counter("kvswap_registrations", "Registrations accepted, and released by reason.",
                                     ["event"], registry=r)
        self.stored_records = Gauge("kvswap_stored_records", "Records stored, per tier, for the registered namespace.",
                                    ["tier"], registry=r)
        self.stored_bytes = Gauge("kvswap_stored_bytes", "Bytes on the storage medium, per tier, for the registered "
                                  "namespace.", ["tier"], registry=r)
        self.staging_slots = Gauge("kvswap_staging_slots", "Staging slots, by pool and state.", ["pool", "state"],
                                   registry=r)
        self.tier_ops = Counter("kvswap_tier_ops", "Record operations per tier: op get|put|promote; result "
                                "hit|miss|corrupt|unavailable|error for gets, ok or an error code for puts.",
                                ["tier", "op", "result"], registry=r)
        self.tier_latency = Histogram("kvswap_tier_op_duration_seconds", "Time of one record operation, per tier.",
                                      ["tier", "op"], buckets=LATENCY_BUCKETS, registry=r)
        self.tier_bytes = Counter("kvswap_tier_bytes", "Payload bytes read from or written to each tier.",
                                  ["tier", "direction"], registry=r)
        self.tier_healthy = Gauge("kvswap_tier_healthy", "1 while the tier is reachable (local tiers always are).",
                                  ["tier"], registry=r)
        open_fds = Gauge("kvswap_open_fds", "File descriptors the process has open.", registry=r)
        open_fds.set_function(fds.open_count)
        fd_limit = Gauge("kvswap_fd_limit", "The process's soft limit on open file descriptors (raised to the "
                         "hard limit at start-up).", registry=r)
        fd_limit.set_function(fds.soft_limit)
        self.http_refused = Counter("kvswap_http_refused", "Connections to the metrics port closed without an "
                                    "answer, or answered 431: reason evicted|limit|deadline|too_large.", ["reason"],
                                    registry=r)
        self.connections = Gauge("kvswap_connections", "Connections open on the control socket (handshake done).",
                                 registry=r)
        self.connections_refused = Counter("kvswap_connections_refused", "Control-socket handshakes refused "
                                           "because --max-connections were open.", registry=r)
        self.request_bytes = Gauge("kvswap_request_bytes_in_flight", "Bytes the decoded requests not yet "
                                   "answered hold (an upper bound), against --max-inflight-request-bytes.",
                                   registry=r)
        info = Gauge("kvswap_build_info", "Always 1; labels say which build runs.", ["version"], registry=r)
        info.labels(version=__version__).set(1)
        # process_* (RSS, CPU seconds, open and max fds, start time) of this process, read from
        # /proc at scrape time; the daemon's own registry does not get the global default's.
        ProcessCollector(registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, family: MetricWrapperBase, *values: str) -> Any:
        """``family.labels(*values)`` (label values in the family's order), remembered: each
        ``labels`` call takes the family's lock and builds its key, and the write threads count
        every record (label values are few: ops, tiers, status codes)."""
        key = (id(family), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = family.labels(*values)
        return found

    def count_blocks(self, op: str, statuses: Iterable[str]) -> None:
        """A request's per-key statuses, one increment per distinct status: a label lookup per
        key took 80 us of the event loop for 32 keys (2.5 ms for a request of 1,000)."""
        for status, n in collections.Counter(statuses).items():
            self.child(self.blocks, op, status).inc(n)

    def watch_stores(self, stores: Callable[[], list]) -> None:
        """Export the storage tiers' own counters (eviction, scan, capacity) at scrape time."""
        self.registry.register(StoreCollector(stores))

    def watch_kv_events(self, ledger: Any, publisher: Callable[[], Any]) -> None:
        """KV events' counts, read at scrape time (daemon/kv_events.py); ``publisher()`` is
        None until the daemon's start-up binds it."""
        def published(attr: str) -> Callable[[], float]:
            return lambda: getattr(publisher(), attr, 0)

        r = self.registry
        for name, help_text, read in (
                ("kvswap_kv_event_batches", "KV-event batches published (the next batch's sequence number).",
                 published("published")),
                ("kvswap_kv_events", "KV events published.", lambda: ledger.events),
                ("kvswap_kv_event_resets", "Times the event queue overflowed and a reset with the whole state "
                 "was published instead (should stay 0).", lambda: ledger.resets),
                ("kvswap_kv_event_replays", "Replay requests answered.", published("replays"))):
            Gauge(name, help_text, registry=r).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StoreCollector:
    """Reads each store's ``stats()`` when Prometheus scrapes, so the stores keep plain
    counters and need not know about Prometheus."""

    #: stats key -> (metric name, help, kind). Counters get ``_total`` from the client library.
    GAUGES = {
        "max_bytes": ("kvswap_store_capacity_bytes", "Configured cap on the tier's bytes (0: none)."),
        "free_bytes": ("kvswap_store_free_bytes", "Free bytes on the tier's file system."),
        "leader": ("kvswap_eviction_leader", "1 while this daemon is the one evicting for the namespace."),
        "scan_complete": ("kvswap_index_scan_complete", "1 once the start-up scan has indexed every record."),
        "scan_records": ("kvswap_index_scan_records", "Records the latest directory scan has counted so far."),
        "scan_seconds": ("kvswap_index_scan_seconds", "Duration of the start-up scan."),
        "stuck": ("kvswap_stuck_records", "Records that could not be deleted and are no longer offered for eviction."),
        "unreachable": ("kvswap_unreachable_records",
                        "Stored records no lookup can reach: their chain lost a record before them."),
    }
    COUNTERS = {
        "eviction_failures": ("kvswap_eviction_failures", "Records eviction could not delete."),
        "temp_reclaimed": ("kvswap_temp_files_reclaimed", "Temp files of dead writers removed at start-up."),
        "enospc_retries": ("kvswap_enospc_retries", "Writes that hit a full disk, evicted and retried."),
        "chain_refused": ("kvswap_chain_refused_records",
                          "swap_out records not written because the record before them in their chain was evicted."),
    }
    EVICTION_REASONS = ("capacity", "min_free", "enospc")

    def __init__(self, stores: Callable[[], list]) -> None:
        self.stores = stores

    def describe(self):
        return []  # collected lazily; the registry must not call collect() at registration

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauges = {k: GaugeMetricFamily(name, doc, labels=["tier"]) for k, (name, doc) in self.GAUGES.items()}
        counters = {k: CounterMetricFamily(name, doc, labels=["tier"]) for k, (name, doc) in self.COUNTERS.items()}
        evictions = CounterMetricFamily("kvswap_evictions", "Records evicted, by reason.", labels=["tier", "reason"])
        for store in self.stores():
            stats = store.stats()
            if "free_bytes" not in stats:
                free = store.free_bytes()
                if free is not None:
                    stats["free_bytes"] = free
            for key, gauge in gauges.items():
                if key in stats:
                    gauge.add_metric([store.tier], float(stats[key]))
            for key, counter in counters.items():
                counter.add_metric([store.tier], float(stats.get(key, 0)))
            for reason in self.EVICTION_REASONS:
                evictions.add_metric([store.tier, reason], float(stats.get(f"evicted_{reason}", 0)))
        yield from gauges.values()
        yield from counters.values()
        yield evictions


#: Limits of the metrics HTTP server. Prometheus and a kubelet need a handful of connections
#: at once; a peer that opens more, or sends its request slower than HEADER_DEADLINE_S, is
#: cut off so it cannot hold descriptors (1,100 slowloris connections used to take them all).
#: At the cap a new connection is still served: the oldest connection of the peer address
#: holding the most is closed to make room (see HealthServer), so idle connections cannot
#: starve the liveness probe.
MAX_HTTP_CONNECTIONS = 64
HEADER_DEADLINE_S = 5.0
#: Request line and headers together; past it the answer is 431 (a Prometheus scrape sends
#: about 300 bytes).
MAX_HEAD_BYTES = 64 * 1024
#: Time to hand a response to a peer that does not read it.
WRITE_DEADLINE_S = 5.0


class HeadTooLarge(Exception):
    pass


class HealthServer:
    """``/metrics``, ``/healthz`` (the process answers) and ``/readyz`` (it takes requests),
    on the daemon's own event loop, so a wedged loop shows as a failed probe.

    Each connection gets one request and is closed; the request line and headers must arrive
    within HEADER_DEADLINE_S and MAX_HEAD_BYTES. At most MAX_HTTP_CONNECTIONS are open at once,
    and none that would leave fewer than ``fds.RESERVE`` descriptors free. A new connection
    past either limit is not the one refused: the oldest open connection of the peer address
    that holds the most is closed instead (``reason="evicted"``), so a peer that fills the port
    with idle connections (a liveness probe used to get 0 answers in 20 with 70 held) only ever
    pushes out its own, and on a shared address (loopback) the oldest first, whose header
    deadline was nearest anyway. A new connection is refused only when there is nothing to
    evict (the descriptors went elsewhere)."""

    def __init__(self, metrics: Metrics, ready: Callable[[], bool], budget: fds.FdBudget | None = None) -> None:
        self.metrics = metrics
        self.ready = ready
        self.budget = budget or fds.FdBudget()
        #: Open connections, oldest first: writer -> (peer address, the task serving it).
        self._open: dict[asyncio.StreamWriter, tuple[str, asyncio.Task | None]] = {}
        self._server: asyncio.base_events.Server | None = None

    @property
    def active(self) -> int:
        return len(self._open)

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True,
                                                  limit=MAX_HEAD_BYTES)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):  # connections still open end now
                writer.transport.abort()
            await self._server.wait_closed()

    def _evict(self) -> bool:
        """Close the oldest connection of the peer address holding the most; False if none is open."""
        if not self._open:
            return False
        counts: dict[str, int] = {}
        for address, _ in self._open.values():
            counts[address] = counts.get(address, 0) + 1
        heaviest = max(counts.values())
        victim = next(w for w, (address, _) in self._open.items() if counts[address] == heaviest)
        _, task = self._open.pop(victim)
        self.metrics.http_refused.labels(reason="evicted").inc()
        victim.transport.abort()
        if task is not None:
            task.cancel()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= MAX_HTTP_CONNECTIONS or not self.budget.room():
            if not self._evict():
                self.metrics.http_refused.labels(reason="limit").inc()
                writer.transport.abort()  # no answer: answering costs what the limit saves
                return
        peer = writer.get_extra_info("peername")
        self._open[writer] = (str(peer[0]) if isinstance(peer, tuple) and peer else "", asyncio.current_task())
        try:
            try:
                method, path = await asyncio.wait_for(self._read_head(reader), HEADER_DEADLINE_S)
            except HeadTooLarge:
                self.metrics.http_refused.labels(reason="too_large").inc()
                await self._respond(writer, "GET", ("431 Request Header Fields Too Large", "text/plain",
                                                    b"request line and headers over 64 KiB\n"))
                return
            except asyncio.TimeoutError:
                self.metrics.http_refused.labels(reason="deadline").inc()
                return
            await self._respond(writer, method, self._route(method, path))
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        except asyncio.CancelledError:
            pass  # evicted, or the server is closing; this connection task ends here, quietly
        finally:
            self._open.pop(writer, None)  # gone already if it was evicted
            writer.close()

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, str]:
        """The method and path of one request; the headers are read and dropped."""
        total = 0
        request_line = b""
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # one line over the reader's limit (MAX_HEAD_BYTES)
                raise HeadTooLarge() from None
            total += len(line)
            if total > MAX_HEAD_BYTES:
                raise HeadTooLarge()
            if not request_line:
                request_line = line
                if not line:
                    break
            elif line in (b"\r\n", b"\n", b""):
                break
        parts = request_line.decode("latin-1").split()
        path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
        return (parts[0] if parts else ""), path

    async def _respond(self, writer: asyncio.StreamWriter, method: str, answer: tuple[str, str, bytes]) -> None:
        if writer.transport.is_closing():
            # Evicted (a cancellation that raced the end of the read is not always delivered:
            # 3.11's wait_for can return the result instead), or the peer is gone.
            return
        status, ctype, body = answer
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        writer.write(head + (body if method != "HEAD" else b""))
        await asyncio.wait_for(writer.drain(), WRITE_DEADLINE_S)

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self.metrics.render()
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            if self.ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"not ready\n"
        return "404 Not Found", "text/plain", b"not found\n"
