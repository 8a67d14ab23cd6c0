"""The exporting side of a daemon-to-daemon transfer: ``peer_export`` and ``peer_release``.

A peer (the decode node's daemon) asks for records of its namespace by key. The exporter
waits, up to the request's ``wait_ms`` and its deadline, for the keys it lacks (a prefill's
swap_out may still be on its way), then copies the longest prefix it has into its transit
buffer. With the transfer engine the records stay there under a *lease* and the reply says
where they are; the peer reads them and sends ``peer_release``. A lease not released within
``--peer-lease-s`` expires and its slots go back, so a peer that never releases holds at most
the buffer, and for that long. Inline, the bytes are in the reply and nothing is held after it.

Each record goes with its header core (backends/record.py: namespace, key, length, checksum),
so the importer checks what it received exactly as the file tier checks what it reads.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvswap.backends.record import HEADER_CORE_BYTES, encode_header, payload_checksum
from kvswap.protocol import messages as m
from kvswap.protocol.errors import BadRequest, Busy, TooLarge
from kvswap.protocol.limits import MAX_PEER_REPLY_BYTES, PEER_REPLY_OVERHEAD

from .data_threads import run
from .deadline import Deadline
from .peer_buffer import TransitBuffer
from .peer_records import copy_records, current_registration, export_tiers, wait_for_prefix
from .peer_stats import PeerStats
from .peer_transport import TransferEngineLink
from .swapper import Swapper

log = logging.getLogger("kvswap.daemon.peer")

#: Time kept back from a peer_export's deadline for copying and answering after the wait.
ANSWER_MARGIN_S = 0.05
#: Bytes per inline record beside its payload: its header core, its key, the map around them.
INLINE_RECORD_OVERHEAD = HEADER_CORE_BYTES + 256


@dataclass
class ExportLease:
    offsets: list[int]
    timer: asyncio.TimerHandle


class Exporter:
    def __init__(self, swapper: Swapper, buffer: TransitBuffer, engine: TransferEngineLink | None, lease_s: float,
                 stats: PeerStats) -> None:
        self.swapper = swapper
        self.buffer = buffer
        self.engine = engine
        self.lease_s = lease_s
        self.stats = stats
        self.leases: dict[str, ExportLease] = {}

    async def export(self, request: m.PeerExport, deadline: Deadline) -> dict[str, Any]:
        registration = current_registration(self.swapper)
        if request.namespace != registration.namespace:
            raise BadRequest("the records asked for are of another namespace than this daemon's registration (the "
                             "two engines' layouts differ)", field="namespace", namespace=registration.namespace)
        record_bytes = registration.record_bytes
        by_engine = request.transport == "mooncake" and self.engine is not None
        if by_engine:
            cap = self.buffer.capacity(record_bytes)
        else:
            cap = (MAX_PEER_REPLY_BYTES - PEER_REPLY_OVERHEAD) // (record_bytes + INLINE_RECORD_OVERHEAD)
            if cap == 0:
                raise TooLarge(f"a record of {record_bytes} bytes does not fit in a reply; inline transfer needs "
                               "records under the message limit (use the transfer engine)", record_bytes=record_bytes,
                               limit=MAX_PEER_REPLY_BYTES)
        cap = min(cap, len(request.keys))
        wait_s = min(request.wait_ms / 1000, deadline.remaining() - ANSWER_MARGIN_S)
        assert registration.tiers is not None
        local = export_tiers(registration.tiers)
        present = await wait_for_prefix(self.swapper, registration, request.keys, time.monotonic() + wait_s, cap, local)
        present = min(present, cap)
        offsets = self.buffer.take(present, record_bytes)
        if present and not offsets:
            self.stats.count_failure("export_busy")
            raise Busy("the peer export buffer is full; retry once peers release what they read",
                       limit=self.buffer.nbytes)
        outs = [self.buffer.view(o, record_bytes) for o in offsets]
        try:
            copied = await copy_records(self.swapper, registration, request.keys[:len(offsets)], outs, local)
            namespace = bytes.fromhex(registration.namespace)
            headers = await run(self.swapper.threads.copy, _headers, namespace, request.keys[:copied], outs[:copied])
        except BaseException:
            self.buffer.give(offsets)
            raise
        self.buffer.give(offsets[copied:])
        offsets = offsets[:copied]
        self.stats.exported(copied, copied * record_bytes, "mooncake" if by_engine else "inline")
        if not by_engine or not offsets:
            inline: list[dict[str, Any]] = [{"key": key, "header": header, "data": out.tobytes()}
                       for key, header, out in zip(request.keys, headers, outs)]
            self.buffer.give(offsets)
            return {"transport": "inline", "records": inline}
        assert self.engine is not None
        token = secrets.token_hex(16)
        timer = asyncio.get_running_loop().call_later(self.lease_s, self._expire, token)
        self.leases[token] = ExportLease(offsets, timer)
        records: list[dict[str, Any]] = [{"key": key, "header": header, "addr": self.buffer.address + offset, "length": record_bytes}
                   for key, header, offset in zip(request.keys, headers, offsets)]
        return {"transport": "mooncake", "segment": self.engine.segment, "lease": token, "records": records}

    async def release(self, request: m.PeerRelease, deadline: Deadline) -> dict[str, Any]:
        lease = self.leases.pop(request.lease, None)
        if lease is None:
            return {"released": False}  # expired already, or never ours: nothing to free
        lease.timer.cancel()
        self.buffer.give(lease.offsets)
        return {"released": True}

    def _expire(self, token: str) -> None:
        lease = self.leases.pop(token, None)
        if lease is not None:
            self.buffer.give(lease.offsets)
            self.stats.lease_expired()
            log.info("a peer did not release %d exported records within %.1f s; freed", len(lease.offsets),
                     self.lease_s)

    def close(self) -> None:
        for lease in self.leases.values():
            lease.timer.cancel()
        self.leases.clear()


def _headers(namespace: bytes, keys: Any, outs: list[Any]) -> list[bytes]:
    """Each record's header core, as the file tier writes it: what the importer verifies."""
    return [encode_header(namespace, key, out.nbytes, payload_checksum(out))[:HEADER_CORE_BYTES]
            for key, out in zip(keys, outs)]

