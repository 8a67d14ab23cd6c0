"""Random engine cache layouts for the layout-conversion tests: layer-major tensors with gaps
(strided), block-major rows (interleaved), regions spread over several memory handles in any
order. Shared by tests/test_copy_plan.py (plan level) and tests/test_host_mover_records.py (the
record-level calls the daemon runs), each with its own reference."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kvswap.daemon.movers.copy_plan import Placement
from kvswap.protocol.layout import CacheLayout


@dataclass
class Scenario:
    layout: CacheLayout
    placements: list[Placement]
    handle_sizes: list[int]
    block_ids: list[int]
    seed: int


@st.composite
def layouts(draw) -> CacheLayout:
    return CacheLayout(
        model_id="test/model",
        num_layers=draw(st.integers(1, 3)),
        num_extra_layers=draw(st.integers(0, 2)),
        num_blocks=draw(st.integers(1, 6)),
        block_size=draw(st.integers(1, 4)),
        num_kv_heads=draw(st.integers(1, 2)),
        head_dim=draw(st.integers(1, 8)),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32", "float8_e4m3fn", "uint8"])),
        has_values=draw(st.booleans()),
        scale_dtype=draw(st.sampled_from(["float32", "float16"])),
    )


@st.composite
def scenarios(draw, distinct: bool = False) -> Scenario:
    layout = draw(layouts())
    regions = list(layout.regions)
    num_handles = draw(st.integers(1, 3))
    by_handle: list[list] = [[] for _ in range(num_handles)]
    for region in regions:
        by_handle[draw(st.integers(0, num_handles - 1))].append(region)

    placements: dict[str, Placement] = {}
    sizes = []
    n = layout.num_blocks
    for h, members in enumerate(by_handle):
        members = draw(st.permutations(members))  # the engine's order need not be the record's
        cursor = draw(st.integers(0, 64))  # leading bytes of the handle nobody owns
        if draw(st.booleans()):
            # Layer-major: each region a tensor of its own, one after another, with gaps
            # between blocks (stride > block_bytes) and between tensors.
            for r in members:
                stride = r.block_bytes + draw(st.integers(0, 16))
                offset = cursor + draw(st.integers(0, 32))
                placements[r.name] = Placement(r.name, h, offset, stride, r.block_bytes, r.record_offset)
                cursor = offset + (n - 1) * stride + r.block_bytes
        else:
            # Block-major rows: every member's chunk of block b in row b, interleaved.
            base, row = cursor, 0
            positions = []
            for r in members:
                row += draw(st.integers(0, 8))
                positions.append((r, row))
                row += r.block_bytes
            row += draw(st.integers(0, 8))
            for r, at in positions:
                placements[r.name] = Placement(r.name, h, base + at, max(row, 1), r.block_bytes, r.record_offset)
            cursor = base + n * row
        sizes.append(cursor + draw(st.integers(0, 32)))

    if distinct:
        block_ids = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    else:
        block_ids = draw(st.lists(st.integers(0, n - 1), max_size=10))
    ordered = [placements[r.name] for r in regions]  # region order = record order
    return Scenario(layout, ordered, sizes, block_ids, draw(st.integers(0, 2**32 - 1)))
