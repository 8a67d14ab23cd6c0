"""kvswapd's KV events, forwarded into the engine's own event stream (docs/integration.md,
"KV events through vLLM"). Plain Python: pyzmq and :mod:`kvswap.protocol.kv_events`, no vLLM.

:class:`EventForwarder` subscribes to one daemon's PUB socket and, with a replay address,
fetches what it missed from the daemon's ROUTER. The scheduler calls :meth:`~EventForwarder.take`
once a step; it never blocks (every socket is read with ``NOBLOCK``) and does a bounded amount
of work per call. What it hands back is kvswap's events, rewritten for a stream that also carries
the engine's GPU events:

- **Each batch once, in order.** Batches are applied by sequence number; one seen already
  (replay and live overlap) is dropped. A missing sequence number (the SUB socket's queue
  overflowed while the engine did not step) is fetched from the replay socket.
- **A daemon restart clears only kvswap's blocks.** vLLM's ``AllBlocksCleared`` has no medium: a
  router that reads it forgets the GPU blocks too. So a daemon's ``AllBlocksCleared`` (the first
  batch of each daemon's life) and a lost connection (the daemon went away; a new one starts
  with nothing in RAM) become ``BlockRemoved`` events of every block the forwarder saw kvswap
  store and not remove, per medium, locality and ownership.
- **Blocks named by their key get the engine's name.** A record whose swap_out carried no
  ``block_meta`` (one the daemon's start-up scan found, or one another daemon sharing the
  directory wrote) is named by its key's bytes; the connector's keys are the hex of vLLM's block
  hashes, so ``convert`` (vLLM's ``maybe_convert_block_hash``) gives the name the engine uses.

A restart is seen either way, whichever comes first: the connection drops (a ZMQ monitor on the
SUB socket; on loopback a drop is the daemon's process ending), or a batch 0 that starts with
``AllBlocksCleared`` arrives after later ones. The new daemon's stream is then replayed from 0.
Batches older than the current daemon's first (by the daemon's own timestamps: a dead daemon's
last batches can still sit in the queue) are dropped.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvswap.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    decode_batch,
    seq_bytes,
)

log = logging.getLogger("vllm.kvswap")

#: Events one :meth:`EventForwarder.take` returns at most (the rest wait for the next step).
MAX_EVENTS_PER_TAKE: Final = 4096
#: Messages read from each socket in one take.
MAX_FRAMES_PER_TAKE: Final = 1024
#: Live batches held back while a replay runs; the oldest go first (the replay has them).
MAX_HELD_BACK: Final = 10_000
#: Block names remembered to turn a daemon's reset into BlockRemoved events (about 60 bytes each).
MAX_TRACKED: Final = 1 << 21
#: Hashes in one BlockRemoved made from a reset (as the daemon's own clear events).
MAX_HASHES_PER_REMOVAL: Final = 1024
#: The daemon's replay queues at most this many messages for one subscriber; more than that
#: arrive after a new request from where the last one stopped.
SOCKET_HWM: Final = 100_000
#: Unanswered fresh replays before the forwarder goes on with the live stream alone.
FRESH_ATTEMPTS: Final = 3
#: A key that is the hex of a block hash (8..64 bytes): the connector's keys (plan.keys_for).
_HEX_KEY: Final = re.compile(rb"(?:[0-9a-f]{2}){8,64}")

#: (medium, locality, ownership): one kvswap tier in events.
Tier = tuple[str | None, str | None, str | None]


@dataclass
class ForwarderCounts:
    """What the forwarder did, for the connector's stats."""

    batches: int = 0
    events: int = 0
    #: Batches seen twice (live and replayed) and dropped.
    duplicates: int = 0
    #: Batches of a daemon that had already been replaced, dropped.
    stale: int = 0
    #: Replays asked for (start-up, reconnects, gaps).
    replays: int = 0
    #: Sequence numbers never received (no replay address, or the daemon's buffer no longer had them).
    lost: int = 0
    #: Daemons lost or restarted: kvswap's blocks were removed from the stream.
    resets: int = 0
    #: Messages that were not event batches.
    bad: int = 0
    #: Blocks stored past MAX_TRACKED, whose removal a reset could not name.
    untracked: int = 0


@dataclass
class _Batch:
    seq: int
    ts: float
    events: list[Event]


@dataclass
class _Replay:
    start: int
    #: "fresh" (everything from 0: the baseline after start-up or a reset) or "gap" (from
    #: ``start``, the first missing sequence number).
    mode: str
    idle_deadline: float
    batches: list[_Batch]


class EventForwarder:
    """One daemon's events, for :meth:`take` once a step. Single-threaded: the scheduler's
    thread creates, takes and closes it."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 convert: Callable[[bytes], BlockHash] | None = None, *, replay_idle_s: float = 2.0,
                 retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.convert = convert
        self.replay_idle_s = replay_idle_s
        self.retry_s = retry_s
        self.counts = ForwarderCounts()
        self._clock = clock
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoint)
        self._dealer: zmq.Socket | None = None
        self._out: deque[Event] = deque()
        self._held: dict[Tier, set[BlockHash]] = {}
        self._tracked = 0
        #: The sequence number expected next; None: nothing applied since start-up or a reset.
        self._next: int | None = None
        #: The current daemon's first batch's timestamp: batches older than it are a replaced
        #: daemon's (None: not known yet).
        self._floor: float | None = None
        #: A baseline exists: the fresh replay is done (always, without a replay address).
        self._synced = self.replay_endpoint is None
        self._replay: _Replay | None = None
        self._want: str | None = None  # a replay to start: "fresh" or "gap"
        self._retry_at = 0.0
        self._held_back: deque[_Batch] = deque(maxlen=MAX_HELD_BACK)
        self._fresh_failures = 0

    # -- the scheduler's side ----------------------------------------------------------------------

    def take(self, limit: int = MAX_EVENTS_PER_TAKE) -> list[Event]:
        """The events that arrived since the last call, at most ``limit``; never blocks."""
        if len(self._out) < limit:
            self._read_monitor()
            self._start_replay()
            self._read_replay()
            self._read_live()
        taken = [self._out.popleft() for _ in range(min(limit, len(self._out)))]
        self.counts.events += len(taken)
        return taken

    @property
    def synced(self) -> bool:
        """The stream has its baseline: the replay from 0 after start-up (or after the daemon was
        lost) is applied, or there is no replay address."""
        return self._synced and self._replay is None and self._want is None

    def held(self) -> dict[Tier, set[BlockHash]]:
        """What the forwarded stream says kvswap holds now, per tier (a copy)."""
        return {tier: set(hashes) for tier, hashes in self._held.items() if hashes}

    def close(self) -> None:
        self._sub.disable_monitor()
        for sock in (self._monitor, self._sub, self._dealer):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    # -- sockets -----------------------------------------------------------------------------------

    def _read_monitor(self) -> None:
        for _ in range(MAX_FRAMES_PER_TAKE):
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._daemon_lost()
            elif event == zmq.EVENT_CONNECTED and self.replay_endpoint and not self._synced:
                self._want, self._retry_at = "fresh", 0.0

    def _read_live(self) -> None:
        for _ in range(MAX_FRAMES_PER_TAKE):
            if len(self._out) >= MAX_EVENTS_PER_TAKE:
                return
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            batch = self._parse(frames[1:]) if len(frames) == 3 else None
            if batch is not None:
                self._live(batch)

    def _start_replay(self) -> None:
        if self._want is None or self._replay is not None or self.replay_endpoint is None:
            return
        if self._clock() < self._retry_at:
            return
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.setsockopt(zmq.RCVHWM, SOCKET_HWM)
            self._dealer.connect(self.replay_endpoint)
        start = 0 if self._want == "fresh" or self._next is None else self._next
        try:
            self._dealer.send_multipart([b"", seq_bytes(start)], zmq.NOBLOCK)
        except zmq.Again:
            self._retry_at = self._clock() + self.retry_s
            return
        self.counts.replays += 1
        self._replay = _Replay(start, self._want, self._clock() + self.replay_idle_s, [])
        self._want = None

    def _read_replay(self) -> None:
        replay = self._replay
        if replay is None or self._dealer is None:
            return
        for _ in range(MAX_FRAMES_PER_TAKE):
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            replay.idle_deadline = self._clock() + self.replay_idle_s
            if len(frames) != 4:
                self.counts.bad += 1
                continue
            if frames[2] == END_SEQ:
                self._replay_done(replay, complete=True)
                return
            batch = self._parse(frames[2:])
            if batch is not None:
                replay.batches.append(batch)
        if self._clock() >= replay.idle_deadline:
            # No end marker: the daemon is away, or its replay queue for us overflowed.
            self._dealer.close(0)  # a late answer must not be read as the next replay's
            self._dealer = None
            self._replay_done(replay, complete=False)

    def _parse(self, frames: list[bytes]) -> _Batch | None:
        seq, payload = frames
        try:
            ts, events, _ = decode_batch(payload)
        except ValueError:
            self.counts.bad += 1
            return None
        return _Batch(int.from_bytes(seq, "big"), ts, events)

    # -- the order of batches ----------------------------------------------------------------------

    def _live(self, batch: _Batch) -> None:
        if not self._synced or self._replay is not None or self._want is not None:
            self._held_back.append(batch)
            return
        if self._floor is not None and batch.ts < self._floor:
            self.counts.stale += 1
        elif self._next is None or batch.seq == self._next:
            self._apply(batch)
        elif batch.seq < self._next:
            if (batch.seq == 0 and batch.ts != self._floor and batch.events
                    and isinstance(batch.events[0], AllBlocksCleared)):
                # A restarted daemon's first batch, read before the monitor told of the drop.
                self._reset()
                self._floor = batch.ts
                self._apply(batch)
            else:
                self.counts.duplicates += 1
        elif self.replay_endpoint:
            self._want, self._retry_at = "gap", 0.0
            self._held_back.append(batch)
            self._start_replay()
        else:
            self.counts.lost += batch.seq - self._next
            self._apply(batch)

    def _replay_done(self, replay: _Replay, complete: bool) -> None:
        self._replay = None
        batches = sorted(replay.batches, key=lambda b: b.seq)
        if replay.mode == "fresh":
            if batches:
                if batches[0].seq != 0:
                    self.counts.lost += batches[0].seq
                    log.warning("kvswap events: the daemon's replay starts at batch %d; what it announced before "
                                "is not in the stream (raise kvswapd's --kv-events-buffer-bytes)", batches[0].seq)
                self._floor = batches[0].ts
                self._synced = True
            elif complete:
                self._synced = True  # the daemon has published nothing yet
        for batch in batches:
            if self._next is None or batch.seq >= self._next:
                if self._next is not None and batch.seq > self._next:
                    self.counts.lost += batch.seq - self._next
                self._apply(batch)
        if not complete:
            if batches:
                self._want, self._retry_at = "gap" if self._synced else "fresh", 0.0  # ask for the rest
                return
            if not self._synced and self._fresh_failures < FRESH_ATTEMPTS - 1:
                self._fresh_failures += 1
                self._want, self._retry_at = "fresh", self._clock() + self.retry_s
                return
            # No answer: carry on with what comes live.
            log.warning("kvswap events: no replay from %s; continuing with the live stream", self.replay_endpoint)
            self._synced = True
        self._fresh_failures = 0
        held_back, self._held_back = self._held_back, deque(maxlen=MAX_HELD_BACK)
        if self._next is not None and (replay.mode == "gap" or not complete):
            ahead = [b.seq for b in held_back if b.seq >= self._next and (self._floor is None or b.ts >= self._floor)]
            if ahead and min(ahead) > self._next:
                # The replay did not have the missing batches (they left the daemon's buffer):
                # go on from the first one that came live.
                self.counts.lost += min(ahead) - self._next
                self._next = min(ahead)
        for batch in held_back:
            self._live(batch)

    def _daemon_lost(self) -> None:
        """The connection dropped: the daemon (on loopback, its process) is gone, and a new one
        starts with nothing in RAM. Remove kvswap's blocks; rebuild from the next daemon."""
        self._reset()
        self._next = None
        self._floor = None
        if self.replay_endpoint:
            self._synced = False
            self._replay = None
            self._want = None
            self._held_back.clear()
            if self._dealer is not None:
                self._dealer.close(0)
                self._dealer = None

    # -- events ------------------------------------------------------------------------------------

    def _apply(self, batch: _Batch) -> None:
        self._next = batch.seq + 1
        if self._floor is None:
            self._floor = batch.ts  # the oldest batch known of this daemon
        self.counts.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                event = replace(event, block_hashes=tuple(self._name(h) for h in event.block_hashes),
                                parent_block_hash=None if event.parent_block_hash is None
                                else self._name(event.parent_block_hash))
                self._track(event)
                self._out.append(event)
            elif isinstance(event, BlockRemoved):
                event = replace(event, block_hashes=tuple(self._name(h) for h in event.block_hashes))
                hashes = self._held.get((event.medium, event.locality, event.ownership))
                if hashes:
                    before = len(hashes)
                    hashes.difference_update(event.block_hashes)
                    self._tracked -= before - len(hashes)
                self._out.append(event)
            else:
                self._reset()

    def _name(self, block_hash: BlockHash) -> BlockHash:
        if self.convert is not None and isinstance(block_hash, bytes) and _HEX_KEY.fullmatch(block_hash):
            return self.convert(bytes.fromhex(block_hash.decode("ascii")))
        return block_hash

    def _track(self, event: BlockStored) -> None:
        hashes = self._held.setdefault((event.medium, event.locality, event.ownership), set())
        for h in event.block_hashes:
            if h in hashes:
                continue
            if self._tracked >= MAX_TRACKED:
                self.counts.untracked += 1
                continue
            hashes.add(h)
            self._tracked += 1

    def _reset(self) -> None:
        """kvswap's blocks leave the stream: a BlockRemoved per tier for what it was told."""
        if self._tracked or self.counts.untracked:
            self.counts.resets += 1
        for (medium, locality, ownership), hashes in self._held.items():
            names = list(hashes)
            for i in range(0, len(names), MAX_HASHES_PER_REMOVAL):
                self._out.append(BlockRemoved(tuple(names[i:i + MAX_HASHES_PER_REMOVAL]), medium, locality, ownership))
        self._held.clear()
        self._tracked = 0
        if self.counts.untracked:
            log.warning("kvswap events: %d blocks stored past the tracking limit (%d) were not removed from the "
                        "stream with the daemon's reset", self.counts.untracked, MAX_TRACKED)
            self.counts.untracked = 0
