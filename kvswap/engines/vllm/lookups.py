"""Lookups that never hold the scheduler: sent to every rank's daemon at once, answered from
their replies on a later call.

vLLM's scheduler asks ``get_num_new_matched_tokens`` for each waiting request, every step, and
serves every request in between; a connector that waits for a round trip there stalls them
all (a slow daemon, a busy loop, a full socket queue). vLLM lets the answer be ``None``: "not
known yet, ask again". :class:`Lookups` answers ``None`` until every daemon replied, then the
stored prefix: the shortest of the ranks' (a block is loadable only where every rank holds it).

An answer of ``None`` costs the request a scheduler step, so the lookup is sent earlier, when
vLLM adds the request (``on_new_request``), for the request's keys from its first block: by
the time the scheduler first asks (from past the engine's own prefix-cache hit) the reply is
usually there, and answers that question too as long as the daemons hold at least what the
engine's own cache does (they saved it). Otherwise the lookup goes out again from there.

The answer is older than the load that acts on it; a record evicted in between fails its
load, which vLLM recomputes (the load-error path), never a wrong token.

No vLLM here: the suite drives this against a real kvswapd.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvswap.protocol.client import Client
from kvswap.protocol.errors import KvswapError
from kvswap.protocol.messages import Lookup

#: Lookups in flight at most; past it a request is answered "no hit" at once rather than
#: queueing more work on the daemons than the scheduler has requests to admit.
MAX_IN_FLIGHT = 4096


@dataclass
class _Asked:
    #: The asked keys are the request's from block ``start`` on.
    start: int
    keys: tuple[str, ...]
    #: One request id per client, in client order.
    ids: list[int]
    sent: float
    #: Scheduler time already spent waiting for the replies (see ``wait_s``).
    waited: float = 0.0
    #: A decode request's (:mod:`.pd`): per client, the daemon its daemon pulls the keys from,
    #: and how long that may wait for them.
    peers: tuple[str, ...] = ()
    wait_ms: int = 0


class Lookups:
    """The lookups of waiting requests, by vLLM request id.

    ``wait_s``: how long, in all, the calls for one request may wait for its replies before
    answering None. A None costs that request a scheduler step, tens of ms once a batch runs,
    while a wait holds every request for as long; a budget of about one idle round trip (1-2
    ms here) answers most lookups in the first call and bounds what a slow daemon costs the
    scheduler per new request. 0: never wait.

    ``on_error(exc)`` is told of a daemon's failure (the answer is then 0 hits); ``on_answer(
    seconds, keys, hits)`` of each answer, ``seconds`` from sending to the call that saw the
    last reply (what the request waited, as the engine saw it)."""

    def __init__(self, clients: Sequence[Client], timeout: float,
                 on_answer: Callable[[float, int, int], None] = lambda s, k, h: None,
                 on_error: Callable[[KvswapError], None] = lambda exc: None, wait_s: float = 0.0) -> None:
        self.clients = list(clients)
        self.timeout = timeout
        self.wait_s = wait_s
        self.on_answer = on_answer
        self.on_error = on_error
        self._asked: dict[str, _Asked] = {}
        #: Lookups nobody waits for any more (the request left, or asked for other keys):
        #: their replies are collected when they come, so no client keeps them.
        self._abandoned: list[tuple[Client, int]] = []

    def __len__(self) -> int:
        return len(self._asked)

    def ask(self, req_id: str, keys: Sequence[str], start: int = 0, peers: Sequence[str] = (),
            wait_ms: int = 0) -> int | None:
        """How many of ``keys[start:]``, from the first on, every daemon holds; None while a
        reply is missing (sent now, if it was not). ``peers`` (one per client): each daemon
        first pulls the keys it lacks from that peer daemon, which may wait ``wait_ms`` for
        them (a decode request, :mod:`.pd`)."""
        self._reap()
        wanted = tuple(keys[start:])
        asked = self._asked.get(req_id)
        if asked is not None and not (asked.start <= start and asked.keys[start - asked.start:] == wanted):
            # Asked for other keys (the engine's own cache holds less than a step ago).
            self.forget(req_id)
            asked = None
        if asked is None:
            if self._send(req_id, wanted, start, tuple(peers), wait_ms) == 0:
                return 0
            asked = self._asked[req_id]
        if not self._replied(asked):
            return None
        del self._asked[req_id]
        hits = self._answer(asked)
        skip = start - asked.start
        if hits >= skip:
            return hits - skip
        # The daemons hold less than the engine's own cache: what they hold past it is unknown.
        return self._send(req_id, wanted, start, asked.peers, asked.wait_ms)

    def _replied(self, asked: _Asked) -> bool:
        """Whether every daemon replied, waiting for them up to what is left of the budget."""
        started = time.perf_counter()
        for client, request_id in zip(self.clients, asked.ids):
            left = self.wait_s - asked.waited - (time.perf_counter() - started)
            if not client.done(request_id, within=max(0.0, left)):
                asked.waited += time.perf_counter() - started
                return False
        return True

    def prefetch(self, req_id: str, keys: Sequence[str], peers: Sequence[str] = (), wait_ms: int = 0) -> None:
        """Send the lookup of a request just added, from its first block, so that its reply is
        likely there when the scheduler first asks."""
        if keys and req_id not in self._asked:
            self._send(req_id, tuple(keys), 0, tuple(peers), wait_ms)

    def forget(self, req_id: str) -> None:
        """The request left (finished, aborted) or asks for other keys: drop its lookup."""
        asked = self._asked.pop(req_id, None)
        if asked is not None:
            self._abandoned.extend(zip(self.clients, asked.ids))

    def _send(self, req_id: str, keys: tuple[str, ...], start: int, peers: tuple[str, ...] = (),
              wait_ms: int = 0) -> int | None:
        if len(self._asked) >= MAX_IN_FLIGHT:
            return 0
        ids: list[int] = []
        try:
            for i, client in enumerate(self.clients):
                body: dict[str, object] = {"keys": keys}
                if peers:
                    body.update(peer=peers[i], wait_ms=wait_ms)
                # A pull may wait wait_ms at the peer, then copy: the reply's own budget on top.
                ids.append(client.send(Lookup, body, timeout=self.timeout + wait_ms / 1000, block=False))
        except KvswapError as exc:
            self._abandoned.extend(zip(self.clients, ids))
            self.on_error(exc)
            return 0
        self._asked[req_id] = _Asked(start, keys, ids, time.perf_counter(), peers=peers, wait_ms=wait_ms)
        return None

    def _answer(self, asked: _Asked) -> int:
        hits = len(asked.keys)
        failure: KvswapError | None = None
        for client, request_id in zip(self.clients, asked.ids):
            try:
                hits = min(hits, int(client.wait(request_id)["hits"]))
            except KvswapError as exc:
                failure = exc
        if failure is not None:
            self.on_error(failure)
            hits = 0
        self.on_answer(time.perf_counter() - asked.sent, len(asked.keys), hits)
        return hits

    def _reap(self) -> None:
        if not self._abandoned:
            return
        keep = []
        for client, request_id in self._abandoned:
            try:
                if not client.done(request_id):
                    keep.append((client, request_id))
                    continue
                client.wait(request_id)
            except (KvswapError, KeyError):
                pass
        self._abandoned = keep

    def close(self) -> None:
        for req_id in list(self._asked):
            self.forget(req_id)
        self._abandoned.clear()
