"""The reference host mover's record-level calls (``HostMover.gather_blocks`` /
``scatter_blocks``, kvswap/testing/reference_mover.py: the Mover interface every daemon mover
implements), over random strided, interleaved and
several-handle layouts, against a reference written here; and the mover's own bounds, with no
``Registration`` in front of it.

The GPU movers and the shared-memory mover are checked against this mover, and every daemon
test registers a ``HostKVCache`` (one handle per region, stride == block bytes): without these
a reference that used the block size as the stride would agree with a mover scrambling every
strided engine cache (vLLM's CPU cache, FastDeploy's) while the suite stayed green. Pure units.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from kvswap.daemon.movers.copy_plan import Placement

from layout_scenarios import Scenario, scenarios
from kvswap.testing.reference_mover import HostMover

GUARD = 64  # bytes around every handle that no block owns; they must never change


def always() -> bool:
    return True


def truth(s: Scenario, seed: int) -> dict[str, np.ndarray]:
    """What the engine holds: per region, [num_blocks, block_bytes] random bytes."""
    rng = np.random.default_rng(seed)
    return {r.name: rng.integers(0, 256, size=(s.layout.num_blocks, r.block_bytes), dtype=np.uint8)
            for r in s.layout.regions}


def guarded(sizes: list[int], fill: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One array per handle with ``GUARD`` bytes on each side, and the handle views into them
    (the mover sees only the views; the guards catch a copy past either end)."""
    backing = [np.full(size + 2 * GUARD, fill, dtype=np.uint8) for size in sizes]
    return backing, [b[GUARD:GUARD + size] for b, size in zip(backing, sizes)]


def place(s: Scenario, views: list[np.ndarray], contents: dict[str, np.ndarray]) -> None:
    """Put every region's blocks where its placement says: block b at offset + b * stride."""
    for p in s.placements:
        for b in range(s.layout.num_blocks):
            start = p.offset + b * p.stride
            views[p.handle][start:start + p.block_bytes] = contents[p.name][b]


def expected_record(s: Scenario, contents: dict[str, np.ndarray], block: int) -> bytes:
    """A record: the block's chunk of every region, in the layout's region order."""
    return b"".join(contents[r.name][block].tobytes() for r in s.layout.regions)


def slots_for(count: int, record_bytes: int, fill: int) -> list[np.ndarray]:
    """Staging slots as the daemon has them: separate record-sized views of one arena, with
    a gap between them so a copy past a record's end shows up in the next slot's gap."""
    arena = np.full(max(count, 1) * (record_bytes + GUARD), fill, dtype=np.uint8)
    return [arena[i * (record_bytes + GUARD):i * (record_bytes + GUARD) + record_bytes] for i in range(count)]


def exact_sizes(s: Scenario) -> list[int]:
    """Each handle exactly as long as its regions need: one past the last block's last byte."""
    sizes = [0] * len(s.handle_sizes)
    for p in s.placements:
        sizes[p.handle] = max(sizes[p.handle], p.end(s.layout.num_blocks))
    return sizes


# -- gather_blocks / scatter_blocks against the reference -----------------------------------------


@settings(max_examples=150, deadline=None)
@given(s=scenarios())
def test_gather_blocks_builds_each_record_from_its_block(s: Scenario) -> None:
    contents = truth(s, s.seed)
    backing, views = guarded(s.handle_sizes, fill=0x5A)
    place(s, views, contents)
    before = [b.copy() for b in backing]
    record_bytes = s.layout.record_bytes
    slots = slots_for(len(s.block_ids), record_bytes, fill=0xA5)

    mover = HostMover(views, s.placements, record_bytes)
    assert mover.gather_blocks(s.block_ids, slots, always) is True

    for i, block in enumerate(s.block_ids):
        assert slots[i].tobytes() == expected_record(s, contents, block), (i, block)
    if slots:  # the gaps between slots stay as they were: nothing written past a record
        arena = slots[0].base
        gaps = [arena[i * (record_bytes + GUARD) + record_bytes:(i + 1) * (record_bytes + GUARD)]
                for i in range(len(slots))]
        assert all((g == 0xA5).all() for g in gaps)
    assert all(np.array_equal(a, b) for a, b in zip(backing, before))  # a gather only reads


@settings(max_examples=150, deadline=None)
@given(s=scenarios(distinct=True))
def test_scatter_blocks_writes_each_chunk_where_its_region_keeps_the_block(s: Scenario) -> None:
    rng = np.random.default_rng(s.seed)
    record_bytes = s.layout.record_bytes
    slots = slots_for(len(s.block_ids), record_bytes, fill=0)
    for slot in slots:
        slot[:] = rng.integers(1, 256, size=record_bytes, dtype=np.uint8)  # never 0: written bytes show
    backing, views = guarded(s.handle_sizes, fill=0)

    mover = HostMover(views, s.placements, record_bytes)
    assert mover.scatter_blocks(s.block_ids, slots, always) is True

    expected = [np.zeros_like(b) for b in backing]
    for slot, block in zip(slots, s.block_ids):
        for region, p in zip(s.layout.regions, s.placements):
            start = GUARD + p.offset + block * p.stride
            expected[p.handle][start:start + p.block_bytes] = \
                slot[region.record_offset:region.record_offset + region.block_bytes]
    for h, (got, want) in enumerate(zip(backing, expected)):
        assert got.tobytes() == want.tobytes(), f"handle {h}"


@settings(max_examples=60, deadline=None)
@given(s=scenarios(distinct=True))
def test_scatter_blocks_then_gather_blocks_round_trips_through_another_block_order(s: Scenario) -> None:
    """Records scattered into blocks come back byte for byte when gathered in reverse order."""
    rng = np.random.default_rng(s.seed)
    record_bytes = s.layout.record_bytes
    records = [rng.integers(0, 256, size=record_bytes, dtype=np.uint8) for _ in s.block_ids]
    slots = slots_for(len(records), record_bytes, fill=0)
    for slot, rec in zip(slots, records):
        slot[:] = rec
    _, views = guarded(s.handle_sizes, fill=0x33)
    mover = HostMover(views, s.placements, record_bytes)
    assert mover.scatter_blocks(s.block_ids, slots, always)
    back = slots_for(len(records), record_bytes, fill=0xEE)
    assert mover.gather_blocks(s.block_ids[::-1], back, always)
    assert [b.tobytes() for b in back] == [r.tobytes() for r in records[::-1]]


def test_a_strided_two_handle_cache_by_hand() -> None:
    """vLLM-style: one tensor per layer with K and V of a block side by side (stride = 2 *
    block bytes), plus FastDeploy-style separate K and V tensors for layer 1 in a second
    handle with padding between blocks. Block 1's record is k0|v0|k1|v1 of block 1."""
    bb = 4
    placements = [
        Placement("k.0", handle=0, offset=0, stride=2 * bb, block_bytes=bb, record_offset=0),
        Placement("v.0", handle=0, offset=bb, stride=2 * bb, block_bytes=bb, record_offset=bb),
        Placement("k.1", handle=1, offset=0, stride=bb + 2, block_bytes=bb, record_offset=2 * bb),
        Placement("v.1", handle=1, offset=3 * (bb + 2), stride=bb + 2, block_bytes=bb, record_offset=3 * bb),
    ]
    h0 = np.arange(3 * 2 * bb, dtype=np.uint8)             # 3 blocks: k0 v0 | k0 v0 | k0 v0
    h1 = np.arange(100, 100 + 6 * (bb + 2), dtype=np.uint8)  # 3 blocks of k.1, then 3 of v.1
    slot = np.zeros(4 * bb, dtype=np.uint8)
    assert HostMover([h0, h1], placements, 4 * bb).gather_blocks([1], [slot], always)
    assert slot.tolist() == ([8, 9, 10, 11] + [12, 13, 14, 15]          # k.0, v.0 of block 1
                             + [106, 107, 108, 109] + [124, 125, 126, 127])  # k.1, v.1 of block 1


def test_a_deadline_stops_gather_and_scatter_before_the_next_block() -> None:
    placements = [Placement("k.0", 0, 0, 8, 4, 0)]
    engine = np.arange(32, dtype=np.uint8)
    mover = HostMover([engine], placements, 4)
    calls = iter([True, True, False])
    slots = slots_for(3, 4, fill=0xEE)
    assert mover.gather_blocks([0, 1, 2], slots, lambda: next(calls)) is False
    assert [s.tolist() for s in slots] == [[0, 1, 2, 3], [8, 9, 10, 11], [0xEE] * 4]
    calls = iter([True, False])
    assert mover.scatter_blocks([3, 2], slots[:2], lambda: next(calls)) is False
    assert engine[24:28].tolist() == [0, 1, 2, 3] and engine[16:20].tolist() == [16, 17, 18, 19]


# -- bounds, with no Registration in front -----------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(s=scenarios())
def test_the_block_past_the_end_is_refused_and_never_copied(s: Scenario) -> None:
    """Handles exactly as long as ``num_blocks`` needs: block ``num_blocks`` (and beyond, and
    below 0) raises before a byte moves, in both directions; the guard bytes after the last
    block and the engine are untouched."""
    n = s.layout.num_blocks
    record_bytes = s.layout.record_bytes
    contents = truth(s, s.seed)
    backing, views = guarded(exact_sizes(s), fill=0x77)
    place(s, views, contents)
    before = [b.copy() for b in backing]
    mover = HostMover(views, s.placements, record_bytes)

    # The last block is in range.
    (last,) = slots_for(1, record_bytes, fill=0)
    assert mover.gather_blocks([n - 1], [last], always)
    assert last.tobytes() == expected_record(s, contents, n - 1)

    for bad in (n, n + 1, -1):
        (slot,) = slots_for(1, record_bytes, fill=0xC3)
        with pytest.raises(IndexError):
            mover.gather_blocks([bad], [slot], always)
        assert (slot == 0xC3).all(), f"gather of block {bad} copied bytes"
        with pytest.raises(IndexError):
            mover.scatter_blocks([bad], [slot], always)
        assert all(np.array_equal(a, b) for a, b in zip(backing, before)), f"scatter of block {bad} wrote"


def test_one_past_the_end_of_a_single_tensor_cache() -> None:
    """The smallest case by hand: 4 blocks of 8 bytes; block 4 would be the 8 guard bytes."""
    backing = np.zeros(40, dtype=np.uint8)
    engine = backing[:32]
    mover = HostMover([engine], [Placement("k.0", 0, 0, 8, 8, 0)], 8)
    slot = np.full(8, 0xFF, dtype=np.uint8)
    with pytest.raises(IndexError):
        mover.scatter_blocks([4], [slot], always)
    with pytest.raises(IndexError):
        mover.scatter_blocks([2, 4], [slot, slot], always)
    assert backing[32:].tolist() == [0] * 8
    assert mover.scatter_blocks([3], [slot], always)
    assert backing[24:32].tolist() == [0xFF] * 8 and backing[32:].tolist() == [0] * 8


def test_a_mover_without_regions_refuses_every_block() -> None:
    mover = HostMover([np.zeros(16, dtype=np.uint8)])
    slot = np.zeros(8, dtype=np.uint8)
    for block in (0, 1):
        with pytest.raises(IndexError, match=f"^block {block} is outside the mapped cache$"):
            mover.gather_blocks([block], [slot], always)
        with pytest.raises(IndexError):
            mover.scatter_blocks([block], [slot], always)


def test_a_slot_that_is_not_one_contiguous_record_is_refused() -> None:
    engine = np.arange(32, dtype=np.uint8)
    mover = HostMover([engine], [Placement("k.0", 0, 0, 8, 8, 0)], 8)
    arena = np.full(16, 0xEE, dtype=np.uint8)
    message = "^a staging slot must be a contiguous buffer of one record$"
    for slot in (arena[::2], arena[:7]):  # strided, and one byte short
        with pytest.raises(ValueError, match=message):
            mover.gather_blocks([1], [slot], always)
        with pytest.raises(ValueError, match=message):
            mover.scatter_blocks([1], [slot], always)
    assert (arena == 0xEE).all() and engine.tolist() == list(range(32))
