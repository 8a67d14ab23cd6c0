"""What each op does: a table from op name to handler, built once. A handler takes the decoded
request and its deadline and returns the result map the wire carries (docs/protocol.md) or
raises a typed error; swap_out and swap_in results are the typed ones of
``kvswap.protocol.results``, put on the wire here.

The swap ops are the swapper's; the rest are the daemon's own: identity and limits (hello),
liveness (ping), the registration (register, unregister) and the state (stats).
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from kvswap import __version__
from kvswap.protocol import messages as m
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import CacheLayout
from kvswap.protocol.limits import MAX_KEY_LENGTH, MAX_KEYS_PER_REQUEST, MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from kvswap.common.units import round_up_to_page
from kvswap.protocol.results import SwapInResult, SwapOutResult

from .config import Config
from .deadline import Deadline
from .peer import PeerTransfer, peer_off
from .peer_records import current_registration, wait_for_prefix
from .registrar import Caller
from .swapper import Swapper

Handler = Callable[[Any, Deadline], Awaitable[Any]]
#: An op answered from memory at once (Ops.answer_now): its result, or None to run it as a task.
NowHandler = Callable[[Any], "dict[str, Any] | None"]

#: Time kept back from a lookup's deadline for its answer after a ``wait_ms`` wait.
WAIT_ANSWER_MARGIN_S = 0.05


class Ops:
    """The op handlers of one daemon. ``describe()`` adds the daemon's own facts (version,
    storage directory, ports, descriptors) to ``stats``."""

    def __init__(self, config: Config, swapper: Swapper, describe: Callable[[], dict[str, Any]],
                 peer: PeerTransfer | None = None) -> None:
        self.config = config
        self.swapper = swapper
        #: Daemon-to-daemon transfer (peer.py), where ``--peer-address`` turns it on.
        self.peer = peer
        self._describe = describe
        s = swapper
        self.table: dict[str, Handler] = {
            "hello": self._hello,
            "ping": self._ping,
            "register": self._register,
            "unregister": self._unregister,
            "swap_out": lambda r, d: s.swap_out(r.block_ids, r.keys, r.wait, d, r.partial, Caller(r.token, r.pid),
                                                r.metas()),
            "swap_in": lambda r, d: s.swap_in(r.keys, r.block_ids, d, Caller(r.token, r.pid)),
            "lookup": self._lookup,
            "delete": lambda r, d: s.delete(r.keys),
            "clear": lambda r, d: s.clear(),
            "flush": lambda r, d: s.flush(),
            "stats": self._stats,
            "peer_export": self._peer_export,
            "peer_release": self._peer_release,
        }
        #: Ops that may be answered from memory where they are read (dispatch.py): no task, no
        #: thread, no await between the frame and its answer.
        self.now: dict[str, NowHandler] = {
            "ping": lambda r: {"pong": True},
            "hello": self._hello_now,
            "lookup": self._lookup_now,
        }

    async def handle(self, request: m.Request, deadline: Deadline) -> dict[str, Any]:
        result = await self.table[request.op](request, deadline)
        if isinstance(result, (SwapOutResult, SwapInResult)):
            return result.to_wire()
        return result

    def answer_now(self, request: m.Request) -> dict[str, Any] | None:
        """``request``'s result if memory alone gives it, else None (then :meth:`handle` runs it)."""
        now = self.now.get(request.op)
        return now(request) if now is not None else None

    async def _hello(self, request: m.Hello, deadline: Deadline) -> dict[str, Any]:
        return self._hello_now(request)

    def _hello_now(self, request: m.Hello) -> dict[str, Any]:
        out = {"server": "kvswapd", "version": __version__, "protocol": PROTOCOL_VERSION,
               "registered": self.swapper.registration is not None,
               "limits": {"max_message_bytes": MAX_MESSAGE_BYTES, "max_keys_per_request": MAX_KEYS_PER_REQUEST,
                          "max_key_length": MAX_KEY_LENGTH}}
        if self.peer is not None:
            out["peer"] = self.peer.hello()
        return out

    async def _lookup(self, request: m.Lookup, deadline: Deadline) -> dict[str, Any]:
        if request.peer:
            if self.peer is None:
                raise peer_off("lookup with peer")
            return await self.peer.lookup(request, deadline)
        if request.wait_ms:
            # Keys still on their way here (a swap_out's copy): waited for, then looked up.
            registration = current_registration(self.swapper)
            until = time.monotonic() + min(request.wait_ms / 1000, deadline.remaining() - WAIT_ANSWER_MARGIN_S)
            await wait_for_prefix(self.swapper, registration, request.keys, until)
        return await self.swapper.lookup(request.keys)

    def _lookup_now(self, request: m.Lookup) -> dict[str, Any] | None:
        """A plain lookup whose every key the in-memory indexes know; not one that pulls from a
        peer or waits for keys on their way."""
        if request.peer or request.wait_ms:
            return None
        return self.swapper.lookup_now(request.keys)

    async def _peer_export(self, request: m.PeerExport, deadline: Deadline) -> dict[str, Any]:
        if self.peer is None:
            raise peer_off("peer_export")
        return await self.peer.export(request, deadline)

    async def _peer_release(self, request: m.PeerRelease, deadline: Deadline) -> dict[str, Any]:
        if self.peer is None:
            raise peer_off("peer_release")
        return await self.peer.release(request, deadline)

    async def _ping(self, request: m.Ping, deadline: Deadline) -> dict[str, Any]:
        return {"pong": True}

    async def _register(self, request: m.Register, deadline: Deadline) -> dict[str, Any]:
        # Before anything is mapped or allocated: staging holds at least one whole record (a
        # slot: whole pages) per pool, so a layout with huge records (over a sparse segment that
        # costs its sender nothing) would make the daemon allocate and touch that much memory
        # twice over.
        layout = CacheLayout.from_wire(request.layout)
        slot = round_up_to_page(layout.record_bytes)
        budget = min(self.config.write_staging_bytes, self.config.read_staging_bytes)
        if slot > budget:
            raise InvalidLayout(f"a record of {layout.record_bytes} bytes does not fit in the staging memory of "
                                f"{budget} bytes; raise --write-staging-bytes and --read-staging-bytes",
                                record_bytes=layout.record_bytes, staging_bytes=budget)
        return await self.swapper.register(request.layout, request.handles, request.regions, request.pid)

    async def _unregister(self, request: m.Unregister, deadline: Deadline) -> dict[str, Any]:
        return {"released": await self.swapper.unregister(Caller(request.token, request.pid))}

    async def _stats(self, request: m.Stats, deadline: Deadline) -> dict[str, Any]:
        out = self.swapper.stats()
        out.update(self._describe())
        if self.peer is not None:
            out["peer"] = self.peer.describe()
        return out
