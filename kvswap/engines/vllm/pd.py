"""Prefill/decode disaggregation in the vLLM connector: what a prefill engine tells the decode
engine through the request's ``kv_transfer_params``, and where the decode's daemon fetches the
prompt's KV from. Plain Python (no vLLM), so the suite tests it without an engine.

The flow, in the shape of vLLM's disaggregated-serving proxy:

1. the proxy sends the prompt to the prefill engine with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``; the prefill's connector saves the
   prompt's full blocks to its kvswapd as for any request (and loads the conversation's history
   from the pool where its daemon retrieves from one);
2. when that request finishes, the connector returns :func:`decode_params`: the peer addresses
   of the prefill's daemons (one per rank, from their ``hello``) and the number of blocks it
   saved or found stored. vLLM puts them in the request's output; the proxy passes them on;
3. the proxy sends the same prompt to the decode engine with those params. The decode's
   connector looks the prompt up in its own kvswapd with ``peer`` set and a ``wait_ms`` budget:
   the daemon pulls the blocks past what it holds from the prefill's daemon, waiting for ones
   still being written there (the prefill's save is asynchronous: the decode request can come
   before it landed), and answers once they are loadable; the connector loads them. The decode
   daemon also writes them to its store locations, the shared pool among them, so the next
   turn's prefill, on whichever node, finds the whole history there.

Params are the client's to send, so a decode request's are checked here and ignored (recompute)
when malformed, never trusted to name more daemons than the engine has ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvswap.protocol.client import Client
from kvswap.protocol.errors import KvswapError, Unavailable
from kvswap.protocol.messages import Hello

from .plan import Backoff

log = logging.getLogger("vllm.kvswap")

#: How long, by default, a decode lookup lets its daemon wait for the prefill's blocks
#: (``kv_connector_extra_config["pd_wait_ms"]``). The prefill's save is sent right after its
#: forward, so the blocks are normally there within a few ms of the prefill's answer; the
#: budget covers a busy prefill daemon. On it, the decode recomputes what had not come.
DEFAULT_WAIT_MS = 5000.0
#: Longest peer address accepted from a request (the daemon's own limit on short strings).
MAX_ADDRESS = 256


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request: the proxy asks for params the decode can load from."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


def decode_params(peers: Sequence[str], blocks: int) -> dict[str, Any]:
    """What a finished prefill request returns for its decode request.

    >>> decode_params(["tcp://p:1"], 3)
    {'do_remote_prefill': True, 'do_remote_decode': False, 'kvswap_peers': ['tcp://p:1'], 'kvswap_blocks': 3}
    """
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvswap_peers": list(peers),
            "kvswap_blocks": blocks}


def remote_peers(params: Mapping[str, Any] | None, ranks: int) -> list[str] | None:
    """The prefill daemons a decode request's KV is at, one per rank, or None: not a decode
    request, or params that do not name one daemon per rank (logged, then ignored).

    >>> remote_peers({"do_remote_prefill": True, "kvswap_peers": ["tcp://p:1"]}, 1)
    ['tcp://p:1']
    >>> remote_peers({"do_remote_prefill": True, "kvswap_peers": ["tcp://p:1"]}, 2) is None
    True
    >>> remote_peers({"kvswap_peers": ["tcp://p:1"]}, 1) is None
    True
    """
    if not params or not params.get("do_remote_prefill"):
        return None
    peers = params.get("kvswap_peers")
    if (not isinstance(peers, list) or len(peers) != ranks
            or not all(isinstance(p, str) and 0 < len(p) <= MAX_ADDRESS for p in peers)):
        log.warning("kvswap connector: a decode request's kv_transfer_params name no prefill daemon per rank "
                    "(kvswap_peers=%.200r for %d ranks); recomputing its prompt", peers, ranks)
        return None
    return list(peers)


def remote_blocks(params: Mapping[str, Any] | None) -> int | None:
    """How many leading blocks of the prompt the prefill saved or found stored (its
    ``kvswap_blocks``), or None where not said: the decode asks for no more (a block the
    prefill never saved would hold its lookup for the whole wait).

    >>> remote_blocks({"kvswap_blocks": 3}), remote_blocks({"kvswap_blocks": "3"}), remote_blocks(None)
    (3, None, None)
    """
    blocks = params.get("kvswap_blocks") if params else None
    return blocks if isinstance(blocks, int) and not isinstance(blocks, bool) and blocks >= 0 else None


class PeerAddresses:
    """The addresses other daemons reach this engine's daemons at, one per rank: each daemon's
    ``hello()["peer"]["address"]``, asked without blocking the scheduler: sent when a prefill
    request is added (:meth:`prepare`; its prefill takes at least a step, by which time the
    reply is in), read when it finishes (:meth:`get`), then kept. A daemon that answered
    without an address, or with an error, is asked again after ``retry_s``; one not connected
    yet, at the next request. None while unknown: the decode then has nothing to pull from and
    recomputes."""

    def __init__(self, clients: Sequence[Client], timeout: float, retry_s: float) -> None:
        self.clients = list(clients)
        self.timeout = timeout
        self.backoff = Backoff(retry_s)
        self._ids: list[int] | None = None
        self._addresses: list[str] | None = None
        self._warned = False
        self._stale: list[tuple[Client, int]] = []

    def prepare(self) -> None:
        """Ask, unless known or asked already."""
        if self._addresses is None and self._ids is None and self.backoff.open:
            ids = []
            try:
                for client in self.clients:
                    ids.append(client.send(Hello, {"client": "vllm-connector"}, timeout=self.timeout, block=False))
            except KvswapError as exc:
                self._stale += zip(self.clients, ids)  # sent to the ranks before: collected later
                self._failed(exc)
                return
            self._ids = ids

    def get(self) -> list[str] | None:
        if self._addresses is not None:
            return self._addresses
        self._collect_stale()
        if self._ids is None:
            self.prepare()
            return None
        if not all(c.done(i) for c, i in zip(self.clients, self._ids)):
            return None
        ids, self._ids = self._ids, None
        addresses = []
        try:
            for client, request_id in zip(self.clients, ids):
                peer = client.wait(request_id).get("peer") or {}
                addresses.append(str(peer.get("address") or ""))
        except KvswapError as exc:
            self._failed(exc)
            return None
        if not all(addresses):
            if not self._warned:
                log.warning("kvswap connector: a prefill request asks for remote decode, but a daemon has no "
                            "--peer-address; the decode engine will recompute its prompts")
                self._warned = True
            self.backoff.hold()
            return None
        self._addresses = addresses
        return addresses

    def _collect_stale(self) -> None:
        keep = []
        for client, request_id in self._stale:
            if not client.done(request_id):
                keep.append((client, request_id))
                continue
            try:
                client.wait(request_id)
            except KvswapError:
                pass
        self._stale = keep

    def _failed(self, exc: KvswapError) -> None:
        log.warning("kvswap connector: asking the daemons for their peer addresses failed (%s)", exc)
        if not isinstance(exc, Unavailable):  # not connected (yet) costs nothing to ask again
            self.backoff.hold()
