"""A KV-events subscriber that rebuilds, from events alone, what each tier holds: what a
cache-aware router does with kvswapd's stream (docs/protocol.md, "KV events"). ``kvswap
events`` runs it for an operator; the tests compare its view with the tiers' own indexes.

It joins the way a late router must: subscribe to the PUB socket first (so nothing published
from then on is missed), ask the replay socket for everything buffered from sequence 0, then
apply each batch once, in sequence order. A batch 0 with another timestamp than the one
applied is a restarted daemon; a batch that begins with AllBlocksCleared (a restart, an
overflow, a replay from before the buffer) is a place to start from, whatever came before.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Hashable

import zmq

from .kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, Event, decode_batch, seq_bytes


def hash_text(h: Hashable) -> str:
    """A block hash as text: a key's own bytes (blocks named by their key), else hex; an int
    in decimal."""
    if isinstance(h, bytes):
        return h.decode() if h.isascii() and h.decode().isprintable() else h.hex()
    return str(h)


class TierView:
    """``(medium, ownership) -> set of block hashes``, from events applied in order; with
    ``keep_stored`` also every BlockStored applied, in order (tests look at their fields)."""

    def __init__(self, keep_stored: bool = False) -> None:
        self.held: defaultdict[tuple[str | None, str | None], set[Hashable]] = defaultdict(set)
        self.keep_stored = keep_stored
        self.stored: list[BlockStored] = []

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self.held[(event.medium, event.ownership)].update(event.block_hashes)
            if self.keep_stored:
                self.stored.append(event)
        elif isinstance(event, BlockRemoved):
            self.held[(event.medium, event.ownership)].difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.held.clear()

    def keys(self, ownership: str) -> set[str]:
        """What a tier holds (``ownership`` "kvswap:host", "kvswap:file", "kvswap:remote") as
        :func:`hash_text`: the keys, for blocks named by their key (no ``block_meta``)."""
        return {hash_text(h) for (_, owner), hashes in self.held.items() if owner == ownership for h in hashes}


class Subscriber:
    """A SUB socket on ``endpoint`` and a DEALER on ``replay_endpoint``; :meth:`join` replays,
    :meth:`poll` applies what arrived; ``on_batch(seq, events)`` is told each batch applied.
    Not thread-safe."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"", keep_stored: bool = False,
                 on_batch: Callable[[int, list[Event]], None] | None = None) -> None:
        self._ctx = zmq.Context()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.view = TierView(keep_stored)
        self.on_batch = on_batch
        #: The next sequence number to apply.
        self.next_seq = 0
        self.batches = 0
        self.restarts = 0
        self._held_back: dict[int, list[Event]] = {}
        #: The timestamp of batch 0 of the stream being applied (a restart changes it).
        self.epoch_ts: float | None = None

    def join(self, timeout: float = 10.0) -> None:
        """Replay from 0 (after the SUB socket is connecting), then apply live batches."""
        self._replay_from(0, timeout)
        self.poll()

    def catch_up(self, timeout: float = 10.0) -> None:
        """Apply what arrived live, then replay from 0 again: a batch published while the SUB
        connection was being made (or remade, after a restart) reached nobody live. Batch 0's
        timestamp tells a restarted daemon's stream from the one already applied."""
        self.poll()
        self._replay_from(0, timeout)

    def _replay_from(self, start: int, timeout: float) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", seq_bytes(start)])
            deadline = time.monotonic() + timeout
            while True:
                if not dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise TimeoutError("no end marker from the replay socket")
                _, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                self._offer(int.from_bytes(seq, "big"), payload)
        finally:
            dealer.close(0)

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that has arrived on the SUB socket; how many arrived."""
        n = 0
        while self.sub.poll(timeout_ms if n == 0 else 0):
            _topic, seq, payload = self.sub.recv_multipart()
            self._offer(int.from_bytes(seq, "big"), payload)
            n += 1
        return n

    def _offer(self, seq: int, payload: bytes) -> None:
        ts, events, _ = decode_batch(payload)
        if seq == 0:
            if self.next_seq > 0 and ts != self.epoch_ts:
                # A daemon restarted: its stream starts again (with AllBlocksCleared).
                self.restarts += 1
                self.next_seq = 0
                self._held_back.clear()
            self.epoch_ts = ts
        if seq < self.next_seq:
            return  # applied already (replay and live overlap)
        self._held_back[seq] = events
        if self.next_seq not in self._held_back:
            # A batch that starts with a reset is a place to start from: what came before it
            # (older than the daemon's replay buffer, say) no longer matters.
            resets = [s for s, evs in self._held_back.items()
                      if s > self.next_seq and evs and isinstance(evs[0], AllBlocksCleared)]
            if resets:
                self.next_seq = min(resets)
                self._held_back = {s: evs for s, evs in self._held_back.items() if s >= self.next_seq}
        while self.next_seq in self._held_back:
            batch = self._held_back.pop(self.next_seq)
            for event in batch:
                self.view.apply(event)
            if self.on_batch is not None:
                self.on_batch(self.next_seq, batch)
            self.next_seq += 1
            self.batches += 1

    def close(self) -> None:
        self.sub.close(0)
        self._ctx.term()
