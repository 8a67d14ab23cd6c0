"""The storage interface every tier implements.

A *backend* is a tier's root (a directory, a RAM budget, a remote store). It opens one
*store* per namespace; a store holds records of that namespace only, so two layouts can never
see each other's blocks. Store methods are blocking and thread-safe: the daemon calls them
from its I/O threads, never from the receive loop.
"""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Any, Container, Iterable, Protocol, Sequence

from .events import NO_EVENTS, RecordEvents

if TYPE_CHECKING:
    import numpy as np

    from .host_arena import HostArena


class GetStatus(str, enum.Enum):
    LOADED = "loaded"
    MISS = "miss"
    #: The record existed but failed its header or checksum check; it has been removed.
    CORRUPT = "corrupt"


class HeldRecord(Protocol):
    """One record's bytes in host memory, held for the caller until it calls ``release``: a
    slot of the daemon's arena (:class:`~.host_arena.ArenaSlot`), taken for staging or found by
    a RAM hit. ``view`` is exactly the record's payload."""

    @property
    def view(self) -> "np.ndarray": ...

    def retain(self) -> "HeldRecord": ...

    def release(self) -> None: ...


class Store(abc.ABC):
    """Records of one namespace in one tier."""

    #: Tier name used in metrics and configuration ("file", "host", "remote").
    tier: str = ""
    #: Whether :meth:`hold` can find records: the tier keeps them in the daemon's host arena
    #: (the RAM tier). A swap_in asks such tiers first, with no I/O, and reads from the others.
    holds_records: bool = False
    #: Where the store reports records arriving and leaving (KV events); see :meth:`watch`.
    events: RecordEvents = NO_EVENTS

    @abc.abstractmethod
    def put(self, key: str, payload: memoryview) -> int:
        """Store one record; return the bytes it occupies. Raises ``NoSpace`` or
        ``IOFailure``. Storing a key that exists replaces it (same key, same bytes)."""

    @abc.abstractmethod
    def get_into(self, key: str, out: memoryview) -> GetStatus:
        """Read the record's payload into ``out`` (exactly the record size) and verify it.
        Raises ``IOFailure`` when the medium fails; a missing or bad record is a status."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether the record is stored (without reading or verifying its payload)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove one record; True if it existed."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every record of this namespace; return how many."""

    @abc.abstractmethod
    def usage(self) -> dict[str, int]:
        """``{"records": n, "bytes": n}`` as far as this store knows."""

    def close(self) -> None:
        """Release what the store holds open."""

    # -- batched forms: tiers with a cheaper batch path override these ---------------------

    def put_many(self, items: Iterable[tuple[str, memoryview]]) -> list[int]:
        return [self.put(key, payload) for key, payload in items]

    def get_many(self, keys: Sequence[str], outs: Sequence[memoryview]) -> list[GetStatus]:
        return [self.get_into(key, out) for key, out in zip(keys, outs)]

    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (stops at the first miss)."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def cached_prefix(self, keys: Sequence[str], also_present: Container[str] = ()) -> int:
        """How many leading keys are known stored from memory alone, without I/O; callers go
        to :meth:`contains` for the rest. Keys in ``also_present`` count as stored."""
        return 0

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(1 for key in keys if self.delete(key))

    # -- optional capabilities: no-op defaults, so the daemon never asks ``hasattr`` ----------

    def watch(self, events: RecordEvents) -> None:
        """Report to ``events`` from now on every record that becomes readable in this store or
        leaves it (called once, when the namespace opens, before its scan)."""
        self.events = events

    def put_slot(self, key: str, slot: HeldRecord) -> int:
        """Store the record in ``slot``, a staging slot the caller holds (swap_out's gathered
        record, a swap_in's read being promoted). A tier that keeps records in that very memory
        keeps the slot itself, with no copy; the default writes its bytes like :meth:`put`."""
        return self.put(key, slot.view.data)

    def hold(self, key: str) -> HeldRecord | None:
        """The record where it lies in memory, held for the caller (who releases it) so that a
        swap_in copies straight from it; None when this tier does not have it. Tiers whose
        :attr:`holds_records` is False hold nothing: they read into a buffer (:meth:`get_into`)."""
        return None

    def scan(self) -> int:
        """Rebuild what the store knows from its medium (the file tier's directory scan);
        return the records found. Stores that keep no index have nothing to scan."""
        return 0

    def maintain(self, now: float | None = None) -> None:
        """Periodic upkeep (eviction, leadership, rescans), called from the daemon's
        maintenance thread."""

    def stats(self) -> dict[str, Any]:
        """What ``stats`` and the metrics collector report about this store: at least
        :meth:`usage`, plus whatever counters the tier keeps."""
        return dict(self.usage())

    def free_bytes(self) -> int | None:
        """Free bytes on the medium, where it has a file system to ask (else None)."""
        return None

    # -- prefix chains: tiers that evict keep a chain's tail older than its head (see chains.py) --

    def expect_chain(self, keys: Sequence[str]) -> None:
        """A swap_out is about to write ``keys``, one chain head first (``keys[i]`` follows
        ``keys[i-1]``). Default: nothing (a remote store evicts by its own rules)."""

    def touch_chain(self, keys: Sequence[str], persist: bool = False) -> None:
        """``keys`` are a hit prefix (lookup, swap_in), head first: touch them as a whole, head
        newest; ``persist`` (swap_in) keeps that order across a restart. Default: nothing."""


class Backend(abc.ABC):
    """A tier's root. ``open_store`` is called once per registered namespace."""

    tier: str = ""
    #: Where the tier lives, for stats and logs (remote tiers: the URL without credentials).
    url: str | None = None
    #: The tier's fixed byte budget, where it has one (the host tier).
    capacity_bytes: int | None = None

    @abc.abstractmethod
    def open_store(self, namespace: str, description: dict[str, Any], record_bytes: int) -> Store:
        """The store for one namespace (fingerprint hex), creating it if needed."""

    def close(self) -> None:
        """Release the tier."""

    # -- optional capabilities: no-op defaults, so the daemon never asks ``hasattr`` ----------

    @property
    def healthy(self) -> bool:
        """Whether the tier is reachable now, as last seen (local tiers always are)."""
        return True

    def probe(self) -> bool:
        """Check the tier's health now (may block for a connect timeout); returns
        :attr:`healthy`. Local tiers have nothing to probe."""
        return True

    def make_arena(self, record_bytes: int, staging_slots: int) -> "HostArena | None":
        """A tier that keeps records in the daemon's host memory (the RAM tier) makes the arena
        for a registration's record size: ``staging_slots`` slots for staging plus its own share,
        and keeps its records in it from then on. Others return None (the daemon then makes an
        arena of staging slots alone)."""
        return None

    def register_buffer(self, buf: Any) -> None:
        """Let the tier transfer straight from (or into) ``buf``, a staging arena the daemon
        keeps for its lifetime. Tiers without zero-copy transfers ignore it."""
