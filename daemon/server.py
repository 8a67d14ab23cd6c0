"""The daemon process: ``startup -> serve -> drain -> shutdown``.

The receive loop only reads frames and starts one task per request; every task ends in
exactly one reply — its result, a typed error, or ``timeout`` at its deadline. Signals only
set a flag; the loop notices it, stops taking new work (new requests get ``unavailable``),
lets in-flight requests and writes finish for up to ``drain_timeout_s``, then exits.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import signal
import threading
import time
from typing import Any, Awaitable, Callable

import zmq
import zmq.asyncio

from kvswap import __version__
from kvswap.backends.file_store import FileBackend
from kvswap.protocol import messages as m
from kvswap.protocol.errors import Busy, Internal, KvswapError, Timeout, Unavailable
from kvswap.protocol.limits import MAX_KEYS_PER_REQUEST, MAX_KEY_LENGTH, MAX_MESSAGE_BYTES, PROTOCOL_VERSION

from .config import Config
from .metrics import HealthServer, Metrics
from .swapper import Deadline, Swapper

log = logging.getLogger("kvswap.daemon")

#: Exit codes of ``run``.
EXIT_OK = 0
EXIT_STARTUP_FAILED = 3


class StartupError(Exception):
    """A start-up failure with a one-line reason for the operator."""


class Daemon:
    def __init__(self, config: Config) -> None:
        config.validate()
        self.config = config
        self.metrics = Metrics()
        self.backend = FileBackend(config.storage_dir, fsync=config.fsync)
        self.swapper = Swapper(config, self.backend, self.metrics)
        self.health = HealthServer(self.metrics, ready=lambda: self.serving)
        self.serving = False
        self.should_exit = False
        self.started = time.time()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._requests: set[asyncio.Task] = set()
        self._stop_event: asyncio.Event | None = None
        self.control_port = config.cache_queue_port

    # -- the three phases ---------------------------------------------------------------------------

    async def serve(self) -> None:
        self._stop_event = asyncio.Event()
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        cfg = self.config
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.backend.check_writable)
        except OSError as exc:
            raise StartupError(f"storage directory {self.backend.root} is not writable: {exc.strerror or exc}") from None
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)  # ZMQ drops larger frames itself
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.SNDHWM, 10_000)
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
            await self.health.start(cfg.host, cfg.metrics_port)
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise StartupError(f"cannot bind the metrics port {cfg.host}:{cfg.metrics_port}: {reason}") from None
        if not _is_loopback(cfg.host):
            log.warning("the control socket listens on %s, beyond loopback, without authentication: anyone who "
                        "reaches it can read and overwrite cached KV blocks", cfg.host)
        self.swapper.start()
        if threading.current_thread() is threading.main_thread():  # tests run daemons on threads
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_exit)
        self.serving = True
        log.info("kvswapd %s serving tcp://%s:%d, metrics http://%s:%d/metrics, storage %s (fsync=%s)",
                 __version__, cfg.host, self.control_port, cfg.host, self.health.port, self.backend.root, cfg.fsync)

    def request_exit(self) -> None:
        self.should_exit = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def main_loop(self) -> None:
        assert self._sock is not None and self._stop_event is not None
        watcher = asyncio.ensure_future(self._watch_engine())
        receiver = asyncio.ensure_future(self._receive())
        try:
            await self._stop_event.wait()
        finally:
            watcher.cancel()
        log.info("draining: %d requests in flight, %d records waiting to be written", len(self._requests),
                 self.swapper.pending_writes)
        self.serving = False
        # The receiver keeps answering while we drain, with 'unavailable' for new requests.
        drained = await self._drain()
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        if not drained:
            log.warning("drain timeout: %d requests did not finish", len(self._requests))

    async def _drain(self) -> bool:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.wait(list(self._requests), timeout=max(0.0, deadline - time.monotonic()))
        try:
            await asyncio.wait_for(self.swapper.flush(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            log.warning("drain timeout: %d records were not written", self.swapper.pending_writes)
            return False
        return not self._requests

    async def shutdown(self) -> None:
        self.serving = False
        for task in list(self._requests):
            task.cancel()
        await self.swapper.stop()
        await self.health.close()
        if self._sock is not None:
            self._sock.close(linger=2000)
        if self._ctx is not None:
            self._ctx.term()
        log.info("kvswapd stopped")

    # -- requests -----------------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue  # a ROUTER always prefixes the peer identity; nothing to answer to
            envelope, payload = [f.bytes for f in frames[:-1]], frames[-1].bytes
            if not self.serving:
                self._send(envelope, m.Reply(m.peek_id(payload), False, error=Unavailable("the daemon is shutting down")))
                continue
            if len(self._requests) >= self.config.max_inflight_requests:
                self._send(envelope, m.Reply(m.peek_id(payload), False, error=Busy(
                    "too many requests in flight", limit=self.config.max_inflight_requests)))
                self.metrics.errors.labels(op="any", code="busy").inc()
                continue
            task = asyncio.ensure_future(self._answer(envelope, payload))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _answer(self, envelope: list[bytes], payload: bytes) -> None:
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        op = "invalid"
        try:
            try:
                request = m.decode_request(payload)
            except m.DecodeError as exc:
                log.info("bad request frame (%d bytes): %s: %s", len(payload), exc.error.code, exc.error.message)
                reply = m.Reply(exc.request_id, False, error=exc.error)
            else:
                op = request.op
                reply = await self._dispatch(request)
            self._send(envelope, reply)
            self.metrics.requests.labels(op=op, outcome="ok" if reply.ok else "error").inc()
            if not reply.ok and reply.error is not None:
                self.metrics.errors.labels(op=op, code=reply.error.code).inc()
            self.metrics.latency.labels(op=op).observe(time.perf_counter() - started)
        finally:
            self.metrics.in_flight.dec()

    async def _dispatch(self, request: m.Request) -> m.Reply:
        timeout_ms = request.timeout_ms or self.config.default_timeout_ms
        deadline = Deadline(timeout_ms / 1000)
        work = asyncio.ensure_future(self._handler(request)(request, deadline))
        done, _ = await asyncio.wait({work}, timeout=deadline.remaining())
        if not done:
            # Answer now; the work stops touching engine memory (deadline.live() is False) and
            # cleans up after itself.
            deadline.expire()
            work.add_done_callback(_log_late_failure)
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

    def _handler(self, request: m.Request) -> Callable[[Any, Deadline], Awaitable[dict[str, Any]]]:
        return self._handlers[request.op]

    @property
    def _handlers(self) -> dict[str, Callable[[Any, Deadline], Awaitable[dict[str, Any]]]]:
        s = self.swapper
        return {
            "hello": self._hello,
            "ping": self._ping,
            "register": lambda r, d: s.register(r.layout, r.handles, r.regions, r.pid),
            "unregister": self._unregister,
            "swap_out": lambda r, d: s.swap_out(r.block_ids, r.keys, r.wait, d),
            "swap_in": lambda r, d: s.swap_in(r.keys, r.block_ids, d),
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

    async def _unregister(self, request: m.Unregister, deadline: Deadline) -> dict[str, Any]:
        return {"released": await self.swapper.release_registration("unregistered")}

    async def _stats(self, request: m.Stats, deadline: Deadline) -> dict[str, Any]:
        out = self.swapper.stats()
        out.update({"version": __version__, "uptime_s": round(time.time() - self.started, 3),
                    "requests_in_flight": len(self._requests), "storage_dir": self.backend.root,
                    "fsync": self.config.fsync})
        return out

    def _send(self, envelope: list[bytes], reply: m.Reply) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([*envelope, m.encode_reply(reply)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("reply to request %s dropped: the client is not reading", reply.id)
        except zmq.ZMQError as exc:
            log.warning("reply to request %s dropped: %s", reply.id, exc)

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(self.config.engine_check_interval_s)
            try:
                await self.swapper.check_engine()
            except Exception:
                log.exception("engine check failed")


def _log_late_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.info("a request that timed out later failed: %s", exc)


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
    daemon = Daemon(config)
    try:
        if uvloop is not None:
            uvloop.run(daemon.serve())
        else:
            asyncio.run(daemon.serve())
    except StartupError as exc:
        log.error("start-up failed: %s", exc)
        return EXIT_STARTUP_FAILED
    return EXIT_OK
