"""Daemon-to-daemon transfer for prefill/decode disaggregation (``--peer-address``).

A prefill engine saves a prompt's KV to its own kvswapd (swap_out); the decode engine, on
another node, asks its own kvswapd ``lookup(keys, peer=<the prefill daemon's peer address>)``,
which pulls the records it lacks straight from that daemon (peer_import.py), not through the
shared pool, and answers once they are loadable here; the engine then loads them with an
ordinary swap_in. The decode daemon also writes them to its store locations (the pool), where
the next turn's prefill finds the conversation. Every daemon with a peer address both exports
(peer_export.py) and imports.

This module builds the parts from the configuration: the transport (peer_transport.py), two
transit buffers of ``--peer-export-bytes`` (records held for peers; records received), the
links to peers (peer_link.py) and the counts (peer_stats.py).
"""

from __future__ import annotations

import logging
from typing import Any

from kvswap.protocol import messages as m
from kvswap.protocol.errors import BadRequest

from .config import Config, peer_host
from .curve import load_public_key, load_secret_key
from .deadline import Deadline
from .peer_buffer import TransitBuffer
from .peer_export import Exporter
from .peer_import import Importer
from .peer_link import PeerLinks
from .peer_stats import PeerStats
from .peer_transport import TransferEngineLink, open_transport
from .swapper import Swapper

log = logging.getLogger("kvswap.daemon.peer")


class PeerTransfer:
    """The peer ops of one daemon. ``start`` (at daemon start-up) opens the transport."""

    def __init__(self, config: Config, swapper: Swapper, stats: PeerStats) -> None:
        self.config = config
        self.swapper = swapper
        self.stats = stats
        self.export_buffer = TransitBuffer(config.peer_export_bytes)
        self.receive_buffer = TransitBuffer(config.peer_export_bytes)
        self.stats.export_buffer_used.labels(state="used").set_function(lambda: self.export_buffer.used_bytes)
        self.stats.export_buffer_used.labels(state="size").set(self.export_buffer.nbytes)
        self.engine: TransferEngineLink | None = None
        self.links = PeerLinks()
        self.exporter = Exporter(swapper, self.export_buffer, None, config.peer_lease_s, self.stats)
        self.importer = Importer(swapper, self.links, self.receive_buffer, None, self.stats)

    @property
    def transport(self) -> str:
        return "mooncake" if self.engine is not None else "inline"

    def start(self) -> None:
        """Open the transport and read the CURVE keys (raises ``TransportError`` when mooncake is
        required and fails, ``CurveError`` for a key file that cannot be read)."""
        self.links.curve = _curve_keys(self.config)
        self.engine = open_transport(self.config.peer_transport, peer_host(self.config.peer_address),
                                     self.config.peer_te_protocol)
        if self.engine is not None:
            for buffer in (self.export_buffer, self.receive_buffer):
                self.engine.register(buffer.address, buffer.nbytes)
        self.exporter.engine = self.importer.engine = self.engine
        log.info("peer transfer on %s: transport %s%s, %d bytes of export buffer, role %s", self.config.peer_address,
                 self.transport, f" (segment {self.engine.segment})" if self.engine else "",
                 self.export_buffer.nbytes, self.config.pd_role)

    async def stop(self) -> None:
        self.exporter.close()
        await self.importer.stop()
        await self.links.close()

    def hello(self) -> dict[str, Any]:
        return {"address": self.config.peer_address, "transport": self.transport, "pd_role": self.config.pd_role}

    def describe(self) -> dict[str, Any]:
        return {**self.hello(), **self.stats.describe(), "leases": len(self.exporter.leases),
                "export_buffer": {"bytes": self.export_buffer.nbytes, "used_bytes": self.export_buffer.used_bytes},
                "receive_buffer": {"bytes": self.receive_buffer.nbytes,
                                   "used_bytes": self.receive_buffer.used_bytes}}

    async def lookup(self, request: m.Lookup, deadline: Deadline) -> dict[str, Any]:
        return await self.importer.lookup(request.keys, request.peer, request.wait_ms, deadline)

    async def export(self, request: m.PeerExport, deadline: Deadline) -> dict[str, Any]:
        return await self.exporter.export(request, deadline)

    async def release(self, request: m.PeerRelease, deadline: Deadline) -> dict[str, Any]:
        return await self.exporter.release(request, deadline)


def peer_off(op: str) -> BadRequest:
    return BadRequest(f"{op} needs peer transfer, which is off on this daemon (start it with --peer-address)",
                      reason="peer_transfer_off")


def _curve_keys(config: Config) -> tuple[bytes, bytes, bytes] | None:
    """The keys a link to a peer authenticates with: this daemon's own keypair, and the peers'
    public key (``--peer-server-key-file``, else this daemon's own: a shared cluster keypair)."""
    if not config.curve:
        return None
    public, secret = load_secret_key(config.curve_secret_key_file)
    server = load_public_key(config.peer_server_key_file) if config.peer_server_key_file else public
    return public, secret, server
