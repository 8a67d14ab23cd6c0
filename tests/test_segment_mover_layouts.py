"""The shared-memory mover (SegmentMover, what the daemon runs for every ``shm`` engine) on
random layouts: strided, interleaved and several-handle caches (tests/layout_scenarios.py), on
both its copy paths (the native helper and the preadv/pwritev fallback). It must build each
record from its block's chunks in the layout's region order, write them back where each
region keeps the block, and never touch a byte outside the blocks it was asked for.

tests/test_host_mover_records.py checks the reference mover the same way; before this file the
shared-memory mover met only HostKVCache's one-handle-per-region layout (a mover that took the
block size as the stride would have passed every daemon test on such caches)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from kvswap.common.shm import SharedSegment
from kvswap.daemon.movers.native import load_copy_rows
from kvswap.daemon.movers.segment import SegmentMover

from layout_scenarios import Scenario, scenarios
from test_host_mover_records import exact_sizes, expected_record, place, slots_for, truth

PATHS = [False] + ([True] if load_copy_rows(True) is not None else [])


def always() -> bool:
    return True


class Segments:
    """One shared-memory segment per handle of a scenario, holding its regions' blocks."""

    def __init__(self, s: Scenario, sizes: list[int], fill: int) -> None:
        self.owned = [SharedSegment.create(max(size, 1)) for size in sizes]
        self.views = [np.frombuffer(seg.buffer, dtype=np.uint8)[:size] for seg, size in zip(self.owned, sizes)]
        for view in self.views:
            view[:] = fill
        # The daemon's side: attached by name, unmapped (the mover maps or preads them itself).
        self.attached = [SharedSegment.attach(seg.name, mapped=False) for seg in self.owned]

    def snapshot(self) -> list[bytes]:
        return [v.tobytes() for v in self.views]

    def close(self) -> None:
        del self.views
        for seg in self.attached:
            seg.close()
        for seg in self.owned:
            seg.close()
            seg.unlink()


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "preadv")
@settings(max_examples=60, deadline=None)
@given(s=scenarios())
def test_gather_builds_each_record_from_its_blocks_chunks(native: bool, s: Scenario) -> None:
    contents = truth(s, s.seed)
    segments = Segments(s, exact_sizes(s), 0xA5)
    try:
        place(s, segments.views, contents)
        before = segments.snapshot()
        mover = SegmentMover(segments.attached, s.placements, s.layout.record_bytes, s.layout.num_blocks, native)
        slots = slots_for(len(s.block_ids), s.layout.record_bytes, 0xEE)
        assert mover.gather_blocks(s.block_ids, slots, always)
        assert [slot.tobytes() for slot in slots] == [expected_record(s, contents, b) for b in s.block_ids]
        assert segments.snapshot() == before  # a gather reads only
        mover.close()
    finally:
        segments.close()


@pytest.mark.parametrize("native", PATHS, ids=lambda n: "native" if n else "preadv")
@settings(max_examples=60, deadline=None)
@given(s=scenarios(distinct=True))
def test_scatter_writes_each_chunk_where_its_region_keeps_the_block_and_nothing_else(native: bool,
                                                                                     s: Scenario) -> None:
    contents = truth(s, s.seed)
    incoming = truth(s, s.seed + 1)
    segments = Segments(s, exact_sizes(s), 0x3C)
    try:
        place(s, segments.views, contents)
        mover = SegmentMover(segments.attached, s.placements, s.layout.record_bytes, s.layout.num_blocks, native)
        slots = slots_for(len(s.block_ids), s.layout.record_bytes, 0)
        for slot, b in zip(slots, s.block_ids):
            slot[:] = np.frombuffer(expected_record(s, incoming, b), dtype=np.uint8)
        assert mover.scatter_blocks(s.block_ids, slots, always)
        # The blocks asked for hold the incoming records; every other byte is as it was.
        want = [np.frombuffer(b, dtype=np.uint8).copy() for b in segments.snapshot()]
        expected = {r.name: contents[r.name].copy() for r in s.layout.regions}
        for b in s.block_ids:
            for name in expected:
                expected[name][b] = incoming[name][b]
        reference = [np.full(v.size, 0x3C, dtype=np.uint8) for v in segments.views]
        place(s, reference, expected)
        assert [w.tobytes() for w in want] == [r.tobytes() for r in reference]
        mover.close()
    finally:
        segments.close()
