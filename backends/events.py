"""Where a tier says which records became readable in it and which left it: the source of the
daemon's KV events (daemon/kv_events.py).

Stores call these at the moment their own index changes, under the lock that orders that
change, so the calls for one record come in the order the tier saw them. The calls must not
block and must not call back into a store: the daemon's implementation updates a table under
its own lock and queues the events for a publisher thread.
"""

from __future__ import annotations

from typing import Sequence

from kvswap.protocol.kv_events import BlockMeta


class RecordEvents:
    """The sink stores report to. This base reports nowhere (KV events off): its methods cost a
    call, and stores skip the work of naming keys when :attr:`enabled` is False."""

    enabled: bool = False

    def describe(self, namespace: str, block_size: int) -> None:
        """The namespace's blocks hold ``block_size`` tokens (for events of blocks the engine
        sent no metadata for)."""

    def expect(self, namespace: str, keys: Sequence[str], metas: Sequence[BlockMeta | None]) -> None:
        """A swap_out is about to write ``keys`` (one chain, head first) with what the engine
        said of each (``metas``: empty, or one entry per key): how to name them when they land."""

    def annotation(self, namespace: str, key: str) -> bytes:
        """What a record header should keep so that a restart names ``key`` as now (b"": the
        key alone names it)."""
        return b""

    def recall(self, namespace: str, key: str, annotation: bytes) -> None:
        """A scan found ``key`` with ``annotation`` (from :meth:`annotation`) in its header."""

    def stored(self, tier: str, namespace: str, keys: Sequence[str]) -> None:
        """``keys`` are readable in ``tier`` now (a write landed, a scan or another daemon's
        write was found)."""

    def removed(self, tier: str, namespace: str, keys: Sequence[str]) -> None:
        """``keys`` left ``tier`` (eviction, delete, a corrupt record removed, found gone)."""

    def cleared(self, tier: str, namespace: str) -> None:
        """Every record of ``namespace`` left ``tier`` (``clear``)."""

    def closed(self, namespace: str) -> None:
        """The daemon stopped serving ``namespace`` (an engine registered another layout): its
        records stay stored, but no lookup reaches them here until it is registered again."""


NO_EVENTS = RecordEvents()
