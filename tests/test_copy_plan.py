"""Layout conversion (kvswap.daemon.movers.copy_plan) executed by the reference host mover
(kvswap/testing/reference_mover.py): the docstring's worked example byte for byte, then random layouts
and placements against a reference written independently here. Pure units, no daemon."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from kvswap.daemon.movers.copy_plan import Copy, Placement, copy_plan, plan_arrays
from kvswap.protocol.layout import CacheLayout

from layout_scenarios import Scenario, scenarios
from kvswap.testing.reference_mover import HostMover

# -- the worked example -----------------------------------------------------------------------

EXAMPLE = [
    Placement("k.0", handle=0, offset=0, stride=4, block_bytes=4, record_offset=0),
    Placement("v.0", handle=0, offset=100, stride=4, block_bytes=4, record_offset=4),
]


def test_docstring_worked_example():
    assert copy_plan(EXAMPLE, [2, 0], record_bytes=8) == [
        Copy(handle=0, engine_offset=8, staging_offset=0, nbytes=4),
        Copy(handle=0, engine_offset=108, staging_offset=4, nbytes=4),
        Copy(handle=0, engine_offset=0, staging_offset=8, nbytes=4),
        Copy(handle=0, engine_offset=100, staging_offset=12, nbytes=4),
    ]


def test_worked_example_gather_and_scatter_bytes():
    engine = np.arange(112, dtype=np.uint8)
    mover = HostMover([engine])
    staging = np.full(16, 0xEE, dtype=np.uint8)
    plan = copy_plan(EXAMPLE, [2, 0], record_bytes=8)
    mover.gather(plan, staging)
    assert staging.tobytes() == bytes([8, 9, 10, 11, 108, 109, 110, 111, 0, 1, 2, 3, 100, 101, 102, 103])

    target = np.zeros(112, dtype=np.uint8)
    HostMover([target]).scatter(plan, np.arange(1, 17, dtype=np.uint8))
    expected = bytearray(112)
    expected[8:12] = bytes([1, 2, 3, 4])
    expected[108:112] = bytes([5, 6, 7, 8])
    expected[0:4] = bytes([9, 10, 11, 12])
    expected[100:104] = bytes([13, 14, 15, 16])
    assert target.tobytes() == bytes(expected)


def test_empty_block_list_is_an_empty_plan():
    assert copy_plan(EXAMPLE, [], record_bytes=8) == []


def test_placement_end():
    p = Placement("k.0", handle=0, offset=100, stride=16, block_bytes=4, record_offset=0)
    assert p.end(1) == 104
    assert p.end(3) == 100 + 2 * 16 + 4


def test_plan_is_ordered_record_by_record():
    plan = copy_plan(EXAMPLE, [5, 1, 5], record_bytes=8)
    assert [c.staging_offset for c in plan] == [0, 4, 8, 12, 16, 20]
    assert [c.engine_offset for c in plan] == [20, 120, 4, 104, 20, 120]


def test_mover_accepts_typed_engine_tensors():
    """Engine buffers arrive as typed tensors (fp16 [blocks, heads, tokens, dim]); the mover
    moves their raw bytes."""
    layout = CacheLayout(model_id="m", num_layers=1, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=2,
                         dtype="float16")
    k = np.arange(12, dtype=np.float16).reshape(layout.tensor_shape())
    v = -np.arange(12, dtype=np.float16).reshape(layout.tensor_shape())
    placements = [Placement(r.name, handle=i, offset=0, stride=r.block_bytes, block_bytes=r.block_bytes,
                            record_offset=r.record_offset) for i, r in enumerate(layout.regions)]
    staging = np.zeros(layout.record_bytes, dtype=np.uint8)
    HostMover([k, v]).gather(copy_plan(placements, [1], layout.record_bytes), staging)
    assert staging.tobytes() == k[1].tobytes() + v[1].tobytes()


# -- random layouts and placements --------------------------------------------------------------


def _region_contents(s: Scenario, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per region, the bytes of each of its blocks: shape [num_blocks, block_bytes]."""
    return {r.name: rng.integers(0, 256, size=(s.layout.num_blocks, r.block_bytes), dtype=np.uint8)
            for r in s.layout.regions}


def _fill_engine(s: Scenario, contents: dict[str, np.ndarray], fill: int) -> list[np.ndarray]:
    """The engine's handles with each region's blocks where its placement says, and ``fill``
    everywhere else."""
    buffers = [np.full(size, fill, dtype=np.uint8) for size in s.handle_sizes]
    for p in s.placements:
        for b in range(s.layout.num_blocks):
            start = p.offset + b * p.stride
            assert start + p.block_bytes <= len(buffers[p.handle])
            buffers[p.handle][start:start + p.block_bytes] = contents[p.name][b]
    return buffers


def _reference_records(s: Scenario, contents: dict[str, np.ndarray]) -> bytes:
    """Record i = every region's chunk of block block_ids[i], in region order."""
    out = bytearray()
    for b in s.block_ids:
        for region in s.layout.regions:
            out += contents[region.name][b].tobytes()
    return bytes(out)




@settings(max_examples=120, deadline=None)
@given(s=scenarios())
def test_gather_matches_reference(s: Scenario):
    rng = np.random.default_rng(s.seed)
    contents = _region_contents(s, rng)
    buffers = _fill_engine(s, contents, fill=0x5A)
    before = [b.copy() for b in buffers]
    record_bytes = s.layout.record_bytes

    plan = copy_plan(s.placements, s.block_ids, record_bytes)
    assert len(plan) == len(s.block_ids) * len(s.layout.regions)
    assert sum(c.nbytes for c in plan) == len(s.block_ids) * record_bytes

    staging = np.full(len(s.block_ids) * record_bytes, 0xA5, dtype=np.uint8)
    HostMover(buffers).gather(plan, staging)
    assert staging.tobytes() == _reference_records(s, contents)
    # a gather only reads the engine
    assert all(np.array_equal(a, b) for a, b in zip(buffers, before))


@settings(max_examples=120, deadline=None)
@given(s=scenarios(distinct=True))
def test_scatter_writes_exactly_the_chunks(s: Scenario):
    rng = np.random.default_rng(s.seed)
    record_bytes = s.layout.record_bytes
    # staging bytes are never zero, so every written engine byte is told from an untouched one
    staging = rng.integers(1, 256, size=len(s.block_ids) * record_bytes, dtype=np.uint8)
    buffers = [np.zeros(size, dtype=np.uint8) for size in s.handle_sizes]

    HostMover(buffers).scatter(copy_plan(s.placements, s.block_ids, record_bytes), staging)

    # Every chunk of every record landed in its region's block ...
    for i, b in enumerate(s.block_ids):
        rec = staging[i * record_bytes:(i + 1) * record_bytes].tobytes()
        for region, p in zip(s.layout.regions, s.placements):
            start = p.offset + b * p.stride
            got = buffers[p.handle][start:start + region.block_bytes].tobytes()
            assert got == rec[region.record_offset:region.record_offset + region.block_bytes], (i, b, region.name)
    # ... and nothing else was written.
    written = sum(int(np.count_nonzero(buf)) for buf in buffers)
    assert written == len(s.block_ids) * record_bytes


@settings(max_examples=60, deadline=None)
@given(s=scenarios(distinct=True))
def test_scatter_then_gather_round_trips(s: Scenario):
    rng = np.random.default_rng(s.seed)
    record_bytes = s.layout.record_bytes
    staging = rng.integers(0, 256, size=len(s.block_ids) * record_bytes, dtype=np.uint8)
    buffers = [np.zeros(size, dtype=np.uint8) for size in s.handle_sizes]
    mover = HostMover(buffers)
    plan = copy_plan(s.placements, s.block_ids, record_bytes)
    mover.scatter(plan, staging)
    back = np.zeros_like(staging)
    mover.gather(plan, back)
    assert back.tobytes() == staging.tobytes()


@pytest.mark.parametrize("dtype, has_values, expected_regions", [
    ("bfloat16", True, ["k.0", "v.0", "k.1", "v.1"]),
    ("uint8", True, ["k.0", "v.0", "ks.0", "vs.0", "k.1", "v.1", "ks.1", "vs.1"]),
    ("uint8", False, ["k.0", "ks.0", "k.1", "ks.1"]),
    ("float16", False, ["k.0", "k.1"]),
])
def test_record_order_follows_layout_regions(dtype, has_values, expected_regions):
    """One block per region, each region's bytes a distinct constant: the record is the
    constants in the layout's region order, each repeated block_bytes times."""
    layout = CacheLayout(model_id="m", num_layers=2, num_blocks=1, block_size=2, num_kv_heads=1, head_dim=4,
                         dtype=dtype, has_values=has_values)
    assert [r.name for r in layout.regions] == expected_regions
    buffers = [np.full(r.block_bytes, i + 1, dtype=np.uint8) for i, r in enumerate(layout.regions)]
    placements = [Placement(r.name, i, 0, r.block_bytes, r.block_bytes, r.record_offset)
                  for i, r in enumerate(layout.regions)]
    staging = np.zeros(layout.record_bytes, dtype=np.uint8)
    HostMover(buffers).gather(copy_plan(placements, [0], layout.record_bytes), staging)
    expected = b"".join(bytes([i + 1]) * r.block_bytes for i, r in enumerate(layout.regions))
    assert staging.tobytes() == expected


@pytest.mark.parametrize("placements, block_ids", [
    (EXAMPLE, []),                                       # no blocks
    ([], [2, 0]),                                        # no regions
    (EXAMPLE, np.array([2, 0], dtype=np.int32)),         # block ids as a narrow array
])
def test_plan_arrays_are_int64_whatever_the_input(placements, block_ids) -> None:
    """Device movers build index tables from these arrays: an empty input must not turn them
    into float64 (numpy's default for an empty list)."""
    arrays = plan_arrays(placements, block_ids, record_bytes=8)
    for name in ("handle", "engine_offset", "staging_offset", "nbytes"):
        assert getattr(arrays, name).dtype == np.int64, name
    assert arrays.copies() == copy_plan(placements, [int(b) for b in block_ids], 8)
