"""Clients for kvswapd: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Both keep many requests in flight on one DEALER socket and match replies by id. Every call
has a deadline: it travels with the request (``timeout_ms``), so the daemon answers
``timeout`` itself when it cannot finish in time; the client waits a little longer for that
answer and raises :class:`~kvswap.protocol.errors.Timeout` if none arrives. Failures raise the
typed error the daemon sent. A request the daemon would refuse (over a limit of
``protocol/limits.py``, a bad key, a bad field) raises that same error before it is sent.

A :class:`Client` is not thread-safe (ZMQ sockets are not); use one per thread, or the
:class:`AsyncClient`. ``send``/``wait`` pipeline requests on one socket::

    with Client("tcp://127.0.0.1:55500") as c:
        c.wait_ready(10)
        c.register(cache)
        c.swap_out([3, 4], ["k0", "k1"], wait="persisted")
        r = c.swap_in(["k0", "k1"], [7, 8])      # r.loaded == 2

Against a daemon with CURVE on, pass the client's keypair and the daemon's public key, as z85
strings or as the files ``kvswap keygen`` writes::

    Client(endpoint, curve_secret_key_file="keys/engine0.key_secret",
           curve_server_key_file="keys/kvswapd.key")

A client the daemon does not authorize gets no answer at all (ZMQ drops it at the
handshake): its calls raise :class:`~kvswap.protocol.errors.Unavailable` or ``Timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence, TypeVar

import zmq
import zmq.asyncio

from . import messages as m
from .errors import KvswapError, Timeout, Unavailable
from .kv_events import BlockMeta
from .limits import DEFAULT_TIMEOUT_MS
from .results import SwapInResult, SwapOutResult

#: Extra time a client waits beyond a request's deadline for the daemon's own answer.
GRACE_S = 1.0
DEFAULT_ENDPOINT = "tcp://127.0.0.1:55500"

#: The socket type a context makes (zmq.Socket, or zmq.asyncio.Socket for the asyncio client).
S = TypeVar("S", bound=zmq.Socket)


# -- one builder per op: the request and how to read its result, shared by both clients ------

Call = tuple[type[m.Request], dict[str, Any], Callable[[dict[str, Any]], Any]]


def _registration_of(cache: Any) -> dict[str, Any]:
    registration = cache.registration() if hasattr(cache, "registration") else cache
    if not isinstance(registration, dict):
        raise TypeError("register() takes a HostKVCache (or any object with .registration()) or its dict")
    return registration


def _ops_register(cache: Any) -> Call:
    body = dict(_registration_of(cache))
    body.setdefault("pid", os.getpid())
    return m.Register, body, dict


def _ops_swap_out(block_ids: Sequence[int], keys: Sequence[str], wait: str, partial: bool = False,
                  block_meta: Sequence[BlockMeta | None] | None = None) -> Call:
    body: dict[str, Any] = {"block_ids": tuple(int(b) for b in block_ids), "keys": tuple(keys), "wait": wait}
    if partial:
        body["partial"] = True
    if block_meta:
        body["block_meta"] = tuple(None if meta is None else meta.to_wire() for meta in block_meta)
    return m.SwapOut, body, SwapOutResult.from_wire


def _ops_swap_in(keys: Sequence[str], block_ids: Sequence[int]) -> Call:
    return m.SwapIn, {"keys": tuple(keys), "block_ids": tuple(int(b) for b in block_ids)}, SwapInResult.from_wire


def _keys_op(cls: type[m.Request], field: str) -> Callable[[Iterable[str]], Call]:
    return lambda keys: (cls, {"keys": tuple(keys)}, lambda r: r[field])




def _ops_lookup(keys: Iterable[str], peer: str = "", wait_ms: int = 0) -> Call:
    """A lookup; with ``peer`` (a peer daemon's ``--peer-address``) the daemon first pulls the
    keys past its own prefix from that daemon, waiting up to ``wait_ms`` for them."""
    body: dict[str, Any] = {"keys": tuple(keys)}
    if peer:
        body["peer"] = peer
    if wait_ms:
        body["wait_ms"] = int(wait_ms)
    return m.Lookup, body, lambda r: r["hits"]


_ops_delete = _keys_op(m.Delete, "deleted")


def _plain(cls: type[m.Request], field: str | None = None) -> Call:
    return cls, {}, (lambda r: r[field]) if field else dict


KeyLike = str | bytes

#: Requests that use the registration: the client attaches its token and pid to these.
_OWNED = (m.SwapOut, m.SwapIn, m.Unregister)
#: Requests that copy from or into engine memory: they carry ``deadline_ns`` too, so a daemon
#: that reads them after the client gave up does not start them (docs/protocol.md, Deadlines).
_TOUCH_MEMORY = (m.SwapOut, m.SwapIn)


def _z85(key: KeyLike, what: str) -> bytes:
    raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    if len(raw) != 40:
        raise ValueError(f"{what} must be a 40-character z85 CURVE key, got {len(raw)} characters")
    return raw


def curve_keys(curve_server_key: KeyLike | None = None, curve_public_key: KeyLike | None = None,
               curve_secret_key: KeyLike | None = None, curve_secret_key_file: str | None = None,
               curve_server_key_file: str | None = None) -> tuple[bytes, bytes, bytes] | None:
    """(client public, client secret, server public) from keys or key files; None when no
    CURVE argument is given. Raises ``ValueError`` for an incomplete or malformed set."""
    given = (curve_server_key, curve_public_key, curve_secret_key, curve_secret_key_file, curve_server_key_file)
    if all(v is None for v in given):
        return None
    if curve_secret_key_file is not None or curve_server_key_file is not None:
        from zmq.auth import load_certificate  # only CURVE users read certificate files

        if curve_secret_key_file is not None:
            curve_public_key, curve_secret_key = load_certificate(curve_secret_key_file)
            if not curve_secret_key:
                raise ValueError(f"{curve_secret_key_file} holds no secret key")
        if curve_server_key_file is not None:
            curve_server_key, _ = load_certificate(curve_server_key_file)
    if curve_server_key is None or curve_secret_key is None:
        raise ValueError("CURVE needs the client's secret key (or key file) and the server's public key (or key file)")
    secret = _z85(curve_secret_key, "curve_secret_key")
    public = _z85(curve_public_key, "curve_public_key") if curve_public_key is not None else zmq.curve_public(secret)
    return public, secret, _z85(curve_server_key, "curve_server_key")


class _Base:
    def __init__(self, endpoint: str, timeout: float, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.endpoint = endpoint
        self.timeout = timeout
        self._curve = curve
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 16)
        #: The token of the registration this client made (see docs/protocol.md, ownership).
        self._token = ""

    def _registered(self, result: dict[str, Any]) -> dict[str, Any]:
        self._token = str(result.get("token") or "")
        return result

    def _make(self, cls: type[m.Request], body: dict[str, Any], timeout: float | None) -> tuple[m.Request, float]:
        timeout = self.timeout if timeout is None else timeout
        if cls in _OWNED:
            # Say who sends it, so the daemon applies it only to the registration it is for.
            body = {"pid": os.getpid(), **({"token": self._token} if self._token else {}), **body}
        deadline_ns = time.monotonic_ns() + int(timeout * 1e9) if cls in _TOUCH_MEMORY else None
        request = cls(id=next(self._ids), timeout_ms=max(1, int(timeout * 1000)), deadline_ns=deadline_ns, **body)
        return request, timeout

    def _socket(self, ctx: zmq.Context[S]) -> S:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a live connection: a request for a daemon that is down fails at once
        # instead of being delivered, stale, when it comes back. With CURVE a connection is
        # live only after its handshake, so a refused client fails the same way.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if "://[" in self.endpoint:  # tcp://[::1]:55500: ZMQ connects to IPv6 only with this set
            sock.setsockopt(zmq.IPV6, 1)
        if self._curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
        return sock


class Client(_Base):
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float = DEFAULT_TIMEOUT_MS / 1000,
                 context: zmq.Context | None = None, *, curve_server_key: KeyLike | None = None,
                 curve_public_key: KeyLike | None = None, curve_secret_key: KeyLike | None = None,
                 curve_secret_key_file: str | None = None, curve_server_key_file: str | None = None) -> None:
        """The ``curve_*`` arguments (see :func:`curve_keys`) are for a daemon with CURVE on."""
        super().__init__(endpoint, timeout, curve_keys(curve_server_key, curve_public_key, curve_secret_key,
                                                       curve_secret_key_file, curve_server_key_file))
        self._ctx = context or zmq.Context.instance()
        self._sock = self._socket(self._ctx)
        self._sock.connect(endpoint)
        self._pending: dict[int, m.Request] = {}
        self._replies: dict[int, m.Reply] = {}
        #: When :meth:`wait` gives up on each pending request (its timeout plus GRACE_S).
        self._give_up: dict[int, float] = {}

    # -- pipelining --------------------------------------------------------------------------

    def send(self, cls: type[m.Request], body: dict[str, Any] | None = None, timeout: float | None = None,
             *, block: bool = True) -> int:
        """Send one request without waiting for its answer; return its id for :meth:`wait`. A
        request the daemon would refuse (too many keys, a bad key, a bad field) raises its typed
        error here and is not sent. Without a live connection it waits up to 1 s for one, or
        (``block=False``) raises :class:`Unavailable` at once."""
        request, timeout = self._make(cls, body or {}, timeout)
        frame = m.encode_request(request)
        if not self._sock.poll(int(min(timeout, 1.0) * 1000) if block else 0, zmq.POLLOUT):
            raise Unavailable(f"kvswapd at {self.endpoint} is not reachable", endpoint=self.endpoint)
        self._sock.send(frame)
        self._pending[request.id] = request
        self._give_up[request.id] = time.monotonic() + timeout + GRACE_S
        return request.id

    def done(self, request_id: int, within: float = 0.0) -> bool:
        """Whether :meth:`wait` for a sent request would return (or raise) at once: its reply
        came, or the client's wait for it is over. Reads the replies that have arrived, waiting
        at most ``within`` seconds for this one (0: never blocks; for callers that must not
        wait, such as an engine's scheduler)."""
        give_up = self._give_up.get(request_id)
        if give_up is None and request_id not in self._replies:
            raise KeyError(f"request {request_id} was not sent by this client or was already collected")
        until = time.monotonic() + within
        while True:
            while self._sock.poll(0, zmq.POLLIN):
                self._take(self._sock.recv())
            if request_id in self._replies:
                return True
            now = time.monotonic()
            if give_up is not None and now >= give_up:
                return True
            if now >= until or not self._sock.poll(max(1, int((until - now) * 1000)), zmq.POLLIN):
                return False

    def wait(self, request_id: int, timeout: float | None = None) -> dict[str, Any]:
        """The result of a sent request; raises its typed error."""
        request = self._pending.get(request_id)
        if request is None and request_id not in self._replies:
            raise KeyError(f"request {request_id} was not sent by this client or was already collected")
        limit = (self.timeout if timeout is None else timeout) + GRACE_S
        # Never past the request's own give-up time: the daemon answers by its deadline, so a
        # reply that has not come by then will not (and done() said so).
        deadline = min(time.monotonic() + limit, self._give_up.get(request_id, math.inf))
        try:
            while request_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no answer from {self.endpoint} within {limit:.1f} s", request_id=request_id)
                if self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self._take(self._sock.recv())
        finally:
            self._pending.pop(request_id, None)
            self._give_up.pop(request_id, None)
        reply = self._replies.pop(request_id)
        if not reply.ok:
            assert reply.error is not None
            raise reply.error
        return reply.result

    def _take(self, frame: bytes) -> None:
        try:
            reply = m.decode_reply(frame)
        except KvswapError:
            return
        if isinstance(reply.id, int) and reply.id in self._pending:
            self._replies[reply.id] = reply
        # Replies for requests nobody waits for (abandoned after a local timeout) are dropped.

    def call(self, cls: type[m.Request], body: dict[str, Any] | None = None, timeout: float | None = None) -> dict:
        return self.wait(self.send(cls, body, timeout), timeout)

    def _run(self, op: Call, timeout: float | None = None) -> Any:
        cls, body, parse = op
        return parse(self.call(cls, body, timeout))

    # -- the public contract ------------------------------------------------------------------

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        """Ping until the daemon answers; return its hello. Raises Timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self.call(m.Hello, {"client": "kvswap-client"}, timeout=max(0.05, min(left, 1.0)))
            except (Timeout, Unavailable):
                if time.monotonic() >= deadline:
                    raise Timeout(f"kvswapd at {self.endpoint} not ready within {timeout} s") from None
                time.sleep(0.05)

    def hello(self) -> dict[str, Any]:
        return self.call(m.Hello, {"client": "kvswap-client"})

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time in seconds."""
        t = time.perf_counter()
        self.call(m.Ping, timeout=timeout)
        return time.perf_counter() - t

    def register(self, cache: Any, timeout: float | None = None) -> dict[str, Any]:
        return self._registered(self._run(_ops_register(cache), timeout))

    def unregister(self) -> bool:
        released = self._run(_plain(m.Unregister, "released"))
        self._token = ""
        return released

    @contextlib.contextmanager
    def registered(self, cache: Any, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """``register(cache)`` for the ``with`` block, ``unregister()`` at its end, so an
        engine that exits normally says so (the daemon logs it at INFO; a registered engine
        whose process vanishes is a WARNING). Yields register's reply. An unregister the
        daemon cannot answer (it is gone or shutting down) is not an error here: the daemon
        releases the registration itself when the engine's process ends."""
        reply = self.register(cache, timeout)
        try:
            yield reply
        finally:
            with contextlib.suppress(KvswapError):
                self.unregister()

    def swap_out(self, block_ids: Sequence[int], keys: Sequence[str], wait: str = "copied",
                 timeout: float | None = None, partial: bool = False,
                 block_meta: Sequence[BlockMeta | None] | None = None) -> SwapOutResult:
        """``block_meta``: per key, what KV events should name the record by (see
        protocol/kv_events.py); optional."""
        return self._run(_ops_swap_out(block_ids, keys, wait, partial, block_meta), timeout)

    def swap_in(self, keys: Sequence[str], block_ids: Sequence[int], timeout: float | None = None) -> SwapInResult:
        return self._run(_ops_swap_in(keys, block_ids), timeout)

    def lookup(self, keys: Sequence[str], timeout: float | None = None, peer: str = "", wait_ms: int = 0) -> int:
        """How many leading ``keys`` are stored. ``peer``: pull the rest from that daemon first
        (prefill/decode disaggregation); ``wait_ms``: wait that long for keys on their way, within
        ``timeout`` (docs/protocol.md, lookup)."""
        return self._run(_ops_lookup(keys, peer, wait_ms), timeout)

    def delete(self, keys: Sequence[str]) -> int:
        return self._run(_ops_delete(keys))

    def clear(self) -> int:
        return self._run(_plain(m.Clear, "deleted"))

    def flush(self, timeout: float | None = None) -> int:
        return self._run(_plain(m.Flush, "flushed"), timeout)

    def stats(self) -> dict[str, Any]:
        return self._run(_plain(m.Stats))

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio client. Any number of coroutines may call it at once."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout: float = DEFAULT_TIMEOUT_MS / 1000,
                 context: zmq.asyncio.Context | None = None, *, curve_server_key: KeyLike | None = None,
                 curve_public_key: KeyLike | None = None, curve_secret_key: KeyLike | None = None,
                 curve_secret_key_file: str | None = None, curve_server_key_file: str | None = None) -> None:
        super().__init__(endpoint, timeout, curve_keys(curve_server_key, curve_public_key, curve_secret_key,
                                                       curve_secret_key_file, curve_server_key_file))
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._socket(self._ctx)
        self._sock.connect(endpoint)
        self._waiters: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def call(self, cls: type[m.Request], body: dict[str, Any] | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        request, timeout = self._make(cls, body or {}, timeout)
        frame = m.encode_request(request)  # raises what the daemon would answer, before sending
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_replies())
        future = asyncio.get_running_loop().create_future()
        self._waiters[request.id] = future
        try:
            # pyzmq's stub of the asyncio poll lacks its flags argument (zmq/_future.pyi).
            if not await self._sock.poll(int(min(timeout, 1.0) * 1000), zmq.POLLOUT):  # type: ignore[call-arg]
                raise Unavailable(f"kvswapd at {self.endpoint} is not reachable", endpoint=self.endpoint)
            await self._sock.send(frame)
            try:
                reply: m.Reply = await asyncio.wait_for(future, timeout + GRACE_S)
            except asyncio.TimeoutError:
                raise Timeout(f"no answer from {self.endpoint} within {timeout + GRACE_S:.1f} s",
                              request_id=request.id) from None
        finally:
            self._waiters.pop(request.id, None)
        if not reply.ok:
            assert reply.error is not None
            raise reply.error
        return reply.result

    async def _read_replies(self) -> None:
        while True:
            frame = await self._sock.recv()
            try:
                reply = m.decode_reply(frame)
            except KvswapError:
                continue
            waiter = self._waiters.get(reply.id) if isinstance(reply.id, int) else None
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)

    async def _run(self, op: Call, timeout: float | None = None) -> Any:
        cls, body, parse = op
        return parse(await self.call(cls, body, timeout))

    async def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return await self.call(m.Hello, {"client": "kvswap-async-client"}, timeout=max(0.05, min(left, 1.0)))
            except (Timeout, Unavailable):
                if time.monotonic() >= deadline:
                    raise Timeout(f"kvswapd at {self.endpoint} not ready within {timeout} s") from None
                await asyncio.sleep(0.05)

    async def hello(self) -> dict[str, Any]:
        return await self.call(m.Hello, {"client": "kvswap-async-client"})

    async def ping(self, timeout: float | None = None) -> float:
        t = time.perf_counter()
        await self.call(m.Ping, timeout=timeout)
        return time.perf_counter() - t

    async def register(self, cache: Any, timeout: float | None = None) -> dict[str, Any]:
        return self._registered(await self._run(_ops_register(cache), timeout))

    async def unregister(self) -> bool:
        released = await self._run(_plain(m.Unregister, "released"))
        self._token = ""
        return released

    @contextlib.asynccontextmanager
    async def registered(self, cache: Any, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """``async with`` twin of :meth:`Client.registered`."""
        reply = await self.register(cache, timeout)
        try:
            yield reply
        finally:
            with contextlib.suppress(KvswapError):
                await self.unregister()

    async def swap_out(self, block_ids: Sequence[int], keys: Sequence[str], wait: str = "copied",
                       timeout: float | None = None, partial: bool = False,
                       block_meta: Sequence[BlockMeta | None] | None = None) -> SwapOutResult:
        return await self._run(_ops_swap_out(block_ids, keys, wait, partial, block_meta), timeout)

    async def swap_in(self, keys: Sequence[str], block_ids: Sequence[int],
                      timeout: float | None = None) -> SwapInResult:
        return await self._run(_ops_swap_in(keys, block_ids), timeout)

    async def lookup(self, keys: Sequence[str], timeout: float | None = None, peer: str = "",
                     wait_ms: int = 0) -> int:
        return await self._run(_ops_lookup(keys, peer, wait_ms), timeout)

    async def delete(self, keys: Sequence[str]) -> int:
        return await self._run(_ops_delete(keys))

    async def clear(self) -> int:
        return await self._run(_plain(m.Clear, "deleted"))

    async def flush(self, timeout: float | None = None) -> int:
        return await self._run(_plain(m.Flush, "flushed"), timeout)

    async def stats(self) -> dict[str, Any]:
        return await self._run(_plain(m.Stats))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(0)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
