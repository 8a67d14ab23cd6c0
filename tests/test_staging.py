"""The bounded staging pool (kvswap.daemon.staging): slot sizes and alignment, all-or-nothing
takes, reference counting. Pure units."""

from __future__ import annotations

import numpy as np
import pytest

from kvswap.common.units import PAGE_BYTES, round_up_to_page
from kvswap.daemon.staging import StagingPool, aligned_empty


def test_aligned_empty_is_aligned_and_sized():
    for nbytes in (1, 100, 4096, 4097, 3 * 4096 + 5):
        a = aligned_empty(nbytes)
        assert a.ctypes.data % 4096 == 0
        assert a.nbytes == nbytes and a.dtype == np.uint8
    b = aligned_empty(10, align=512)
    assert b.ctypes.data % 512 == 0


@pytest.mark.parametrize("record_bytes, slot_bytes", [(1, 4096), (4096, 4096), (4097, 8192), (10_000, 12288)])
def test_slots_are_aligned_sized_and_disjoint(record_bytes, slot_bytes):
    pool = StagingPool(record_bytes, budget_bytes=4 * slot_bytes)
    assert PAGE_BYTES == 4096 and round_up_to_page(record_bytes) == slot_bytes
    assert pool.slot_bytes == slot_bytes
    assert pool.capacity == 4 and pool.free == 4 and pool.in_use == 0
    slots = pool.try_take(4)
    assert slots is not None and len(slots) == 4
    assert len({s.index for s in slots}) == 4
    for i, slot in enumerate(slots):
        assert slot.view.ctypes.data % 4096 == 0
        assert slot.view.nbytes == record_bytes
        slot.view[:] = i + 1
    # writing one slot never touched another
    for i, slot in enumerate(slots):
        assert np.count_nonzero(slot.view != i + 1) == 0


def test_capacity_follows_budget():
    assert StagingPool(4096, budget_bytes=10 * 4096).capacity == 10
    assert StagingPool(4096, budget_bytes=10 * 4096 + 4095).capacity == 10
    assert StagingPool(5000, budget_bytes=10 * 8192).capacity == 10
    # a budget below one slot still gets one, so the daemon can move a block at all
    assert StagingPool(4096, budget_bytes=0).capacity == 1


def test_try_take_is_all_or_nothing():
    pool = StagingPool(100, budget_bytes=3 * 4096)
    first = pool.try_take(2)
    assert first is not None and len(first) == 2
    assert pool.free == 1 and pool.in_use == 2
    assert pool.try_take(2) is None
    assert pool.free == 1  # a refused take holds nothing
    assert pool.try_take(4) is None
    assert pool.free == 1
    last = pool.try_take(1)
    assert last is not None and len(last) == 1
    assert pool.free == 0
    assert pool.try_take(1) is None
    assert {s.index for s in first + last} == {0, 1, 2}
    assert pool.try_take(0) == []


def test_release_returns_slots():
    pool = StagingPool(100, budget_bytes=2 * 4096)
    slots = pool.try_take(2)
    assert slots is not None
    assert pool.try_take(1) is None
    slots[0].release()
    assert pool.free == 1 and pool.in_use == 1
    again = pool.try_take(1)
    assert again is not None and again[0] is slots[0]
    again[0].release()
    slots[1].release()
    assert pool.free == 2 and pool.in_use == 0
    assert pool.try_take(2) is not None


def test_retain_keeps_slot_until_last_release():
    pool = StagingPool(100, budget_bytes=4096)
    (slot,) = pool.try_take(1)
    assert slot.retain() is slot
    slot.retain()
    slot.release()
    assert pool.free == 0
    slot.release()
    assert pool.free == 0
    assert pool.try_take(1) is None
    slot.release()
    assert pool.free == 1
    assert pool.try_take(1) == [slot]


def test_double_release_raises():
    pool = StagingPool(100, budget_bytes=2 * 4096)
    (slot,) = pool.try_take(1)
    slot.release()
    with pytest.raises(RuntimeError, match="released twice"):
        slot.release()
    # the slot was returned once, not twice
    assert pool.free == 2
    assert len(pool.try_take(2)) == 2
    assert pool.try_take(1) is None


def test_retake_resets_refcount():
    """A slot taken again after its release is held exactly once by the new taker."""
    pool = StagingPool(100, budget_bytes=4096)
    (slot,) = pool.try_take(1)
    slot.retain()
    slot.release()
    slot.release()
    (again,) = pool.try_take(1)
    assert again is slot
    again.release()
    assert pool.free == 1


def test_one_release_that_frees_room_for_every_waiting_read_wakes_them_all():
    """Issue 22 (12d): swap_ins waiting in ``take_read`` for read slots, and one ``release``
    that frees enough for all of them: every waiter gets its slots (a release that woke one
    waiter would leave the others waiting with the slots free). The waiters are known to be
    waiting when each has failed one take (nothing yields between that take and the wait)."""
    import asyncio

    from kvswap.daemon.metrics import Metrics
    from kvswap.daemon.staging import Staging

    staging = Staging(write_bytes=4096, read_bytes=6 * 4096, backends=[], metrics=Metrics())
    staging.prepare(4096)
    window = staging.read
    assert window is not None and window.capacity == 6
    refused = 0
    take = window.try_take

    def counting_take(count):
        nonlocal refused
        taken = take(count)
        refused += taken is None
        return taken

    window.try_take = counting_take
    wants = [1, 2, 1, 2]

    async def main():
        held = await staging.take_read(6)
        waiters = [asyncio.ensure_future(staging.take_read(n)) for n in wants]
        while refused < len(wants):  # each waiter tried once and is waiting now
            await asyncio.sleep(0)
        assert not any(w.done() for w in waiters) and window.free == 0
        await staging.release(held)
        return await asyncio.wait_for(asyncio.gather(*waiters), timeout=10)

    got = asyncio.run(main())
    assert [len(slots) for slots in got] == wants
    assert len({slot.index for slots in got for slot in slots}) == 6
    assert window.in_use == 6 and window.free == 0
    for slots in got:
        for slot in slots:
            slot.release()
    assert window.in_use == 0 and window.free == 6
