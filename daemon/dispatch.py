"""The receive loop and its answers: every frame on the control socket becomes exactly one
reply — its result, a typed error, ``timeout`` at its deadline, or ``unavailable`` when the
daemon is going away.

What one peer can make the loop hold or spend is bounded here (numbers in docs/security.md):
the loop's time per frame by the protocol's shape limits and one frame handed on per read, so
a flood delays another peer's request by about one frame; requests in flight per connection and
in all (``max_inflight_per_client``, ``max_inflight_requests``), and the bytes their decoded
fields hold (``max_inflight_request_bytes``, admission.py). The daemon (server.py) owns the
socket's lifetime; what each op does is ops.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from typing import Any, Awaitable, Callable, cast

import zmq
import zmq.asyncio

from kvswap.protocol import messages as m
from kvswap.protocol.errors import Busy, Internal, KvswapError, Timeout, Unavailable
from kvswap.protocol.limits import MAX_PEER_REPLY_BYTES, MAX_REPLY_BYTES

from .admission import TRACK_REPLY_BYTES, RequestBudget, request_bytes
from .config import Config
from .deadline import Deadline
from .metrics import Metrics

log = logging.getLogger("kvswap.daemon")

#: What runs a decoded request: its result (a map for the wire) or a raised typed error.
Handle = Callable[[m.Request, Deadline], Awaitable[dict[str, Any]]]
#: What answers a decoded request from memory on the spot: its result, or None where it must
#: wait (I/O, a thread, a peer), and so runs as a task with ``Handle``.
AnswerNow = Callable[[m.Request], "dict[str, Any] | None"]


class Dispatcher:
    """Reads frames and answers each exactly once: at once where memory alone answers it
    (``answer_now``), else from a task of its own."""

    def __init__(self, config: Config, metrics: Metrics, budget: RequestBudget, handle: Handle,
                 answer_now: AnswerNow | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.budget = budget
        self.handle = handle
        self.answer_now = answer_now
        #: False while the daemon starts and once it drains: new requests get 'unavailable'.
        self.serving = False
        self.sock: zmq.asyncio.Socket | None = None
        #: The requests being answered.
        self.requests: set[asyncio.Task] = set()
        #: Requests in flight per client connection (ZMQ identity); entries go at zero.
        self.per_client: dict[bytes, int] = {}
        #: ``sock`` without the asyncio layer (a shadow: same ZMQ socket, not owned), and the
        #: event its descriptor sets (receive).
        self._raw: zmq.Socket | None = None
        self._readable = asyncio.Event()

    # -- the loop ---------------------------------------------------------------------------------

    async def receive(self) -> None:
        raw = self._raw_socket()
        loop = asyncio.get_running_loop()
        fd = raw.FD
        loop.add_reader(fd, self._readable.set)
        try:
            while True:
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    # ZMQ's descriptor only says that its events changed (edge-triggered): wait
                    # for the next change once EVENTS says no frame is queued.
                    self._readable.clear()
                    if not _frame_queued(raw):
                        await self._readable.wait()
                    continue
                self._take(frames)
                del frames  # the task holds the frame only until it is decoded
                # Let the frame's task start before the next frame is read: a receive completes
                # at once while frames are queued, so without this yield a flood of frames
                # became tasks ahead of everyone else's (a ping waited 5 s).
                await asyncio.sleep(0)
        finally:
            loop.remove_reader(fd)

    def _take(self, frames: list[zmq.Frame]) -> None:
        """One frame read: refused at once, or a task that answers it."""
        if len(frames) < 2:
            return  # a ROUTER always prefixes the peer identity; nothing to answer to
        # The payload is read in place (a memoryview of ZMQ's buffer), not copied: a copy
        # doubled what a 4 MiB frame costs in memory and time.
        envelope, payload = [f.bytes for f in frames[:-1]], frames[-1].buffer
        refusal = self._refusal(envelope[0])
        if refusal is not None:
            self.send(envelope, m.Reply(m.peek_id(payload), False, error=refusal))
            if isinstance(refusal, Busy):
                self._count_refusal()
            return
        started = time.perf_counter()
        request = self._decode(envelope, payload, started)
        if request is None or self._answered_now(envelope, request, started):
            return
        client = envelope[0]
        self.per_client[client] = self.per_client.get(client, 0) + 1
        task = asyncio.ensure_future(self._answer(envelope, request, started))
        self.requests.add(task)
        task.add_done_callback(self.requests.discard)
        task.add_done_callback(functools.partial(self._client_done, client))

    def _raw_socket(self) -> zmq.Socket:
        """The control socket without pyzmq's asyncio layer: frames are read and replies sent
        with NOBLOCK calls, the loop woken by ZMQ's descriptor. The asyncio layer's futures,
        event polling and enum flags were 16% of the loop's GIL time under a swap_out stream
        (py-spy); this is what it did, minus the futures. A shadow, as that layer's own: the
        same ZMQ socket, not owned, so it is used only while ``sock`` is open."""
        if self._raw is None:
            assert self.sock is not None
            self._raw = zmq.Socket.shadow(self.sock.underlying)
        return self._raw

    def _refusal(self, client: bytes) -> KvswapError | None:
        """Why a frame from ``client`` is answered before it is decoded, or None."""
        if not self.serving:
            return Unavailable("the daemon is shutting down")
        if len(self.requests) >= self.config.max_inflight_requests:
            return Busy("too many requests in flight", limit=self.config.max_inflight_requests)
        if self.per_client.get(client, 0) >= self.config.max_inflight_per_client:
            # One engine (or a runaway loop in it) must not take every slot from the others.
            return Busy("too many requests in flight from this client", limit=self.config.max_inflight_per_client)
        if self.budget.full(client):  # refused before it is decoded: it costs nothing to hold
            return Busy("too many request bytes in flight", limit=self.budget.limit)
        return None

    def _count_refusal(self) -> None:
        """A request refused before decoding (in-flight limits) still counts as a request, so
        the busy ratio's denominator is right."""
        self.metrics.requests.labels(op="any", outcome="error").inc()
        self.metrics.errors.labels(op="any", code="busy").inc()

    def _client_done(self, client: bytes, _task: object) -> None:
        held = self.per_client.get(client, 0) - 1
        if held > 0:
            self.per_client[client] = held
        else:
            self.per_client.pop(client, None)

    def refuse_queued(self) -> int:
        """Answer the frames still queued on the socket after the loop stopped; how many."""
        assert self.sock is not None
        if self.sock.closed:
            return 0
        raw = self._raw_socket()
        answered = 0
        while True:
            try:
                frames = raw.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: nothing left (or the socket is gone)
                return answered
            if len(frames) >= 2:
                answered += 1
                self.send(frames[:-1], m.Reply(m.peek_id(frames[-1]), False,
                                               error=Unavailable("the daemon is shutting down")))

    # -- one request ----------------------------------------------------------------------------

    def _decode(self, envelope: list[bytes], payload: memoryview, started: float) -> m.Request | None:
        """The frame's request; None once a frame that does not decode has had its answer. A
        request holds its decoded fields from here on, not its frame."""
        try:
            return m.decode_request(payload)
        except m.DecodeError as exc:
            op = exc.op or "invalid"  # a bad key in a lookup is counted as a lookup
            log.info("bad %s frame (%d bytes): %s: %s", op, len(payload), exc.error.code, exc.error.message)
            self._reply(envelope, op, started, m.Reply(exc.request_id, False, error=exc.error))
        except Exception as exc:  # a bug in the decoder: still answer
            log.exception("a frame of %d bytes could not be decoded", len(payload))
            self._reply(envelope, "invalid", started, m.Reply(m.peek_id(payload), False,
                                                              error=Internal(f"{type(exc).__name__}: {exc}"[:500])))
        return None

    def _answered_now(self, envelope: list[bytes], request: m.Request, started: float) -> bool:
        """Answer a request that needs memory alone (ping, hello, a lookup the in-memory
        indexes answer whole: Ops.answer_now) in the read that took its frame: no task, no
        await, so no other work of the loop runs between its frame and its answer. As a task,
        its answer waited for three turns of the loop, each running whatever else was ready
        (a swap_out stream's completions). Under a stream of 2 MiB records a ping's p50 went
        from 1.3-1.6 ms to 0.8-1.1 ms answered here, its p99 from 1.60x the echo floor's to
        1.45x (issue 27; the key checks of check_keys came with it). True if answered."""
        if self.answer_now is None:
            return False
        if request.deadline_ns is not None and request.deadline_ns <= time.monotonic_ns():
            return False  # read after its deadline: _run answers it so, and counts it
        try:
            result = self.answer_now(request)
        except Exception as exc:
            reply = _failure_reply(request, exc)
        else:
            if result is None:
                return False
            reply = m.Reply(request.id, True, result)
        self._reply(envelope, request.op, started, reply)
        return True

    async def _answer(self, envelope: list[bytes], request: m.Request, started: float) -> None:
        """Exactly one reply per request, whatever happens: result, typed error, ``internal``
        for a bug, ``unavailable`` when shutdown cancels it."""
        self.metrics.in_flight.inc()
        op, request_id = request.op, request.id
        try:
            client, charge = envelope[0], request_bytes(request)
            if not self.budget.take(client, charge):
                reply = m.Reply(request_id, False, error=Busy("too many request bytes in flight",
                                                              limit=self.budget.limit))
            else:
                # Given back when the decoded request is freed, not at its answer: work that
                # runs on past its deadline still holds it.
                weakref.finalize(request, self.budget.give, client, charge)
                reply = await self._run(request)  # an error in it has no traceback (_failure_reply)
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
        if op == "peer_export":  # it carries record bytes (the inline transport): up to the message limit
            self.send_sized(envelope, reply, MAX_PEER_REPLY_BYTES)
        else:
            self.send(envelope, reply)
        m = self.metrics
        m.child(m.requests, op, "ok" if reply.ok else "error").inc()
        if not reply.ok and reply.error is not None:
            m.child(m.errors, op, reply.error.code).inc()
        m.child(m.latency, op).observe(time.perf_counter() - started)

    async def _run(self, request: m.Request) -> m.Reply:
        timeout_ms = request.timeout_ms or self.config.default_timeout_ms
        timeout_s = timeout_ms / 1000
        if request.deadline_ns is not None:
            timeout_s = min(timeout_s, (request.deadline_ns - time.monotonic_ns()) / 1e9)
            if timeout_s <= 0:
                # Read after the sender's deadline (this daemon was stopped, or behind): the
                # engine may already have reused the blocks, so nothing of it starts.
                self.metrics.expired_on_arrival.inc()
                log.warning("%s %d arrived %.0f ms after its deadline_ns; not started", request.op, request.id,
                            -timeout_s * 1000)
                return m.Reply(request.id, False, error=Timeout(f"{request.op} arrived after its deadline_ns",
                                                                timeout_ms=timeout_ms))
        deadline = Deadline(timeout_s)
        work = asyncio.ensure_future(self.handle(request, deadline))
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
        except Exception as exc:
            return _failure_reply(request, exc)

    async def _stop_copies(self, deadline: Deadline) -> None:
        """No byte moves from or into the engine's memory for a request after its answer:
        stop its copies and wait for the one in progress to end (at its next row) first."""
        if not await asyncio.shield(deadline.stop()):
            self.metrics.late_copies.inc()

    # -- the socket -------------------------------------------------------------------------------

    def send(self, envelope: list[bytes], reply: m.Reply) -> None:
        self.send_sized(envelope, reply, MAX_REPLY_BYTES)

    def send_sized(self, envelope: list[bytes], reply: m.Reply, limit: int) -> None:
        """Send one reply of at most ``limit`` bytes (a larger one is a bug: ``internal``)."""
        assert self.sock is not None
        try:
            frame = m.encode_reply(reply)
        except (TypeError, ValueError, OverflowError) as exc:  # a result msgpack cannot carry: a bug
            log.error("reply to request %s cannot be encoded: %s", reply.id, exc)
            frame = m.encode_reply(m.Reply(reply.id, False, error=Internal(f"unencodable reply: {exc}"[:500])))
        if len(frame) > limit:  # a bug too: what a peer holds of our memory is bounded by it
            log.error("reply to request %s is %d bytes, over the limit of %d", reply.id, len(frame), limit)
            frame = m.encode_reply(m.Reply(reply.id, False, error=Internal(
                "the reply is over the size limit", size=len(frame), limit=limit)))
        if self.sock.closed:  # the shadow must not outlive it: its ZMQ socket is freed
            log.warning("reply to request %s dropped: the socket is closed", reply.id)
            return
        # NOBLOCK: a reply ZMQ cannot queue (the peer's SND_HWM is full: it does not read)
        # is dropped, never waited for. A ROUTER drops replies to vanished peers itself.
        raw = self._raw_socket()
        try:
            if len(frame) < TRACK_REPLY_BYTES:
                raw.send_multipart([*envelope, frame], flags=zmq.NOBLOCK)
            else:  # sent without a copy, and charged to its connection while ZMQ holds it (admission.py)
                body = zmq.Frame(frame, copy=False, track=True)
                raw.send_multipart([*envelope, body], flags=zmq.NOBLOCK, copy=False)
                self.budget.track(envelope[0], len(frame), body.tracker)
        except zmq.ZMQError as exc:
            _log_send_failure(exc, reply.id)
        # A send can consume the descriptor's signal of a frame that arrived meanwhile, so the
        # receiver looks again (what pyzmq's asyncio layer does after every call).
        if _frame_queued(raw):
            self._readable.set()


def _failure_reply(request: m.Request, exc: Exception) -> m.Reply:
    """The answer to a request whose work raised ``exc``, called while it is handled: a typed
    error as it is (logged, unless it is routine), anything else ``internal`` (a bug: logged
    with its traceback; still answered, so the engine never waits forever). A typed error
    lets go of its traceback: raised out of the work task by ``work.result()``, it held
    ``_run``'s frame, which holds the task, which holds the error: a cycle that kept every
    refused request's decoded keys until the cyclic GC ran
    (tests/test_limits.py, ..._without_the_cyclic_gc)."""
    if isinstance(exc, KvswapError):
        if exc.code not in ("not_registered", "busy"):
            log.info("%s %d failed: %s: %s", request.op, request.id, exc.code, exc.message)
        exc.__traceback__ = None
        return m.Reply(request.id, False, error=exc)
    log.exception("%s %d raised", request.op, request.id)
    return m.Reply(request.id, False, error=Internal(f"{type(exc).__name__}: {exc}"[:500]))


def _frame_queued(raw: zmq.Socket) -> bool:
    return bool(cast(int, raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _log_send_failure(exc: zmq.ZMQError, request_id: int | None) -> None:
    if isinstance(exc, zmq.Again):
        log.warning("reply to request %s dropped: the client is not reading", request_id)
    else:
        log.warning("reply to request %s dropped: %s", request_id, exc)


def _log_late_failure(task: "asyncio.Future[Any]") -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.info("a request that timed out later failed: %s", exc)
