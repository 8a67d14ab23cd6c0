"""How record bytes move between two daemons: Mooncake's transfer engine, or inline.

With the transfer engine each daemon runs one engine (TCP, or RDMA in a data centre) and
registers its transit buffers with it; an importer reads an exporter's held records straight
from the exporter's buffer into its own (``batch_transfer_sync_read``), and the control socket
carries only where they are. Inline, the records ride in the peer_export reply itself (the
fallback where no transfer engine runs; one reply carries at most the message limit).

The engine's handshake is P2P (``P2PHANDSHAKE``: no metadata server); its segment name,
``host:rpc_port``, is what an exporter tells its peers. The engine serves reads of registered
memory only (it refuses an address outside it), and it has no authentication of its own: see
docs/security.md.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

log = logging.getLogger("kvswap.daemon.peer")


class TransportError(Exception):
    """The transfer engine cannot start, or a transfer failed; the message says which."""


class TransferEngineLink:
    """This daemon's Mooncake transfer engine: it serves reads of the registered buffers and
    reads peers' records. ``read`` blocks (call it on a thread)."""

    def __init__(self, host: str, protocol: str = "tcp") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransportError(f"mooncake.engine does not import ({exc}); pip install mooncake-transfer-engine") \
                from None
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransportError(f"the transfer engine did not start on {host} over {protocol} (code {rc})")
        #: What peers read this daemon's records from.
        self.segment = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, address: int, nbytes: int) -> None:
        rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise TransportError(f"the transfer engine did not register {nbytes} bytes (code {rc})")

    def unregister(self, address: int) -> None:
        self._engine.unregister_memory(address)

    def read(self, segment: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> int:
        """Read ``lengths[i]`` bytes at ``remote[i]`` of ``segment`` into ``local[i]``; 0 on
        success, else the engine's (negative) code."""
        return int(self._engine.batch_transfer_sync_read(segment, list(local), list(remote), list(lengths)))


def open_transport(mode: str, host: str, protocol: str = "tcp") -> TransferEngineLink | None:
    """The transfer engine for ``mode`` (mooncake: required; auto: where it starts), or None
    for inline. Raises :class:`TransportError` when mooncake was asked for and cannot start."""
    if mode == "inline":
        return None
    try:
        return TransferEngineLink(host, protocol)
    except TransportError as exc:
        if mode == "mooncake":
            raise
        log.info("peer transport: inline (%s)", exc)
        return None
