"""What the daemon holds for requests across every connection, bounded in bytes.

A decoded request is held until it is answered: its keys (up to MAX_KEYS_PER_REQUEST strings of
up to MAX_KEY_LENGTH characters) and block ids are Python objects, 1.8 MB for the largest
valid ``swap_out`` (8,192 keys of 128 characters from a 1.1 MB frame). The count limits alone
(``max_inflight_requests`` = 1024) let that reach 1024 x 1.9 MB = 1.9 GiB, and 6 connections
that never read their replies took the daemon from 49 to 279 MiB. So every decoded request is
charged an upper bound of what it holds (:func:`decoded_bytes`) against one budget,
``max_inflight_request_bytes``, and a connection against its share of it (the same share as
``max_inflight_per_client`` is of ``max_inflight_requests``); past either the answer is
``busy``. A frame that arrives while the budget is already spent is refused before it is
decoded, so the refusal costs nothing to hold.

A connection's share also counts its replies that ZMQ still holds (a peer that does not read
them): replies of TRACK_REPLY_BYTES or more are sent tracked, and charged to the connection
until ZMQ lets them go. They are not charged to the budget of all connections, so peers that
never read hold only their own shares and never make others' requests busy. A request's
reply is smaller than its decoded request (about 14 bytes a key against 104 or more), so
what one connection holds, decoded and unsent together, stays within its share.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from prometheus_client import Gauge

log = logging.getLogger(__name__)

#: Upper bounds of what CPython (64-bit) spends per decoded object, including the container's
#: pointer to it: an ASCII str is 49 bytes plus its characters, rounded up to 8; an int 28-32;
#: a tuple 40 plus 8 a slot; a dict about 72 an entry. Measured: a swap_out of 8,192 keys of 128
#: characters holds 1.84 MB decoded and is charged 1.9 MB.
STR_BYTES = 64
INT_BYTES = 40
CONTAINER_BYTES = 64
DICT_ENTRY_BYTES = 72
#: The request object itself and its envelope fields.
REQUEST_BYTES = 512

#: Replies at least this large are tracked until ZMQ lets them go. Smaller ones (errors, busy,
#: pings: a few hundred bytes) are not: SND_HWM of them are at most 1 MiB a connection.
TRACK_REPLY_BYTES = 4096
#: How often tracking a reply also looks at every connection's (those that left included).
PRUNE_ALL_INTERVAL_S = 1.0
#: Refusals are logged at most this often.
LOG_INTERVAL_S = 10.0


def decoded_bytes(value: Any) -> int:
    """An upper bound of the memory a decoded value holds (a validated request's fields)."""
    t = type(value)
    if t is str:
        return STR_BYTES + len(value)
    if t is bytes:
        return STR_BYTES + len(value)
    if t is tuple or t is list:
        n = len(value)
        if n == 0:
            return CONTAINER_BYTES
        first = type(value[0])
        if first is str:
            try:  # keys: one C-level pass
                return CONTAINER_BYTES + n * STR_BYTES + sum(map(len, value))
            except TypeError:
                pass
        elif first is int and all(type(v) is int for v in value):
            return CONTAINER_BYTES + n * INT_BYTES
        return CONTAINER_BYTES + sum(decoded_bytes(v) for v in value) + 8 * n
    if t is dict:
        return CONTAINER_BYTES + sum(DICT_ENTRY_BYTES + decoded_bytes(k) + decoded_bytes(v) for k, v in value.items())
    return INT_BYTES  # int, float, bool, None


def request_bytes(request: Any) -> int:
    """What a decoded request holds: its fields (a frozen dataclass) plus the object."""
    fields = getattr(request, "__dataclass_fields__", {})
    return REQUEST_BYTES + sum(decoded_bytes(getattr(request, name)) for name in fields)


class RequestBudget:
    """Bytes of decoded requests not yet answered: in all, and per client connection."""

    def __init__(self, limit: int, per_client: int, gauge: Gauge | None = None) -> None:
        self.limit = limit
        self.per_client = per_client
        #: Bytes of decoded requests, all connections.
        self.used = 0
        #: Per connection: its decoded requests' bytes plus its tracked unsent replies'.
        self._held: dict[bytes, int] = {}
        #: Per connection: (tracker, bytes) of its replies ZMQ may still hold, oldest first.
        self._unsent: dict[bytes, collections.deque] = {}
        self._gauge = gauge
        self._pruned_all = time.monotonic()
        self._last_log = float("-inf")
        self._refused_since_log = 0

    def full(self, client: bytes) -> bool:
        """Whether a new frame from ``client`` is refused before it is decoded."""
        self._prune(client)
        if self.used >= self.limit or self._held.get(client, 0) >= self.per_client:
            self._refused()
            return True
        return False

    def take(self, client: bytes, charge: int) -> bool:
        """Charge one decoded request; False (and nothing charged) past the budget or the
        client's share. A request larger than either still runs when nothing else is held
        against it, so a small budget slows big requests down instead of refusing them all."""
        self._prune(client)
        held = self._held.get(client, 0)
        if (self.used and self.used + charge > self.limit) or (held and held + charge > self.per_client):
            self._refused()
            return False
        self.used += charge
        self._held[client] = held + charge
        self._set_gauge()
        return True

    def give(self, client: bytes, charge: int) -> None:
        self.used -= charge
        self._give_held(client, charge)
        self._set_gauge()

    def track(self, client: bytes, size: int, tracker: Any) -> None:
        """Charge a reply ZMQ holds to its connection until ``tracker.done``."""
        self._unsent.setdefault(client, collections.deque()).append((tracker, size))
        self._held[client] = self._held.get(client, 0) + size
        now = time.monotonic()
        if now - self._pruned_all >= PRUNE_ALL_INTERVAL_S:  # connections gone send nothing more
            self._pruned_all = now
            for other in list(self._unsent):
                self._prune(other)

    def unsent(self, client: bytes) -> int:
        self._prune(client)
        return sum(size for _, size in self._unsent.get(client, ()))

    def _prune(self, client: bytes) -> None:
        """Give back the replies of ``client`` that ZMQ has let go (sent, or dropped)."""
        queue = self._unsent.get(client)
        if not queue:
            return
        while queue and queue[0][0].done:
            self._give_held(client, queue.popleft()[1])
        if not queue:
            del self._unsent[client]

    def _give_held(self, client: bytes, size: int) -> None:
        held = self._held.get(client, 0) - size
        if held > 0:
            self._held[client] = held
        else:
            self._held.pop(client, None)

    def _set_gauge(self) -> None:
        if self._gauge is not None:
            self._gauge.set(self.used)

    def _refused(self) -> None:
        self._refused_since_log += 1
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S:
            log.warning("busy: decoded requests in flight hold %d bytes of the %d allowed (%d of a connection's "
                        "share); %d requests refused since the last report", self.used, self.limit,
                        self.per_client, self._refused_since_log)
            self._last_log, self._refused_since_log = now, 0
