"""The daemon process: ``startup -> serve -> drain -> shutdown``.

The receive loop only reads frames and starts one task per request; every task ends in
exactly one reply — its result, a typed error, or ``timeout`` at its deadline. Signals
(SIGTERM, SIGINT, SIGHUP) only set a flag; the loop notices it, stops taking new work (new
requests get ``unavailable``), lets in-flight requests and writes finish for up to
``drain_timeout_s``, then exits 0. A second signal cuts the drain short: requests still
running are answered ``unavailable``, records not yet written are dropped (the directory stays
as consistent as after SIGKILL), and the process exits ``EXIT_FORCED``. The signal handlers
in place before the daemon started are restored when it stops.

What one peer can make the daemon hold or spend is bounded (numbers in docs/security.md): the
loop's time per frame by the protocol's shape limits and one frame handed on per read, so a
flood delays another peer's request by about one frame; ZMQ's memory per connection by
RCV_HWM frames in and SND_HWM replies of at most MAX_REPLY_BYTES out, and over all
connections by ``max_connections`` (connections.py) and ``max_inflight_request_bytes`` of
decoded requests (admission.py).

(Over 500 lines: the three phases, the receive loop and the op handlers share one Daemon's
state; signals, descriptors, metrics and CURVE live in their own modules.)
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import signal
import stat
import sys
import time
import weakref
from typing import Any, Awaitable, Callable

import zmq
import zmq.asyncio

from kvswap import __version__
from kvswap.protocol import messages as m
from kvswap.protocol.errors import Busy, Internal, InvalidLayout, KvswapError, Timeout, Unavailable
from kvswap.protocol.layout import CacheLayout
from kvswap.protocol.limits import (
    MAX_KEYS_PER_REQUEST,
    MAX_KEY_LENGTH,
    MAX_MESSAGE_BYTES,
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
)

from . import fds
from .config import Config
from .admission import TRACK_REPLY_BYTES, RequestBudget, request_bytes
from .connections import ConnectionGate
from .curve import CurveError, CurveServer
from .metrics import HealthServer, Metrics
from .registrar import Caller
from .signals import SignalCapture
from .staging import slot_bytes_for
from .deadline import Deadline
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
        self.backend = self.backends["file"]
        self.swapper = Swapper(config, self.backends, config.locations(), self.metrics)
        self.health = HealthServer(self.metrics, ready=self.ready)
        self.serving = False
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
        self._requests: set[asyncio.Task] = set()
        #: Requests in flight per client connection (ZMQ identity); entries go at zero.
        self._per_client: dict[bytes, int] = {}
        #: Bytes the decoded requests in flight hold, in all and per connection (admission.py).
        self.budget = RequestBudget(config.max_inflight_request_bytes,
                                    config.max_inflight_request_bytes * config.max_inflight_per_client
                                    // config.max_inflight_requests, self.metrics.request_bytes)
        #: The cap on the control socket's connections (connections.py), set up in startup.
        self.gate: ConnectionGate | None = None
        self._stop_event: asyncio.Event | None = None
        self._force_event: asyncio.Event | None = None
        self.curve = (CurveServer(config.curve_secret_key_file, config.authorized_keys, self.metrics.registry)
                      if config.curve else None)
        self.control_port = config.cache_queue_port
        #: Set once start-up succeeded: a failed start-up says only why, not "stopped".
        self._started = False

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
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise StartupError(f"cannot bind the cache-queue port {cfg.host}:{cfg.cache_queue_port}: {reason}") from None
        self._sock = sock
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.control_port = int(endpoint.rsplit(":", 1)[1])
        try:
            await self.health.start(cfg.metrics_bind_host, cfg.metrics_port)
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise StartupError(f"cannot bind the metrics port {cfg.metrics_bind_host}:{cfg.metrics_port}: "
                               f"{reason}") from None
        # After the binds, which log nothing: the storage check logs its O_DIRECT finding, and a
        # start-up that fails prints one line, its reason.
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.backend.check_writable)
        except OSError as exc:
            raise StartupError(f"storage directory {self.backend.root} cannot be used: {exc.strerror or exc}") from None
        _warn_if_writable_by_others(self.backend.root)
        if not _is_loopback(cfg.host) and self.curve is None:
            log.warning("the control socket listens on %s, beyond loopback, without authentication: anyone who "
                        "reaches it can read and overwrite cached KV blocks", cfg.host)
        self.swapper.start()
        self._signals.install()
        self.serving = True
        self._started = True
        endpoint = f"tcp://{_zmq_host(cfg.host)}:{self.control_port}"
        metrics_url = f"http://{_zmq_host(cfg.metrics_bind_host)}:{self.health.port}/metrics"
        log.info("kvswapd %s serving %s, metrics %s, storage %s (fsync=%s)", __version__, endpoint, metrics_url,
                 self.backend.root, cfg.fsync, extra={"version": __version__, "endpoint": endpoint,
                                                      "metrics_url": metrics_url, "storage_dir": self.backend.root,
                                                      "fsync": cfg.fsync})
        log.info("open-files limit %d (%d open, %d kept in reserve)", fd_limit, fds.open_count(), fds.RESERVE)
        locations = self.swapper.locations
        log.info("tiers: %s; store to %s; retrieve from %s%s", ", ".join(
            b.url or (self.backend.root if b is self.backend else name) for name, b in self.backends.items()),
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
        receiver = asyncio.ensure_future(self._receive())
        try:
            await self._stop_event.wait()
        finally:
            watcher.cancel()
            maintainer.cancel()
        log.info("draining: %d requests in flight, %d records waiting to be written", len(self._requests),
                 self.swapper.pending_writes)
        self.serving = False
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

    async def shutdown(self) -> None:
        self.serving = False
        unfinished = list(self._requests)
        for task in unfinished:
            task.cancel()
        if unfinished:
            # Let each cancelled request send its 'unavailable' before the socket closes.
            await asyncio.wait(unfinished, timeout=5)
            log.warning("shutdown: answered %d unfinished requests with unavailable", len(unfinished))
        refused = self._refuse_queued() if self._sock is not None else 0
        if unfinished or refused:
            # libzmq can drop a message sent just before its socket closes, LINGER or not
            # (libzmq #1264, #1922): a request cut short by a second signal got its
            # 'unavailable' sent and never delivered in 4 of 20 forced exits under load. Give
            # its I/O thread a moment to hand the last answers to the kernel (0 lost in 60).
            await asyncio.sleep(SHUTDOWN_REPLY_FLUSH_S)
        if not self.force_exit:
            # Waits for the copy and write threads; a forced exit does not (see run()).
            await self.swapper.stop()
        await self.health.close()
        if self._sock is not None:
            self._sock.close(linger=2000)
        if self.gate is not None:
            self.gate.close()
        if self.curve is not None:
            self.curve.close()
        if self._ctx is not None:
            self._ctx.term()
        self._signals.restore()
        if self._started:
            log.info("kvswapd stopped")

    # -- requests -----------------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue  # a ROUTER always prefixes the peer identity; nothing to answer to
            # The payload is read in place (a memoryview of ZMQ's buffer), not copied: a copy
            # doubled what a 4 MiB frame costs in memory and time.
            envelope, payload = [f.bytes for f in frames[:-1]], frames[-1].buffer
            if not self.serving:
                self._send(envelope, m.Reply(m.peek_id(payload), False, error=Unavailable("the daemon is shutting down")))
                continue
            if len(self._requests) >= self.config.max_inflight_requests:
                self._send(envelope, m.Reply(m.peek_id(payload), False, error=Busy(
                    "too many requests in flight", limit=self.config.max_inflight_requests)))
                self._count_refusal()
                continue
            client = envelope[0]
            held = self._per_client.get(client, 0)
            if held >= self.config.max_inflight_per_client:
                # One engine (or a runaway loop in it) must not take every slot from the others.
                self._send(envelope, m.Reply(m.peek_id(payload), False, error=Busy(
                    "too many requests in flight from this client", limit=self.config.max_inflight_per_client)))
                self._count_refusal()
                continue
            if self.budget.full(client):  # refused before it is decoded: it costs nothing to hold
                self._send(envelope, m.Reply(m.peek_id(payload), False, error=Busy(
                    "too many request bytes in flight", limit=self.budget.limit)))
                self._count_refusal()
                continue
            self._per_client[client] = held + 1
            task = asyncio.ensure_future(self._answer(envelope, payload))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
            task.add_done_callback(lambda _, c=client: self._client_done(c))
            del frames, payload  # the task holds the frame only until it is decoded
            # Let the task decode its frame (and a ping answer) before the next frame is read:
            # a receive completes at once while frames are queued, so without this yield a
            # flood of frames became tasks ahead of everyone else's (a ping waited 5 s).
            await asyncio.sleep(0)

    def _count_refusal(self) -> None:
        """A request refused before decoding (in-flight limits) still counts as a request, so
        the busy ratio's denominator is right."""
        self.metrics.requests.labels(op="any", outcome="error").inc()
        self.metrics.errors.labels(op="any", code="busy").inc()

    def _client_done(self, client: bytes) -> None:
        held = self._per_client.get(client, 0) - 1
        if held > 0:
            self._per_client[client] = held
        else:
            self._per_client.pop(client, None)

    def _refuse_queued(self) -> int:
        """Answer the frames still queued on the socket after the receiver stopped; how many."""
        assert self._sock is not None
        answered = 0
        while True:
            pending = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            if pending.exception() is not None:  # zmq.Again: nothing left (or the socket is gone)
                return answered
            frames = pending.result()
            if len(frames) >= 2:
                answered += 1
                self._send(frames[:-1], m.Reply(m.peek_id(frames[-1]), False,
                                                error=Unavailable("the daemon is shutting down")))

    async def _answer(self, envelope: list[bytes], payload: memoryview) -> None:
        """Exactly one reply per request, whatever happens: result, typed error, ``internal``
        for a bug, ``unavailable`` when shutdown cancels it."""
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        op = "invalid"
        request_id: int | None = None
        try:
            size = len(payload)
            try:
                request = m.decode_request(payload)
            except m.DecodeError as exc:
                op = exc.op or op  # a bad key in a lookup is counted as a lookup
                log.info("bad %s frame (%d bytes): %s: %s", op, size, exc.error.code, exc.error.message)
                reply = m.Reply(exc.request_id, False, error=exc.error)
            else:
                del payload  # a request waiting for its answer holds its decoded fields, not its frame
                op, request_id = request.op, request.id
                client, charge = envelope[0], request_bytes(request)
                if not self.budget.take(client, charge):
                    reply = m.Reply(request_id, False, error=Busy("too many request bytes in flight",
                                                                  limit=self.budget.limit))
                else:
                    # Given back when the decoded request is freed, not at its answer: work that
                    # runs on past its deadline still holds it.
                    weakref.finalize(request, self.budget.give, client, charge)
                    reply = await self._dispatch(request)
                    if reply.error is not None:
                        # Raised out of the work task by work.result(), the error's traceback holds
                        # _dispatch's frame, which holds the task, which holds the error: a cycle
                        # that kept every refused request's decoded keys until the cyclic GC ran.
                        reply.error.__traceback__ = None
        except asyncio.CancelledError:
            self._reply(envelope, op, started, m.Reply(request_id, False, error=Unavailable(
                "the daemon shut down before this request finished")))
            raise
        except Exception as exc:  # a bug outside the handler: still answer
            log.exception("request %s (%s) failed", request_id, op)
            reply = m.Reply(request_id, False, error=Internal(f"{type(exc).__name__}: {exc}"[:500]))
        finally:
            self.metrics.in_flight.dec()
        self._reply(envelope, op, started, reply)

    def _reply(self, envelope: list[bytes], op: str, started: float, reply: m.Reply) -> None:
        self._send(envelope, reply)
        self.metrics.requests.labels(op=op, outcome="ok" if reply.ok else "error").inc()
        if not reply.ok and reply.error is not None:
            self.metrics.errors.labels(op=op, code=reply.error.code).inc()
        self.metrics.latency.labels(op=op).observe(time.perf_counter() - started)

    async def _dispatch(self, request: m.Request) -> m.Reply:
        timeout_ms = request.timeout_ms or self.config.default_timeout_ms
        deadline = Deadline(timeout_ms / 1000)
        work = asyncio.ensure_future(self._handler(request)(request, deadline))
        try:
            done, _ = await asyncio.wait({work}, timeout=deadline.remaining())
        except asyncio.CancelledError:
            # Shutdown: the caller answers 'unavailable'. The work is not cancelled (its copy
            # threads cannot be); it stops touching engine memory and finishes on its own. The
            # answer waits until its copies have stopped (deadline.py).
            work.add_done_callback(_log_late_failure)
            await self._stop_copies(deadline)
            raise
        if not done:
            # Stop the copies, then answer; the work cleans up after itself.
            work.add_done_callback(_log_late_failure)
            await self._stop_copies(deadline)
            log.warning("%s %d missed its deadline of %d ms", request.op, request.id, timeout_ms)
            return m.Reply(request.id, False, error=Timeout(f"{request.op} did not finish within {timeout_ms} ms",
                                                            timeout_ms=timeout_ms))
        try:
            return m.Reply(request.id, True, work.result())
        except KvswapError as exc:
            if exc.code not in ("not_registered", "busy"):
                log.info("%s %d failed: %s: %s", request.op, request.id, exc.code, exc.message)
            return m.Reply(request.id, False, error=exc)
        except Exception as exc:  # a bug: still answer, so the engine never waits forever
            log.exception("%s %d raised", request.op, request.id)
            return m.Reply(request.id, False, error=Internal(f"{type(exc).__name__}: {exc}"[:500]))

    async def _stop_copies(self, deadline: Deadline) -> None:
        """No byte moves from or into the engine's memory for a request after its answer:
        stop its copies and wait for the one in progress to end (at its next row) first."""
        if not await asyncio.shield(deadline.stop()):
            self.metrics.late_copies.inc()

    def _handler(self, request: m.Request) -> Callable[[Any, Deadline], Awaitable[dict[str, Any]]]:
        return self._handlers[request.op]

    @property
    def _handlers(self) -> dict[str, Callable[[Any, Deadline], Awaitable[dict[str, Any]]]]:
        s = self.swapper
        return {
            "hello": self._hello,
            "ping": self._ping,
            "register": self._register,
            "unregister": self._unregister,
            "swap_out": lambda r, d: s.swap_out(r.block_ids, r.keys, r.wait, d, r.partial, Caller(r.token, r.pid)),
            "swap_in": lambda r, d: s.swap_in(r.keys, r.block_ids, d, Caller(r.token, r.pid)),
            "lookup": lambda r, d: s.lookup(r.keys),
            "delete": lambda r, d: s.delete(r.keys),
            "clear": lambda r, d: s.clear(),
            "flush": lambda r, d: s.flush(),
            "stats": self._stats,
        }

    async def _hello(self, request: m.Hello, deadline: Deadline) -> dict[str, Any]:
        return {"server": "kvswapd", "version": __version__, "protocol": PROTOCOL_VERSION,
                "registered": self.swapper.registration is not None,
                "limits": {"max_message_bytes": MAX_MESSAGE_BYTES, "max_keys_per_request": MAX_KEYS_PER_REQUEST,
                           "max_key_length": MAX_KEY_LENGTH}}

    async def _ping(self, request: m.Ping, deadline: Deadline) -> dict[str, Any]:
        return {"pong": True}

    async def _register(self, request: m.Register, deadline: Deadline) -> dict[str, Any]:
        # Before anything is mapped or allocated: staging holds at least one whole record per
        # pool, so a layout with huge records (over a sparse segment that costs its sender
        # nothing) would make the daemon allocate and touch that much memory twice over.
        layout = CacheLayout.from_wire(request.layout)
        slot = slot_bytes_for(layout.record_bytes)
        budget = min(self.config.write_staging_bytes, self.config.read_staging_bytes)
        if slot > budget:
            raise InvalidLayout(f"a record of {layout.record_bytes} bytes does not fit in the staging memory of "
                                f"{budget} bytes; raise --write-staging-bytes and --read-staging-bytes",
                                record_bytes=layout.record_bytes, staging_bytes=budget)
        return await self.swapper.registrar.register(request.layout, request.handles, request.regions, request.pid)

    async def _unregister(self, request: m.Unregister, deadline: Deadline) -> dict[str, Any]:
        return {"released": await self.swapper.registrar.unregister(Caller(request.token, request.pid))}

    async def _stats(self, request: m.Stats, deadline: Deadline) -> dict[str, Any]:
        out = self.swapper.stats()
        out.update({"version": __version__, "uptime_s": round(time.time() - self.started, 3),
                    "requests_in_flight": len(self._requests), "storage_dir": self.backend.root,
                    "fsync": self.config.fsync, "metrics_port": self.health.port,
                    "metrics_host": self.config.metrics_bind_host,
                    "open_fds": fds.open_count(), "fd_limit": fds.soft_limit()})
        return out

    def _send(self, envelope: list[bytes], reply: m.Reply) -> None:
        assert self._sock is not None
        try:
            frame = m.encode_reply(reply)
        except (TypeError, ValueError, OverflowError) as exc:  # a result msgpack cannot carry: a bug
            log.error("reply to request %s cannot be encoded: %s", reply.id, exc)
            frame = m.encode_reply(m.Reply(reply.id, False, error=Internal(f"unencodable reply: {exc}"[:500])))
        if len(frame) > MAX_REPLY_BYTES:  # a bug too: what a peer holds of our memory is bounded by it
            log.error("reply to request %s is %d bytes, over the limit of %d", reply.id, len(frame), MAX_REPLY_BYTES)
            frame = m.encode_reply(m.Reply(reply.id, False, error=Internal(
                "the reply is over the size limit", size=len(frame), limit=MAX_REPLY_BYTES)))
        # With NOBLOCK the asyncio socket finishes the send at once and puts any error in the
        # returned future rather than raising it. A ROUTER drops replies to vanished peers.
        if len(frame) < TRACK_REPLY_BYTES:
            sent = self._sock.send_multipart([*envelope, frame], flags=zmq.NOBLOCK)
        else:  # sent without a copy, and charged to its connection while ZMQ holds it (admission.py)
            body = zmq.Frame(frame, copy=False, track=True)
            sent = self._sock.send_multipart([*envelope, body], flags=zmq.NOBLOCK, copy=False)
            self.budget.track(envelope[0], len(frame), body.tracker)
        if sent.done():
            _log_send_failure(sent, reply.id)
        else:
            sent.add_done_callback(lambda f: _log_send_failure(f, reply.id))

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


def _log_send_failure(sent: asyncio.Future, request_id: int | None) -> None:
    exc = None if sent.cancelled() else sent.exception()
    if isinstance(exc, zmq.Again):
        log.warning("reply to request %s dropped: the client is not reading", request_id)
    elif exc is not None:
        log.warning("reply to request %s dropped: %s", request_id, exc)


def _log_late_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.info("a request that timed out later failed: %s", exc)


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(config: Config) -> int:
    """Run a daemon until SIGTERM/SIGINT. Returns the process exit code."""
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
