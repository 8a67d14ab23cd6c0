"""The daemon process: ``startup -> serve -> drain -> shutdown``.

The daemon owns the lifecycle: the control socket, the metrics server, the swapper and the
background loops. Requests are the dispatcher's (dispatch.py: receive, one answer each) and
the ops' (ops.py: what each does). Signals (SIGTERM, SIGINT, SIGHUP) only set a flag; the
loop notices it, stops taking new work (new requests get ``unavailable``), lets in-flight
requests and writes finish for up to ``drain_timeout_s``, then exits 0. A second signal cuts
the drain short: requests still running are answered ``unavailable``, records not yet written
are dropped (the directory stays as consistent as after SIGKILL), and the process exits
``EXIT_FORCED``. The signal handlers in place before the daemon started are restored when it
stops.

ZMQ's memory per connection is bounded by RCV_HWM frames in and SND_HWM replies of at most
MAX_REPLY_BYTES out, and over all connections by ``max_connections`` (connections.py) and
``max_inflight_request_bytes`` of decoded requests (admission.py); numbers in
docs/security.md.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import stat
import sys
import time
from typing import Any

import zmq
import zmq.asyncio

from kvswap import __version__
from kvswap.backends.events import NO_EVENTS
from kvswap.backends.file_backend import FileBackend
from kvswap.protocol.limits import MAX_MESSAGE_BYTES

from . import fds
from .admission import RequestBudget
from .config import Config, is_loopback
from .connections import ConnectionGate
from .curve import CurveError, CurveServer
from .dispatch import Dispatcher
from .kv_events import EventLedger, EventPublisher, describe_for_stats
from .metrics import HealthServer, Metrics
from .ops import Ops
from .peer import PeerTransfer
from .peer_stats import PeerStats
from .peer_transport import TransportError
from .signals import SignalCapture
from .swapper import Swapper
from .tiers import open_backends, unready_locations

log = logging.getLogger("kvswap.daemon")

#: Exit codes of ``run``.
EXIT_OK = 0
EXIT_STARTUP_FAILED = 3
#: A second signal cut the drain short.
EXIT_FORCED = 4
#: How long shutdown keeps the socket open after answering requests it cut short (see shutdown).
SHUTDOWN_REPLY_FLUSH_S = 0.25

#: Frames queued per connection before ZMQ stops reading that peer (TCP then holds it back).
#: The receive loop takes a frame as soon as it can, so only a peer sending faster than its
#: frames are answered fills it. ZMQ holds up to RCV_HWM + 2 frames of a connection (the
#: queue, the one its reader has decoded and cannot queue, the one the socket has taken):
#: 16 MiB at 4 MiB a frame, times --max-connections. (It was 10,000: 40 GB of 4 MiB frames;
#: then 16, which with six connections was 100 MB of swap_out frames.) Measured: 250
#: pipelined pings take the same time at 2 as at 16, within the noise of a 2-core machine.
RCV_HWM = 2
#: Replies queued per connection for a peer that does not read them; past it ZMQ drops them.
#: A client's own socket takes up to 1,000 replies before this queue fills at all, so only a
#: peer that stopped reading reaches it. 256 is the default per-client in-flight limit, so a
#: client within it never loses a reply here. What the queue holds in bytes is bounded by the
#: connection's share of --max-inflight-request-bytes instead (admission.py): replies of 4 KiB
#: or more are tracked, and a connection whose unsent replies fill its share is answered busy.
#: (Lowered to 16, a burst of 250 pipelined pings lost replies on a busy 2-core machine.)
SND_HWM = 256
#: Kernel send buffer per connection; replies are small, so it need not be large.
SND_BUF = 256 * 1024


class StartupError(Exception):
    """A start-up failure with a one-line reason for the operator."""


class Daemon:
    def __init__(self, config: Config) -> None:
        config.validate()
        self.config = config
        self.metrics = Metrics()
        self.backends = open_backends(config)
        #: The file tier: the daemon always has one; its directory is the daemon's storage dir.
        file_tier = self.backends["file"]
        assert isinstance(file_tier, FileBackend)
        self.file_backend: FileBackend = file_tier
        #: KV events (kv_events.py): the ledger stores report to, and its publisher (startup).
        self.kv_events = EventLedger() if config.kv_events_endpoint else None
        self.kv_publisher: EventPublisher | None = None
        self._events_ctx: zmq.Context | None = None
        if self.kv_events is not None:
            self.metrics.watch_kv_events(self.kv_events, lambda: self.kv_publisher)
        self.swapper = Swapper(config, self.backends, config.locations(), self.metrics,
                               events=self.kv_events or NO_EVENTS)
        self.health = HealthServer(self.metrics, ready=self.ready)
        #: Tiers /readyz last found unable to serve (logged when it changes).
        self._unready: list[str] = []
        #: Set by the first signal (or ``request_exit``): drain and stop.
        self.should_exit = False
        #: Set by a second signal: stop now.
        self.force_exit = False
        self._signals = SignalCapture(self.handle_signal)
        self.started = time.time()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        #: Bytes the decoded requests in flight hold, in all and per connection (admission.py).
        self.budget = RequestBudget(config.max_inflight_request_bytes,
                                    config.max_inflight_request_bytes * config.max_inflight_per_client
                                    // config.max_inflight_requests, self.metrics.request_bytes)
        #: Daemon-to-daemon transfer for prefill/decode disaggregation (peer.py), when configured.
        # Its series exist, at zero, with peer transfer off too: dashboards need not special-case it.
        peer_stats = PeerStats(self.metrics.registry)
        self.peer = PeerTransfer(config, self.swapper, peer_stats) if config.peer_address else None
        self.ops = Ops(config, self.swapper, self.describe, self.peer)
        self.dispatcher = Dispatcher(config, self.metrics, self.budget, self.ops.handle, self.ops.answer_now)
        #: The cap on the control socket's connections (connections.py), set up in startup.
        self.gate: ConnectionGate | None = None
        self._stop_event: asyncio.Event | None = None
        self._force_event: asyncio.Event | None = None
        self.curve = (CurveServer(config.curve_secret_key_file, config.authorized_keys, self.metrics.registry)
                      if config.curve else None)
        self.control_port = config.cache_queue_port
        #: Set once start-up succeeded: a failed start-up says only why, not "stopped".
        self._started = False

    @property
    def serving(self) -> bool:
        """Taking requests: from the end of start-up until the drain begins."""
        return self.dispatcher.serving

    @property
    def _requests(self) -> set[asyncio.Task]:
        return self.dispatcher.requests

    def describe(self) -> dict[str, Any]:
        """The daemon's own part of ``stats``."""
        return {"version": __version__, "uptime_s": round(time.time() - self.started, 3),
                "requests_in_flight": len(self.dispatcher.requests), "storage_dir": self.file_backend.root,
                "fsync": self.config.fsync, "metrics_port": self.health.port,
                "metrics_host": self.config.metrics_bind_host,
                "open_fds": fds.open_count(), "fd_limit": fds.soft_limit(),
                "kv_events": describe_for_stats(self.kv_events, self.kv_publisher)}

    def ready(self) -> bool:
        """/readyz: serving, and every store and retrieve location can serve, unless
        ``ready_when_degraded``. A change is logged once, naming the tiers."""
        if not self.serving:
            return False
        unready = unready_locations(self.backends, self.swapper.locations)
        if unready != self._unready:
            self._unready = unready
            if unready:
                log.warning("not ready: location(s) %s cannot serve%s", ", ".join(unready),
                            " (ready anyway: ready_when_degraded)" if self.config.ready_when_degraded else "")
            else:
                log.info("ready: every store and retrieve location can serve")
        return self.config.ready_when_degraded or not unready

    # -- the three phases ---------------------------------------------------------------------------

    async def serve(self) -> None:
        self._stop_event = asyncio.Event()
        self._force_event = asyncio.Event()
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        cfg = self.config
        fd_limit = fds.raise_soft_limit()
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)  # ZMQ drops larger frames itself
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SNDHWM, SND_HWM)
        sock.setsockopt(zmq.SNDBUF, SND_BUF)
        if ":" in cfg.host:
            sock.setsockopt(zmq.IPV6, 1)  # ZMQ binds IPv6 addresses only with this set
        # Before bind: every handshake is counted, and refused past --max-connections, by ZAP.
        self.gate = ConnectionGate(cfg.max_connections, self.metrics)
        self.gate.watch(self._ctx, sock)
        if self.curve is None:
            self.gate.gate_null_mechanism(self._ctx, sock)
        else:
            try:
                self.curve.prepare(self._ctx, sock, self.gate)  # before bind: no connection without a handshake
            except CurveError as exc:
                sock.close(0)
                raise StartupError(str(exc)) from None
            except BaseException:
                sock.close(0)  # an open socket would hang the context's term() in shutdown
                raise
        try:
            sock.bind(f"tcp://{_zmq_host(cfg.host)}:{cfg.cache_queue_port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise StartupError(f"cannot bind the cache-queue port {cfg.host}:{cfg.cache_queue_port}: {reason}") from None
        self._sock = self.dispatcher.sock = sock
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.control_port = int(endpoint.rsplit(":", 1)[1])
        self._start_kv_events()
        try:
            await self.health.start(cfg.metrics_bind_host, cfg.metrics_port)
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise StartupError(f"cannot bind the metrics port {cfg.metrics_bind_host}:{cfg.metrics_port}: "
                               f"{reason}") from None
        # After the binds, which log nothing: the storage check logs its O_DIRECT finding, and a
        # start-up that fails prints one line, its reason.
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.file_backend.check_writable)
        except OSError as exc:
            raise StartupError(f"storage directory {self.file_backend.root} cannot be used: {exc.strerror or exc}") from None
        _warn_if_writable_by_others(self.file_backend.root)
        if not is_loopback(cfg.host) and self.curve is None:
            log.warning("the control socket listens on %s, beyond loopback, without authentication: anyone who "
                        "reaches it can read and overwrite cached KV blocks", cfg.host)
        if self.peer is not None:
            try:
                self.peer.start()
            except (TransportError, CurveError) as exc:
                raise StartupError(f"peer transfer cannot start: {exc}") from None
        self.swapper.start()
        self._signals.install()
        self.dispatcher.serving = True
        self._started = True
        endpoint = f"tcp://{_zmq_host(cfg.host)}:{self.control_port}"
        metrics_url = f"http://{_zmq_host(cfg.metrics_bind_host)}:{self.health.port}/metrics"
        log.info("kvswapd %s serving %s, metrics %s, storage %s (fsync=%s)", __version__, endpoint, metrics_url,
                 self.file_backend.root, cfg.fsync, extra={"version": __version__, "endpoint": endpoint,
                                                      "metrics_url": metrics_url, "storage_dir": self.file_backend.root,
                                                      "fsync": cfg.fsync})
        log.info("open-files limit %d (%d open, %d kept in reserve)", fd_limit, fds.open_count(), fds.RESERVE)
        locations = self.swapper.locations
        log.info("tiers: %s; store to %s; retrieve from %s%s", ", ".join(
            b.url or (self.file_backend.root if b is self.file_backend else name) for name, b in self.backends.items()),
            ",".join(locations.store), ",".join(locations.retrieve), "; promote to host" if locations.promote else "")

    def request_exit(self) -> None:
        """Drain and stop (what the first signal does)."""
        self.should_exit = True
        if self._stop_event is not None:
            self._stop_event.set()

    def handle_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.warning("%s again: cutting the drain short (%d requests in flight, %d records not yet written)",
                        name, len(self._requests), self.swapper.pending_writes)
            self.force_exit = True
            if self._force_event is not None:
                self._force_event.set()
        else:
            log.info("%s: draining; send it again to stop at once", name)
            self.request_exit()

    async def main_loop(self) -> None:
        assert self._sock is not None and self._stop_event is not None
        watcher = asyncio.ensure_future(self._watch_engine())
        maintainer = asyncio.ensure_future(self._maintain())
        receiver = asyncio.ensure_future(self.dispatcher.receive())
        try:
            await self._stop_event.wait()
        finally:
            watcher.cancel()
            maintainer.cancel()
            # Owned until they end: a timer loop mid-check finishes cancelling before the drain.
            await asyncio.gather(watcher, maintainer, return_exceptions=True)
        log.info("draining: %d requests in flight, %d records waiting to be written", len(self._requests),
                 self.swapper.pending_writes)
        self.dispatcher.serving = False
        # The receiver keeps answering while we drain, with 'unavailable' for new requests.
        assert self._force_event is not None
        drain = asyncio.ensure_future(self._drain())
        forced = asyncio.ensure_future(self._force_event.wait())
        await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not drain.done():
            drain.cancel()  # _drain shields the writes: cancelling it only stops the waiting
        receiver.cancel()
        await asyncio.gather(receiver, drain, forced, return_exceptions=True)
        if self.force_exit:
            log.warning("drain cut short: %d requests did not finish, %d records were not written",
                        len(self._requests), self.swapper.pending_writes)
        elif not drain.result():
            log.warning("drain timeout: %d requests did not finish", len(self._requests))

    async def _drain(self) -> bool:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.wait(list(self._requests), timeout=max(0.0, deadline - time.monotonic()))
        try:
            # Shielded: on timeout wait_for cancels what it waits for, and cancelling flush's
            # gather would cancel the write tasks themselves, releasing staging slots that a
            # write thread is still reading.
            await asyncio.wait_for(asyncio.shield(self.swapper.flush()), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d records were not written", self.swapper.pending_writes)
            return False
        return not self._requests

    def _start_kv_events(self) -> None:
        cfg = self.config
        if self.kv_events is None:
            return
        # A context of its own, not the loop's asyncio one: only the publisher's thread uses it.
        self._events_ctx = zmq.Context()
        try:
            self.kv_publisher = EventPublisher(self.kv_events, self._events_ctx, cfg.kv_events_endpoint,
                                               cfg.kv_events_replay_endpoint, cfg.kv_events_topic,
                                               cfg.kv_events_buffer_bytes, cfg.kv_events_encoding)
        except zmq.ZMQError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise StartupError(f"cannot bind the KV events endpoints {cfg.kv_events_endpoint} "
                               f"{cfg.kv_events_replay_endpoint}: {reason}") from None
        self.kv_publisher.start()

    async def shutdown(self) -> None:
        self.dispatcher.serving = False
        unfinished = list(self._requests)
        for task in unfinished:
            task.cancel()
        if unfinished:
            # Let each cancelled request send its 'unavailable' before the socket closes.
            await asyncio.wait(unfinished, timeout=5)
            log.warning("shutdown: answered %d unfinished requests with unavailable", len(unfinished))
        refused = self.dispatcher.refuse_queued() if self._sock is not None else 0
        if unfinished or refused:
            # libzmq can drop a message sent just before its socket closes, LINGER or not
            # (libzmq #1264, #1922): a request cut short by a second signal got its
            # 'unavailable' sent and never delivered in 4 of 20 forced exits under load. Give
            # its I/O thread a moment to hand the last answers to the kernel (0 lost in 60).
            await asyncio.sleep(SHUTDOWN_REPLY_FLUSH_S)
        if self.peer is not None:
            await self.peer.stop()  # before the swapper: its pulls store through it
        if not self.force_exit:
            # Waits for the copy and write threads; a forced exit does not (see run()).
            await self.swapper.stop()
        if self.kv_publisher is not None:
            # After the writes: what the drain stored is published before the sockets close.
            await asyncio.get_running_loop().run_in_executor(None, self.kv_publisher.stop)
        if self._events_ctx is not None:
            self._events_ctx.term()
        await self.health.close()
        if self._sock is not None:
            self._sock.close(linger=2000)
        if self.gate is not None:
            await self.gate.stop()
        if self.curve is not None:
            self.curve.close()
        if self._ctx is not None:
            self._ctx.term()
        self._signals.restore()
        if self._started:
            log.info("kvswapd stopped")

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(self.config.engine_check_interval_s)
            try:
                await self.swapper.check_engine()
            except Exception:
                log.exception("engine check failed")

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                await self.swapper.maintain()
            except Exception:
                log.exception("storage maintenance failed")


def _warn_if_writable_by_others(root: str) -> None:
    """Anyone who can write into the storage directory can plant records the engine will load
    (checksums detect accidents, not forgery). The daemon creates it 0700; a directory made
    by someone else with looser modes is served, with a warning."""
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return
    if mode & 0o022:
        log.warning("the storage directory %s is writable by %s (mode %04o): whoever can write there can plant "
                    "records that engines will load; chmod 700 it", root,
                    "everyone" if mode & 0o002 else "its group", stat.S_IMODE(mode))


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def run(config: Config) -> int:
    """Run a daemon until SIGTERM/SIGINT. Returns the process exit code."""
    uvloop: Any
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; a missing wheel still runs
        uvloop = None
    # The receive loop shares the GIL with copy and I/O threads. Python hands the GIL over
    # every 5 ms by default, which would put 5 ms stalls into a ping's answer while a swap
    # runs; 0.5 ms keeps the loop responsive at a small cost in thread throughput.
    sys.setswitchinterval(0.0005)
    daemon = Daemon(config)
    try:
        if uvloop is not None:
            uvloop.run(daemon.serve())
        else:
            asyncio.run(daemon.serve())
    except StartupError as exc:
        log.error("start-up failed: %s", exc, extra={"exit_code": EXIT_STARTUP_FAILED})
        return EXIT_STARTUP_FAILED
    if daemon.force_exit:
        # Copy and write threads may still run (a write stuck on a dead NFS server is why an
        # operator signals twice); the interpreter would wait for them at exit. Leave now.
        log.warning("kvswapd exits without waiting for its I/O threads")
        logging.shutdown()
        os._exit(EXIT_FORCED)
    return EXIT_OK
