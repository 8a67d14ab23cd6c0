"""The importing side of a daemon-to-daemon transfer: ``lookup`` with ``peer``.

The decode node's daemon counts the leading keys it has itself; the rest it pulls from the peer
that holds them (the prefill node's daemon), asking with ``peer_export`` (peer_export.py) and
waiting, up to the lookup's ``wait_ms`` and its deadline, for keys still on their way. Each
record received is checked before it counts: its header core must be the one the file tier would
accept for this namespace, key and record size, and the payload's checksum must match
(backends/record.py); the first record that fails ends the prefix, and nothing from it on is
stored. Records that pass are stored as swap_out stores (Swapper.ingest): readable here at
once, written to the store locations (the pool) in the background, so a slow or down pool
neither fails nor holds the lookup.

Concurrent lookups that need the same keys share one pull: a key being pulled is claimed, and
a second lookup waits for that claim's outcome instead of asking again.

The lookup answers by its deadline whatever the pull is doing: with the keys here by then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvswap.backends.record import HEADER_CORE_BYTES, decode_header, verify
from kvswap.protocol import messages as m
from kvswap.protocol.errors import Corrupt, KvswapError
from kvswap.protocol.limits import MAX_KEYS_PER_REQUEST

from .background import Background
from .config import peer_host
from .data_threads import run
from .deadline import Deadline
from .peer_buffer import TransitBuffer
from .peer_link import PeerLinks
from .peer_records import current_registration, landed_prefix, wait_for_prefix
from .peer_stats import PeerStats
from .peer_transport import TransferEngineLink
from .swapper import Swapper

log = logging.getLogger("kvswap.daemon.peer")

#: Time kept back from the lookup's deadline for its answer.
ANSWER_MARGIN_S = 0.05
#: Time a peer is given past its wait to answer (its copy, the transfer of the reply).
REPLY_GRACE_S = 1.0
#: Error codes of a peer's reply, as pull-failure reasons.
_REASONS = {"timeout": "timeout", "unavailable": "unreachable", "busy": "export_busy"}


class PullRefused(Exception):
    """A peer's reply that cannot be taken as it is: ``reason`` is the failure's label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Progress:
    """How many records one lookup's pull has stored so far (read when the lookup answers)."""

    pulled: int = 0


class Importer:
    def __init__(self, swapper: Swapper, links: PeerLinks, buffer: TransitBuffer, engine: TransferEngineLink | None,
                 stats: PeerStats) -> None:
        self.swapper = swapper
        self.links = links
        self.buffer = buffer
        self.engine = engine
        self.stats = stats
        #: Keys being pulled, by (namespace, key): resolves True once the key is here.
        self._claims: dict[tuple[str, str], asyncio.Future[bool]] = {}
        #: Pulls still running after their lookup answered (its deadline came first).
        self._pulls = Background("peer pulls")

    async def stop(self) -> None:
        await self._pulls.stop()

    async def lookup(self, keys: Sequence[str], peer: str, wait_ms: int, deadline: Deadline) -> dict[str, Any]:
        registration = current_registration(self.swapper)
        started = time.monotonic()
        answer_by = started + deadline.remaining() - ANSWER_MARGIN_S
        wait_until = min(started + wait_ms / 1000, answer_by)
        local = await landed_prefix(self.swapper, registration, keys)
        progress = Progress()
        if local < len(keys) and peer:
            pull = self._pulls.spawn(self._pull(registration.namespace, registration.record_bytes, keys[local:],
                                                peer, wait_until, answer_by, progress), "a pull from a peer",
                                     cancel_on_stop=True)
            await asyncio.wait({pull}, timeout=max(0.0, answer_by - time.monotonic()))
            self.stats.pull_took(time.monotonic() - started)
        elif local < len(keys):
            await wait_for_prefix(self.swapper, registration, keys, wait_until)
        # The ordinary lookup now: it counts what arrived, touches the hit chain, counts the keys.
        hits = (await self.swapper.lookup(keys))["hits"]
        return {"hits": hits, "pulled": progress.pulled} if peer else {"hits": hits}

    async def _pull(self, namespace: str, record_bytes: int, keys: Sequence[str], peer: str, wait_until: float,
                    answer_by: float, progress: Progress) -> None:
        """Bring ``keys`` here from ``peer``, head first, sharing claimed keys with other pulls."""
        loop = asyncio.get_running_loop()
        pos = 0
        while pos < len(keys):
            claim = self._claims.get((namespace, keys[pos]))
            if claim is not None:
                if not await asyncio.shield(claim):
                    return
                # That pull brought this key and maybe more: go on past all it brought.
                registration = self.swapper.registration
                if registration is None or registration.namespace != namespace:
                    return
                pos += max(1, await landed_prefix(self.swapper, registration, keys[pos:]))
                continue
            run_keys = []
            for key in keys[pos:]:
                if (namespace, key) in self._claims:
                    break
                run_keys.append(key)
            claims = {key: loop.create_future() for key in run_keys}
            self._claims.update({(namespace, key): claim for key, claim in claims.items()})
            landed = 0
            try:
                landed = await self._pull_run(namespace, record_bytes, run_keys, peer, wait_until, answer_by, progress)
            finally:
                for i, key in enumerate(run_keys):
                    claims[key].set_result(i < landed)
                    del self._claims[(namespace, key)]
            pos += landed
            if landed < len(run_keys):
                return

    async def _pull_run(self, namespace: str, record_bytes: int, keys: list[str], peer: str, wait_until: float,
                        answer_by: float, progress: Progress) -> int:
        """Ask ``peer`` for ``keys`` until it has no more of them in time; return how many
        leading ones were stored here."""
        link = self.links.get(peer)
        by_engine = self.engine is not None
        landed = 0
        while landed < len(keys):
            now = time.monotonic()
            if now >= answer_by:
                break
            ask = keys[landed:landed + self._ask_limit(record_bytes)]
            wait_s = max(0.0, wait_until - now)
            timeout = min(answer_by - now, wait_s + REPLY_GRACE_S)
            request = m.PeerExport(id=link.next_id(), timeout_ms=max(1, int(timeout * 1000)), keys=tuple(ask),
                                   namespace=namespace, wait_ms=int(wait_s * 1000),
                                   transport="mooncake" if by_engine else "inline")
            try:
                result = await link.call(request, timeout)
                payloads, whole = await self._receive(result, ask, record_bytes, peer, link)
            except KvswapError as exc:
                self.stats.count_failure(_REASONS.get(exc.code, "refused"))
                log.info("pull of %d records from %s stopped: %s: %s", len(ask), peer, exc.code, exc.message)
                break
            except PullRefused as exc:
                self.stats.count_failure(exc.reason)
                log.warning("pull from %s: %s; nothing past the last good record is stored", peer, exc)
                break
            try:
                accepted = await self.swapper.ingest(namespace, ask[:len(payloads)], [p.view for p in payloads])
            finally:
                for p in payloads:
                    p.release()
            if accepted < len(payloads):
                self.stats.count_failure("no_staging")
            landed += accepted
            progress.pulled += accepted
            self.stats.pulled(accepted, accepted * record_bytes)
            # A short answer is not the end: the peer may have cut it to its buffer, and a key it
            # lacked may come before the wait ends. An empty one is (the wait is over by then).
            if accepted == 0 or accepted < len(payloads) or not whole:
                break
        return landed

    def _ask_limit(self, record_bytes: int) -> int:
        limit = MAX_KEYS_PER_REQUEST
        if self.engine is not None:
            limit = min(limit, max(1, self.buffer.capacity(record_bytes)))
        return limit

    async def _receive(self, result: dict[str, Any], ask: list[str], record_bytes: int, peer: str,
                       link: Any) -> tuple[list["Received"], bool]:
        """The verified leading records of a peer_export result, and whether all of them
        passed. Raises :class:`PullRefused` for a reply that breaks the protocol (nothing of it is
        taken); returns the records before the first that fails its check (counted as
        ``corrupt``), which ends the pull."""
        records = result.get("records")
        if not isinstance(records, list) or len(records) > len(ask):
            raise PullRefused("malformed", f"peer_export answered {type(records).__name__} records for "
                              f"{len(ask)} keys asked")
        transport = result.get("transport")
        headers = [_header_of(r, i) for i, r in enumerate(records)]
        if transport == "mooncake" and records:
            if self.engine is None:
                raise PullRefused("malformed", "the peer answered by the transfer engine, which was not asked for")
            lease = result.get("lease")
            try:
                payloads = await self._read_leased(result, records, ask, record_bytes, peer)
            finally:
                if isinstance(lease, str) and 0 < len(lease) <= 256:
                    try:
                        link.send(m.PeerRelease(id=link.next_id(), lease=lease))
                    except KvswapError:
                        pass  # the lease expires on its own
        elif transport == "inline" or not records:
            payloads = [Received(_inline_data(r, ask, i, record_bytes)) for i, r in enumerate(records)]
        else:
            raise PullRefused("malformed", f"unknown transport {str(transport)[:32]!r}")
        namespace = bytes.fromhex(current_registration(self.swapper).namespace)
        good = await run(self.swapper.threads.copy, _verified_prefix, namespace, ask, headers,
                         [p.view for p in payloads], record_bytes)
        if good < len(payloads):
            self.stats.count_failure("corrupt")
            log.warning("record %d of %d from %s failed its check; it and the rest are misses", good, len(payloads),
                        peer)
            for p in payloads[good:]:
                p.release()
        return payloads[:good], good == len(payloads)

    async def _read_leased(self, result: dict[str, Any], records: list[Any], ask: list[str], record_bytes: int,
                           peer: str) -> list["Received"]:
        """Read leased records from the peer's transfer-engine segment into the receive buffer."""
        assert self.engine is not None
        segment = result.get("segment")
        host = peer_host(peer)
        if not isinstance(segment, str) or segment.rpartition(":")[0] != host:
            # Only the peer's own host: a reply must not send this daemon's engine elsewhere.
            raise PullRefused("malformed", f"segment {str(segment)[:64]!r} is not on the peer's host {host}")
        remote = []
        for i, r in enumerate(records):
            _check_record(r, ask, i)
            addr, length = r.get("addr"), r.get("length")
            if not isinstance(addr, int) or isinstance(addr, bool) or addr < 0 or length != record_bytes:
                raise PullRefused("malformed", f"record {i}: address {addr!r}, length {length!r} (a record is "
                                  f"{record_bytes} bytes)")
            remote.append(addr)
        offsets = self.buffer.take(len(records), record_bytes)
        if len(offsets) < len(records):
            self.buffer.give(offsets)
            raise PullRefused("no_staging", "the receive buffer is full")
        local = [self.buffer.address + o for o in offsets]
        rc = await run(self.swapper.threads.read, self.engine.read, segment, local, remote,
                       [record_bytes] * len(records))
        if rc != 0:
            self.buffer.give(offsets)
            raise PullRefused("transfer", f"the transfer engine's read from {segment} failed (code {rc})")
        return [Received(self.buffer.view(o, record_bytes), self.buffer, o) for o in offsets]


class Received:
    """One received record's bytes: in the receive buffer (given back on release) or inline."""

    def __init__(self, view: Any, buffer: TransitBuffer | None = None, offset: int = 0) -> None:
        self.view = view
        self._buffer = buffer
        self._offset = offset

    def release(self) -> None:
        if self._buffer is not None:
            self._buffer.give([self._offset])
            self._buffer = None


def _check_record(record: Any, ask: list[str], index: int) -> None:
    if not isinstance(record, dict) or record.get("key") != ask[index]:
        raise PullRefused("malformed", f"record {index} is not the record of {ask[index]}")


def _header_of(record: Any, index: int) -> bytes:
    header = record.get("header") if isinstance(record, dict) else None
    if not isinstance(header, bytes) or len(header) < HEADER_CORE_BYTES:
        raise PullRefused("malformed", f"record {index} has no record header")
    return header


def _inline_data(record: Any, ask: list[str], index: int, record_bytes: int) -> np.ndarray:
    _check_record(record, ask, index)
    data = record.get("data")
    if not isinstance(data, bytes) or len(data) != record_bytes:
        raise PullRefused("malformed", f"record {index} carries {len(data) if isinstance(data, bytes) else 'no'} "
                          f"bytes; a record is {record_bytes}")
    return np.frombuffer(data, dtype=np.uint8)


def _verified_prefix(namespace: bytes, keys: list[str], headers: list[bytes], payloads: list[Any],
                     record_bytes: int) -> int:
    """Leading records whose header core is a valid one for this namespace, key and size and
    whose payload's checksum matches it (the file tier's read check)."""
    for i, (key, header, payload) in enumerate(zip(keys, headers, payloads)):
        try:
            parsed = decode_header(header)
            if parsed.payload_len != record_bytes:
                raise Corrupt("record of another size")
            verify(parsed, namespace, key, payload)
        except Corrupt:
            return i
    return len(payloads)
