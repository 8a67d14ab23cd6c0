"""Records between their gather into staging and the end of their write, by namespace and key.

The table is what lets a swap_in read a record still being written (from its staging slot),
and a swap_out skip a key already on its way. Both questions are asked for one namespace: two
engines of different models (or one engine re-registered with another layout) may use the
same keys for different bytes, and neither may see the other's records in flight. Touched on
the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import KeysView
from dataclasses import dataclass, field

from .staging import Slot


@dataclass
class InflightWrite:
    """A record being copied into staging and written. swap_in reads from ``slot`` once
    ``copied`` resolves; ``done`` resolves when the write ends, either way."""

    slot: Slot
    copied: asyncio.Future = field(repr=False)
    done: asyncio.Future = field(repr=False)


class InflightTable:
    def __init__(self) -> None:
        self._by_namespace: dict[str, dict[str, InflightWrite]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def keys(self, namespace: str) -> KeysView[str]:
        """The keys of ``namespace`` in flight (a live view: supports ``in``)."""
        return self._by_namespace.get(namespace, {}).keys()

    def get(self, namespace: str, key: str) -> InflightWrite | None:
        entries = self._by_namespace.get(namespace)
        return entries.get(key) if entries else None

    def add(self, namespace: str, key: str, entry: InflightWrite) -> None:
        entries = self._by_namespace.setdefault(namespace, {})
        if key not in entries:
            self._count += 1
        entries[key] = entry

    def drop(self, namespace: str, key: str, entry: InflightWrite) -> None:
        """Remove ``entry`` if it is still the one in flight for its key."""
        entries = self._by_namespace.get(namespace)
        if entries is not None and entries.get(key) is entry:
            del entries[key]
            self._count -= 1
            if not entries:
                del self._by_namespace[namespace]
