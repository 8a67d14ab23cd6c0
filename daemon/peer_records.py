"""This daemon's records as peers see them: which leading keys are here (waiting, up to a time,
for keys on their way), and copies of them into transit memory for an export.

"Here" is what a lookup counts: a record in a retrieve location, or in flight from a swap_out or
a pull (readable from its staging slot). An export looks in this daemon's own tiers instead
(:func:`export_tiers`). A prefill's swap_out may still be running when the
decode side asks, so an export may wait for the keys it lacks: it is woken by
:class:`~.peer_arrivals.Arrivals` whenever records arrive here, and looks again at least every
RECHECK_S for records that arrive another way (another daemon's writes to a shared directory).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from kvswap.backends.base import HeldRecord
from kvswap.protocol.errors import KvswapError, NotRegistered

from .data_threads import run
from .registration import Registration
from .swapper import Swapper
from .tiers import TIER_ORDER, Locations, NamespaceTiers

#: Longest a waiter goes without looking at the tiers again.
RECHECK_S = 0.1
#: The tiers an export reads from: the daemon's own.
LOCAL_TIERS = ("host", "file")


def export_tiers(tiers: NamespaceTiers) -> NamespaceTiers:
    """``tiers`` as an export sees them: retrieving from this daemon's own tiers (RAM, then
    files), whatever its retrieve locations. A prefill node that retrieves from the pool alone
    still exports what its engine saved to RAM; and the pool itself is never exported (a peer
    that wants it reads it directly)."""
    local = tuple(t for t in TIER_ORDER if t in LOCAL_TIERS and t in tiers.stores)
    return NamespaceTiers(tiers.stores, Locations(tiers.locations.store, local, False), tiers.metrics)


def current_registration(swapper: Swapper) -> Registration:
    registration = swapper.registration
    if registration is None or registration.tiers is None:
        raise NotRegistered("no cache is registered; send register first")
    return registration


async def landed_prefix(swapper: Swapper, registration: Registration, keys: Sequence[str],
                        tiers: NamespaceTiers | None = None) -> int:
    """Leading keys here: in a retrieve location (of ``tiers``, default the registration's) or in
    flight (as lookup counts them)."""
    tiers = tiers or registration.tiers
    inflight = swapper.inflight.keys(registration.namespace)
    assert tiers is not None
    hits = tiers.cached_prefix(keys, inflight)
    if hits < len(keys):
        hits += await run(swapper.threads.read, tiers.prefix, keys[hits:], set(inflight))
    return hits


async def wait_for_prefix(swapper: Swapper, registration: Registration, keys: Sequence[str], until: float,
                          enough: int | None = None, tiers: NamespaceTiers | None = None) -> int:
    """Leading keys here (in ``tiers``, as :func:`landed_prefix`), waiting until ``until``
    (``time.monotonic``) while fewer than ``enough`` (default: all) are."""
    enough = len(keys) if enough is None else enough
    hits = await landed_prefix(swapper, registration, keys, tiers)
    if hits >= enough or until <= time.monotonic() or not swapper.arrivals.join():
        return hits  # nothing to wait for, or MAX_WAITERS wait already: answered as at the end
    try:
        while True:
            left = until - time.monotonic()
            if hits >= enough or left <= 0 or registration is not swapper.registration:
                return hits
            await swapper.arrivals.wait(min(RECHECK_S, left))
            hits = await landed_prefix(swapper, registration, keys, tiers)
    finally:
        swapper.arrivals.leave()


async def copy_records(swapper: Swapper, registration: Registration, keys: Sequence[str],
                       outs: Sequence[np.ndarray], tiers: NamespaceTiers | None = None) -> int:
    """Copy the records of ``keys`` into ``outs`` (one record each), from where swap_in would
    load them (from ``tiers``, default the registration's): an in-flight write's slot, a RAM-tier
    slot, else a read from the tiers (checked as every read is). Returns the leading records
    copied; it stops at the first it lacks."""
    tiers, namespace = tiers or registration.tiers, registration.namespace
    assert tiers is not None
    held: list[HeldRecord | None] = [None] * len(keys)
    entries = [swapper.inflight.get(namespace, key) for key in keys]
    stored = [i for i, entry in enumerate(entries) if entry is None]
    for i, found in zip(stored, tiers.hold([keys[i] for i in stored])):
        held[i] = found
    for i, entry in enumerate(entries):
        if entry is not None:
            held[i] = entry.slot.retain()
    try:
        for i, entry in enumerate(entries):
            if entry is not None:
                try:
                    await entry.copied
                except KvswapError:  # its copy was abandoned: not here after all
                    return await _copy_prefix(swapper, held, outs, i)
        count = len(keys)
        missing = [i for i in range(len(keys)) if held[i] is None]
        wave = max(1, swapper.staging.read_wave)
        for start in range(0, len(missing), wave):
            group = missing[start:start + wave]
            slots = await swapper.staging.take_read(len(group))
            statuses = await run(swapper.threads.read, _read_all, tiers, [keys[i] for i in group], slots)
            for i, slot, status in zip(group, slots, statuses):
                if status == "loaded":
                    held[i] = slot
                else:
                    await swapper.staging.release([slot])
                    count = min(count, i)
            if count < len(keys):
                break
        return await _copy_prefix(swapper, held, outs, count)
    finally:
        await swapper.staging.release([h for h in held if h is not None])


def _read_all(tiers: Any, keys: list[str], slots: list[Any]) -> list[str]:
    return [tiers.read(key, slot)[0] for key, slot in zip(keys, slots)]


async def _copy_prefix(swapper: Swapper, held: list[HeldRecord | None], outs: Sequence[np.ndarray], limit: int) -> int:
    count = 0
    while count < limit and held[count] is not None:
        count += 1
    sources = [h.view for h in held[:count] if h is not None]
    await run(swapper.threads.copy, _copy_into, sources, list(outs[:count]))
    return count


def _copy_into(sources: list[np.ndarray], outs: list[np.ndarray]) -> None:
    for source, out in zip(sources, outs):
        out[:] = source
