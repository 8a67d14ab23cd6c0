"""A daemon's connection to a peer daemon's control socket: requests out, replies matched by id.

One ZMQ DEALER per peer address, kept while in use (at most MAX_LINKS, the least recently used
closed first). Everything from the peer is treated like an engine's input: a frame over the
message limit is dropped by ZMQ itself (``MAXMSGSIZE``), a reply is decoded within bounds
(``decode_peer_reply``), a reply to no request waiting (late, unknown id, garbage) is dropped,
and a request whose reply does not come in time is ``timeout``. With CURVE configured the link
authenticates with this daemon's own keypair.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import OrderedDict
from typing import Any

import zmq
import zmq.asyncio

from kvswap.protocol import messages as m
from kvswap.protocol.errors import BadRequest, KvswapError, Timeout, Unavailable
from kvswap.protocol.limits import MAX_PEER_REPLY_BYTES

log = logging.getLogger("kvswap.daemon.peer")

#: Peer daemons a daemon keeps a connection to at once.
MAX_LINKS = 64
#: Requests queued towards a connected peer (its socket full) before sends fail at once.
SEND_QUEUE = 64
#: How long a request waits for its peer's connection (a new link, or one whose peer went away)
#: before it fails ``unavailable``. A peer is reached in milliseconds or is down: a decode whose
#: prefill daemon died gets its miss (and recomputes) after this, not after its whole wait.
CONNECT_WAIT_S = 1.0


class PeerLink:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, curve: tuple[bytes, bytes, bytes] | None) -> None:
        self.address = address
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PEER_REPLY_BYTES + 4096)
        sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        # Queue only to a live connection: a request sent while the peer is down is refused at
        # once rather than kept and delivered to it, stale, once it is back.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RCVHWM, 4)  # replies are read as they come; a flood waits in TCP
        if "://[" in address:
            sock.setsockopt(zmq.IPV6, 1)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
        sock.connect(address)
        self._sock = sock
        self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 16)
        self._waiting: dict[int, asyncio.Future[m.Reply]] = {}
        self._reader = asyncio.ensure_future(self._read())
        #: Replies dropped: unknown id (late or unasked) or not a reply.
        self.dropped = 0

    def next_id(self) -> int:
        return next(self._ids)

    async def call(self, request: m.Request, timeout: float) -> dict[str, Any]:
        """The peer's result, or its typed error raised; ``timeout`` when no reply came in
        ``timeout`` seconds, ``unavailable`` when it cannot be sent."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        # pyzmq's stub of the async poll lacks its flags argument (as protocol/client.py notes).
        if not await self._sock.poll(int(min(timeout, CONNECT_WAIT_S) * 1000), zmq.POLLOUT):  # type: ignore[call-arg]
            raise Unavailable(f"peer {self.address} is not connected (waited {min(timeout, CONNECT_WAIT_S):.1f} s)",
                              peer=self.address)
        future: asyncio.Future[m.Reply] = loop.create_future()
        self._waiting[request.id] = future
        try:
            self.send(request)
            reply = await asyncio.wait_for(future, max(0.001, timeout - (loop.time() - started)))
        except asyncio.TimeoutError:
            raise Timeout(f"peer {self.address} did not answer {request.op} in {timeout:.3f} s",
                          peer=self.address) from None
        finally:
            self._waiting.pop(request.id, None)
        if not reply.ok:
            assert reply.error is not None
            raise reply.error
        return reply.result

    def send(self, request: m.Request) -> None:
        """Send without waiting for the reply (peer_release: an unanswered one costs nothing)."""
        try:
            self._sock.send(m.encode_request(request), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise Unavailable(f"cannot send to peer {self.address}: {exc.strerror}", peer=self.address) from None

    async def _read(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                reply = m.decode_peer_reply(frames[-1])
            except KvswapError as exc:
                self.dropped += 1
                log.warning("peer %s sent a frame that is not a reply (%s); dropped", self.address, exc.message)
                continue
            future = self._waiting.get(reply.id) if reply.id is not None else None
            if future is None or future.done():
                self.dropped += 1
                continue
            future.set_result(reply)

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(0)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(Unavailable(f"the link to peer {self.address} closed"))
                future.exception()


class PeerLinks:
    """The links of one daemon, by peer address; the oldest closes beyond MAX_LINKS."""

    def __init__(self) -> None:
        #: (public, secret, server key) to authenticate with, where CURVE is configured.
        self.curve: tuple[bytes, bytes, bytes] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._links: OrderedDict[str, PeerLink] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def get(self, address: str) -> PeerLink:
        if not address.startswith("tcp://"):
            raise BadRequest("a peer address is a tcp:// endpoint", field="peer")
        link = self._links.get(address)
        if link is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            link = self._links[address] = PeerLink(self._ctx, address, self.curve)
            while len(self._links) > MAX_LINKS:
                _, old = self._links.popitem(last=False)
                task = asyncio.ensure_future(old.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._links.move_to_end(address)
        return link

    async def close(self) -> None:
        links, self._links = list(self._links.values()), OrderedDict()
        await asyncio.gather(*(link.close() for link in links), *self._closing, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
