"""KV events: what every tier holds, told as it changes, for cache-aware routers.

Two parts:

- :class:`EventLedger` is what the stores report to (:class:`~kvswap.backends.events.RecordEvents`).
  It keeps which tiers hold each key, and what the engine said about the key in its swap_out
  (:class:`~kvswap.protocol.kv_events.BlockMeta`: its block hashes, parent, tokens), turns each
  change into a vLLM event and queues it. Everything happens under one lock, so the queue is in
  the order the tiers changed.
- :class:`EventPublisher` is a thread that takes the queue in batches and sends them on a PUB
  socket, keeps the last ``buffer_bytes`` of batches, and answers replay requests on a ROUTER.

Rules (docs/protocol.md, "KV events"):

- a ``BlockStored`` when a record becomes readable in a tier, a ``BlockRemoved`` when it leaves
  one (eviction, delete, corrupt, found gone by a rescan); ``clear`` of a tier is one
  ``BlockRemoved`` of that tier's blocks of the namespace, or ``AllBlocksCleared`` when they were
  all the daemon held;
- a block is named by the engine's hashes when its swap_out sent them, else by its key's bytes;
  its parent is the hash the engine sent, else the block before it in the swap_out's key order;
- the first batch of a daemon's life is ``AllBlocksCleared`` (a new process holds nothing in RAM
  and knows nothing of what a predecessor announced), and the start-up scan then announces every
  record it indexes. The same reset-and-announce follows when the queue overflows
  (``MAX_QUEUED_EVENTS``: a publisher that cannot keep up never holds unbounded memory, and a
  subscriber ends up with the current state, not a state with holes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Final, Iterable, Sequence

import msgpack
import zmq

from kvswap.backends.events import RecordEvents
from kvswap.protocol.errors import KvswapError
from kvswap.protocol.kv_events import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockMeta,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
    seq_bytes,
)

log = logging.getLogger(__name__)

#: Events queued for the publisher before the ledger gives up on them and resets instead.
MAX_QUEUED_EVENTS: Final = 100_000
#: Events in one published batch.
MAX_BATCH_EVENTS: Final = 512
#: Hashes in one BlockRemoved of a cleared tier.
MAX_HASHES_PER_REMOVAL: Final = 1024
#: Keys a swap_out described whose records have not landed (or never will: a failed write):
#: their metadata is kept for this many of the newest, then forgotten.
MAX_PENDING_METAS: Final = 1 << 16
#: Memory the engine's names (block_meta) may take in the ledger, all keys together: a peer
#: sending 8,192 token ids with each key of tiny records cannot make names outgrow the records.
MAX_NAME_BYTES: Final = 256 << 20
#: How long the publisher lets events gather into one batch after the first arrives: measured
#: with benchmarks/kv_events_cost.py, one event a batch cost half of copied swap_out's
#: throughput on 2 cores (a wake-up, an encode and a send per event).
BATCH_LINGER_S: Final = 0.002
#: How often the publisher looks for replay requests while no events come.
REPLAY_POLL_S: Final = 0.05
#: Shortest time between two whole-state announcements asked for by replays from before the buffer.
RESTATE_INTERVAL_S: Final = 10.0
#: Messages a replay may queue for one subscriber (ZMQ drops the rest; it asks again).
REPLAY_HWM: Final = 10_000

#: tier -> (medium, locality, ownership) in events.
TIER_MEDIA: Final = {
    "host": (MEDIUM_CPU, "LOCAL", "kvswap:host"),
    "file": (MEDIUM_STORAGE, "LOCAL", "kvswap:file"),
    "remote": (MEDIUM_STORAGE, "REMOTE", "kvswap:remote"),
}
_TIER_BIT: Final = {"host": 1, "file": 2, "remote": 4}


class EventLedger(RecordEvents):
    """Which tiers hold each key, and the events their changes make (see the module doc)."""

    enabled = True

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        #: namespace -> key -> bit set of the tiers holding it.
        self._held: dict[str, dict[str, int]] = {}
        #: (namespace, key) -> how events name it, for keys held or about to be; a block_size
        #: of 0 means the namespace's (:meth:`describe`).
        self._names: dict[tuple[str, str], BlockMeta] = {}
        self._pending: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._block_size: dict[str, int] = {}
        #: What the kept names cost in memory (an estimate, :func:`_name_cost`), and the names
        #: not kept because they would have passed MAX_NAME_BYTES.
        self.name_bytes = 0
        self.names_dropped = 0
        self._queue: deque[Event] = deque()
        #: After a reset: the held records as they were then, still to be announced.
        self._snapshot: deque[tuple[str, str, int, BlockMeta | None]] = deque()
        #: Set at start and on overflow: the next batch is a reset and the whole state.
        self._reset = True
        self.resets = 0
        self.events = 0

    # -- what the swapper and the registrar tell it ------------------------------------------------

    def describe(self, namespace: str, block_size: int) -> None:
        """The engine's block size in tokens, for blocks it sent no metadata for."""
        with self._cond:
            self._block_size[namespace] = block_size

    def expect(self, namespace: str, keys: Sequence[str], metas: Sequence[BlockMeta | None]) -> None:
        """A swap_out of ``keys`` (one chain, head first) is about to write: remember how to name
        each record when it lands. ``metas`` is empty or one entry per key."""
        with self._cond:
            previous: BlockHash | None = None
            for i, key in enumerate(keys):
                meta = metas[i] if metas else None
                if meta is not None:
                    parent = meta.parent_block_hash if meta.parent_block_hash is not None else previous
                    name = BlockMeta(meta.block_hashes, parent, meta.token_ids, meta.block_size, meta.lora_name)
                else:
                    name = BlockMeta((key.encode(),), previous)
                previous = name.block_hashes[-1]
                if i == 0 and meta is None:
                    continue  # the key alone, no parent: the default name, nothing to keep
                self._name_pending(namespace, key, name)
            self._trim_pending()

    def annotation(self, namespace: str, key: str) -> bytes:
        """How events name ``key``, as the bytes a record header keeps (b"" for the key alone)."""
        with self._cond:
            name = self._names.get((namespace, key))
        return msgpack.packb(name.to_wire(), use_bin_type=True) if name is not None else b""

    def recall(self, namespace: str, key: str, annotation: bytes) -> None:
        """A scan found ``key``'s record with ``annotation`` in its header: name it so when the
        index takes it in. An annotation that does not parse is ignored (the key names it)."""
        try:
            name = BlockMeta.from_wire(msgpack.unpackb(annotation, raw=False), 0)
        except (KvswapError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return
        with self._cond:
            self._name_pending(namespace, key, name)
            self._trim_pending()

    # -- RecordEvents: what the stores report --------------------------------------------------------

    def stored(self, tier: str, namespace: str, keys: Sequence[str]) -> None:
        bit = _TIER_BIT[tier]
        with self._cond:
            held = self._held.setdefault(namespace, {})
            for key in keys:
                mask = held.get(key, 0)
                if mask & bit:
                    continue
                held[key] = mask | bit
                self._pending.pop((namespace, key), None)
                self._push(self._stored_event(tier, namespace, key))

    def removed(self, tier: str, namespace: str, keys: Sequence[str]) -> None:
        bit = _TIER_BIT[tier]
        with self._cond:
            held = self._held.get(namespace)
            if not held:
                return
            hashes: list[BlockHash] = []
            for key in keys:
                mask = held.get(key, 0)
                if not mask & bit:
                    continue
                hashes.extend(self._name(namespace, key).block_hashes)
                self._drop_bit(namespace, held, key, mask & ~bit)
            if hashes:
                self._push_removed(tier, hashes)

    def closed(self, namespace: str) -> None:
        """Its records leave every tier as far as routers go; a registration of it again
        announces the file tier's afresh (its scan)."""
        for tier in _TIER_BIT:
            self.cleared(tier, namespace)
        with self._cond:
            self._held.pop(namespace, None)

    def cleared(self, tier: str, namespace: str) -> None:
        bit = _TIER_BIT[tier]
        with self._cond:
            held = self._held.get(namespace, {})
            hashes: list[BlockHash] = []
            for key, mask in list(held.items()):
                if mask & bit:
                    hashes.extend(self._name(namespace, key).block_hashes)
                    self._drop_bit(namespace, held, key, mask & ~bit)
            if not hashes:
                return
            if not any(self._held.values()):
                self._push(AllBlocksCleared())  # that tier's blocks were all this daemon held
            else:
                self._push_removed(tier, hashes)

    # -- reading it -----------------------------------------------------------------------------------

    def holders(self, namespace: str) -> dict[str, list[str]]:
        """tier -> the keys of ``namespace`` it holds, as the events told them (tests, stats)."""
        with self._cond:
            out: dict[str, list[str]] = {tier: [] for tier in _TIER_BIT}
            for key, mask in self._held.get(namespace, {}).items():
                for tier, bit in _TIER_BIT.items():
                    if mask & bit:
                        out[tier].append(key)
            return out

    def take(self, timeout: float, linger: float = 0.0) -> list[Event]:
        """The next batch to publish (up to MAX_BATCH_EVENTS events), waiting up to ``timeout``;
        [] if none came. Once an event is there, up to ``linger`` more for others to join it
        (one batch of many events costs far less than many of one). After a reset it is the
        whole state: a clear, then every held record (copied at the reset, made into events
        batch by batch), then what changed since."""
        with self._cond:
            if not self._queue and not self._reset and not self._snapshot:
                self._cond.wait(timeout)
            if linger and 0 < len(self._queue) < MAX_BATCH_EVENTS and not self._reset and not self._snapshot:
                self._cond.wait(linger)  # pushes do not notify a queue that is not empty
            if self._reset:
                self._reset = False
                self._queue.clear()
                self._snapshot = deque((namespace, key, mask, self._names.get((namespace, key)))
                                       for namespace, held in self._held.items() for key, mask in held.items())
                batch: list[Event] = [AllBlocksCleared()]
            else:
                batch = []
            while self._snapshot and len(batch) < MAX_BATCH_EVENTS:
                namespace, key, mask, name = self._snapshot.popleft()
                for tier, bit in _TIER_BIT.items():
                    if mask & bit:
                        batch.append(self._stored_event(tier, namespace, key, name))
            while self._queue and len(batch) < MAX_BATCH_EVENTS and not self._snapshot:
                batch.append(self._queue.popleft())
            self.events += len(batch)
            return batch

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def request_reset(self) -> None:
        """Publish a reset and the whole state next (a subscriber asked to replay batches the
        buffer no longer holds)."""
        with self._cond:
            self._reset = True
            self._queue.clear()
            self._cond.notify()

    # -- under the lock ----------------------------------------------------------------------------------

    def _name(self, namespace: str, key: str) -> BlockMeta:
        return self._names.get((namespace, key)) or BlockMeta((key.encode(),))

    def _stored_event(self, tier: str, namespace: str, key: str, name: BlockMeta | None = None) -> BlockStored:
        name = name or self._name(namespace, key)
        medium, locality, ownership = TIER_MEDIA[tier]
        return BlockStored(name.block_hashes, name.parent_block_hash, name.token_ids,
                           name.block_size or self._block_size.get(namespace, 0), medium, locality, ownership,
                           name.lora_name)

    def _name_pending(self, namespace: str, key: str, name: BlockMeta) -> None:
        """Name a record about to land (its swap_out's, or its header's after a restart). One
        already held keeps the name it was announced by: names never change under a router."""
        if self._held.get(namespace, {}).get(key):
            return
        entry = (namespace, key)
        if self._set_name(entry, name):
            self._pending[entry] = None
            self._pending.move_to_end(entry)

    def _set_name(self, entry: tuple[str, str], name: BlockMeta) -> bool:
        """Keep ``name`` for ``entry`` if the names' memory budget allows; False when it does
        not (the key names the record then, in every event about it: consistent, only not the
        engine's name)."""
        self._drop_name(entry)
        cost = _name_cost(name)
        if self.name_bytes + cost > MAX_NAME_BYTES:
            self.names_dropped += 1
            return False
        self._names[entry] = name
        self.name_bytes += cost
        return True

    def _drop_name(self, entry: tuple[str, str]) -> None:
        name = self._names.pop(entry, None)
        if name is not None:
            self.name_bytes -= _name_cost(name)

    def _trim_pending(self) -> None:
        while len(self._pending) > MAX_PENDING_METAS:
            entry, _ = self._pending.popitem(last=False)
            if not self._held.get(entry[0], {}).get(entry[1]):
                self._drop_name(entry)

    def _push_removed(self, tier: str, hashes: list[BlockHash]) -> None:
        medium, locality, ownership = TIER_MEDIA[tier]
        for start in range(0, len(hashes), MAX_HASHES_PER_REMOVAL):
            self._push(BlockRemoved(tuple(hashes[start:start + MAX_HASHES_PER_REMOVAL]), medium, locality, ownership))

    def _drop_bit(self, namespace: str, held: dict[str, int], key: str, mask: int) -> None:
        if mask:
            held[key] = mask
            return
        del held[key]
        if (namespace, key) not in self._pending:
            self._drop_name((namespace, key))

    def _push(self, event: Event) -> None:
        if self._reset:
            return  # the reset publishes the state as it will be then
        if len(self._queue) >= MAX_QUEUED_EVENTS:
            log.warning("KV events: %d events queued and not yet published; publishing a reset and the "
                        "whole state instead", len(self._queue))
            self.resets += 1
            self._reset = True
            self._queue.clear()
        else:
            self._queue.append(event)
            if len(self._queue) > 1:
                return  # the publisher is not waiting for this one: it is taking, or lingering
        self._cond.notify()


def _name_cost(name: BlockMeta) -> int:
    """Bytes a kept name holds, about: the object, its hashes, its token ids (an int object
    and a reference each, for ids past the interpreter's small-int cache)."""
    return 160 + 72 * len(name.block_hashes) + 36 * len(name.token_ids)


class EventPublisher:
    """The thread that publishes the ledger's batches (see the module doc). Sockets are bound
    in the constructor, so a bad address fails the daemon's start; after that only the thread
    touches them."""

    def __init__(self, ledger: EventLedger, ctx: zmq.Context, endpoint: str, replay_endpoint: str = "",
                 topic: str = "", buffer_bytes: int = 64 << 20, encoding: str = "map") -> None:
        self.ledger = ledger
        self.topic = topic.encode()
        self.encoding = encoding
        self.buffer_bytes = buffer_bytes
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0
        self._seq = 0
        self.replays = 0
        self.bad_replays = 0
        self.restates = 0
        self._last_restate: float | None = None
        self._stopping = threading.Event()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a replay request is 8 bytes
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    @property
    def published(self) -> int:
        """Batches published so far (the next batch's sequence number)."""
        return self._seq

    def start(self) -> None:
        self._thread.start()
        log.info("KV events: publishing on %s%s", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self._replay else "")

    def stop(self, timeout: float = 2.0) -> None:
        """Publish what is queued (up to ``timeout``), then close the sockets."""
        self._stopping.set()
        self.ledger.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events: the publisher did not finish within %.1f s", timeout)
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                stopping = self._stopping.is_set()
                batch = self.ledger.take(0.0 if stopping else REPLAY_POLL_S, 0.0 if stopping else BATCH_LINGER_S)
                if batch:
                    self._publish(batch)
                elif self._stopping.is_set():
                    return
        except Exception:  # a bug here must not take the daemon down; events stop, logged once
            log.exception("KV events: the publisher stopped")

    def _publish(self, events: Iterable[Event]) -> None:
        seq = self._seq
        self._seq += 1
        payload = encode_batch(time.time(), events, self.encoding)
        try:
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass  # PUB drops for slow subscribers anyway; they catch up through replay
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while self._buffered > self.buffer_bytes and self._buffer:
            self._buffered -= len(self._buffer.popleft()[1])

    def _restate(self) -> None:
        """A replay from before the buffer cannot rebuild a subscriber's view; a reset and the
        whole state, published to everyone, can (at most every RESTATE_INTERVAL_S, so replay
        requests cannot make the daemon re-announce everything in a loop)."""
        now = time.monotonic()
        if self._last_restate is not None and now - self._last_restate < RESTATE_INTERVAL_S:
            return
        self._last_restate = now
        self.restates += 1
        log.info("KV events: a replay asked for batches older than the buffer; publishing the whole state")
        self.ledger.request_reset()

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        for _ in range(16):  # a few requests per pass, so a flood of them cannot stall publishing
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                self.bad_replays += 1
                log.debug("KV events: ignored a malformed replay request of %d frames", len(frames))
                continue
            self.replays += 1
            client, empty, start = frames
            first = int.from_bytes(start, "big")
            oldest = self._buffer[0][0] if self._buffer else self._seq
            if first < oldest:
                self._restate()
            try:
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        self._replay.send_multipart((client, empty, self.topic, seq_bytes(seq), payload),
                                                    flags=zmq.NOBLOCK, copy=False)
                self._replay.send_multipart((client, empty, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                continue  # that subscriber's queue is full: it asks again


def describe_for_stats(ledger: EventLedger | None, publisher: EventPublisher | None) -> dict[str, Any]:
    if ledger is None or publisher is None:
        return {"enabled": False}
    return {"enabled": True, "endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
            "batches": publisher.published, "events": ledger.events, "resets": ledger.resets,
            "replays": publisher.replays, "bad_replays": publisher.bad_replays, "restates": publisher.restates,
            "name_bytes": ledger.name_bytes, "names_dropped": ledger.names_dropped}
