"""The GPU movers' shared logic (kvswap.daemon.movers.gpu_plan, copy_plan.plan_arrays), executed by its
numpy twins and compared byte for byte with the host mover and with each block's reference
record, for every layout kind: bf16, fp16, fp8 with scales, MLA (keys only), MLA with fp8,
and extra (speculative) layers. Pure units, no daemon, no GPU."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from hypothesis import given, settings

from kvswap.daemon.movers.copy_plan import Placement, copy_plan, plan_arrays
from kvswap.daemon.movers.gpu_plan import (
    MAX_PIECE,
    AddressSpace,
    RegionRows,
    RowView,
    SlotRun,
    batches,
    check_fits,
    chunk_table,
    gather_rows,
    last_wins,
    parse_cuda_handles,
    records_per_batch,
    row_plan,
    run_chunk_table,
    scatter_rows,
    slot_runs,
)
from kvswap.daemon.registration import Registration
from kvswap.protocol import CacheLayout, HostKVCache, InvalidLayout
from kvswap.testing.reference_mover import HostMover
from test_copy_plan import EXAMPLE, Scenario, _fill_engine, _reference_records, _region_contents, scenarios

# -- layout kinds -----------------------------------------------------------------------------

KINDS = {
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "fp8_scales": dict(dtype="uint8"),
    "mla": dict(has_values=False),
    "mla_fp8": dict(dtype="uint8", has_values=False),
    "extra_layers": dict(num_extra_layers=2),
}
EXPECTED_REGIONS = {
    "bf16": ["k.0", "v.0", "k.1", "v.1"],
    "fp16": ["k.0", "v.0", "k.1", "v.1"],
    "fp8_scales": ["k.0", "v.0", "ks.0", "vs.0", "k.1", "v.1", "ks.1", "vs.1"],
    "mla": ["k.0", "k.1"],
    "mla_fp8": ["k.0", "ks.0", "k.1", "ks.1"],
    "extra_layers": ["k.0", "v.0", "k.1", "v.1", "k.2", "v.2", "k.3", "v.3"],
}


def kind_layout(kind: str, num_blocks: int = 12) -> CacheLayout:
    return CacheLayout("gpu-test", num_layers=2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8,
                       **KINDS[kind])


class Engine:
    """A CPU engine cache of one layout kind, registered the way the daemon registers it."""

    def __init__(self, kind: str, seed: int = 7) -> None:
        self.kind = kind
        self.layout = kind_layout(kind)
        self.cache = HostKVCache.create(self.layout)
        self.cache.fill_random(seed)
        body = self.cache.registration()
        self.registration = Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])
        # The engine's own mapping of its segment (the daemon holds the segment by descriptor).
        self.buffers: list[np.ndarray] = [np.frombuffer(self.cache.segment.buffer, dtype=np.uint8)]
        self.placements = self.registration.placements
        self.record_bytes = self.layout.record_bytes

    @property
    def bases(self) -> list[int]:
        return [b.ctypes.data for b in self.buffers]

    def records(self, block_ids) -> bytes:
        return b"".join(self.cache.block_record(b) for b in block_ids)

    def snapshot(self) -> list[bytes]:
        return [b.tobytes() for b in self.buffers]

    def close(self) -> None:
        self.registration.close()
        self.cache.close()


@pytest.fixture(params=sorted(KINDS))
def engine(request) -> Iterator[Engine]:
    e = Engine(request.param)
    yield e
    e.close()


GATHER = [9, 0, 4, 4, 11, 2]        # repeats and out-of-order ids
SCATTER = [(3, 1), (0, 5), (7, 2)]  # (source block, target block)


# -- the host path, per layout kind -------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layout_kind_regions(kind):
    assert [r.name for r in kind_layout(kind).regions] == EXPECTED_REGIONS[kind]


def test_host_mover_gathers_each_kinds_records(engine: Engine):
    slots = [np.zeros(engine.record_bytes, np.uint8) for _ in GATHER]
    assert engine.registration.mover.gather_blocks(GATHER, slots, lambda: True)
    assert b"".join(s.tobytes() for s in slots) == engine.records(GATHER)


def test_host_mover_scatters_each_kinds_records_into_other_blocks(engine: Engine):
    sources = [engine.cache.block_record(s) for s, _ in SCATTER]
    before = {b: engine.cache.block_record(b) for b in range(engine.layout.num_blocks)}
    slots = [np.frombuffer(r, np.uint8).copy() for r in sources]
    assert engine.registration.mover.scatter_blocks([t for _, t in SCATTER], slots, lambda: True)
    for (_, target), record in zip(SCATTER, sources):
        assert engine.cache.block_record(target) == record
    untouched = set(range(engine.layout.num_blocks)) - {t for _, t in SCATTER}
    assert all(engine.cache.block_record(b) == before[b] for b in untouched)


# -- plan_arrays ----------------------------------------------------------------------------------


def test_plan_arrays_worked_example():
    a = plan_arrays(EXAMPLE, [2, 0], record_bytes=8)
    assert a.handle.tolist() == [0, 0, 0, 0]
    assert a.engine_offset.tolist() == [8, 108, 0, 100]
    assert a.staging_offset.tolist() == [0, 4, 8, 12]
    assert a.nbytes.tolist() == [4, 4, 4, 4]
    assert a.copies() == copy_plan(EXAMPLE, [2, 0], 8)


def test_plan_arrays_of_no_blocks_is_empty():
    assert len(plan_arrays(EXAMPLE, [], 8)) == 0


@settings(max_examples=60, deadline=None)
@given(s=scenarios())
def test_plan_arrays_equal_copy_plan(s: Scenario):
    a = plan_arrays(s.placements, s.block_ids, s.layout.record_bytes)
    assert a.copies() == copy_plan(s.placements, s.block_ids, s.layout.record_bytes)


# -- chunk tables (the CuPy kernel's input) ------------------------------------------------------


def test_chunk_table_worked_example():
    plan = plan_arrays([Placement("k.0", 0, 8, 40, 40, 0)], [0], 40)
    table = chunk_table(plan, [1000], 5000, gather=True, max_piece=16)
    assert table.dtype == np.uint64
    assert table.tolist() == [[1008, 5000, 16], [1024, 5016, 16], [1040, 5032, 8]]


def test_chunk_table_scatter_swaps_source_and_destination():
    plan = plan_arrays(EXAMPLE, [2], 8)
    g = chunk_table(plan, [1000], 5000, gather=True)
    s = chunk_table(plan, [1000], 5000, gather=False)
    assert s[:, [1, 0, 2]].tolist() == g.tolist() == [[1008, 5000, 4], [1108, 5004, 4]]


def test_chunk_table_pieces_cover_each_chunk_once():
    plan = plan_arrays([Placement("k.0", 0, 0, 100_000, 100_000, 0), Placement("v.0", 1, 0, 48, 48, 100_000)],
                       [1, 0], 100_048)
    table = chunk_table(plan, [1 << 32, 1 << 40], 1 << 20, gather=True)
    assert int(table[:, 2].sum()) == 2 * 100_048
    assert int(table[:, 2].max()) == MAX_PIECE
    # 100000 bytes -> 2 pieces; 48 bytes -> 1; per record
    assert len(table) == 2 * (2 + 1)
    assert table[:3, 0].tolist() == [(1 << 32) + 100_000, (1 << 32) + 100_000 + MAX_PIECE, (1 << 40) + 48]


def test_chunk_table_refuses_unaligned_pieces():
    with pytest.raises(ValueError):
        chunk_table(plan_arrays(EXAMPLE, [0], 8), [0], 0, gather=True, max_piece=1000)


def test_chunk_table_of_no_blocks_is_empty():
    assert chunk_table(plan_arrays(EXAMPLE, [], 8), [0], 0, gather=True).shape == (0, 3)


def test_chunk_table_twin_gathers_and_scatters_each_kind(engine: Engine):
    staging = np.full(len(GATHER) * engine.record_bytes, 0xEE, np.uint8)
    space = AddressSpace([*engine.buffers, staging])
    before = engine.snapshot()
    table = chunk_table(plan_arrays(engine.placements, GATHER, engine.record_bytes), engine.bases,
                        staging.ctypes.data, gather=True, max_piece=64)  # small pieces: every split path
    run_chunk_table(table, space)
    assert staging.tobytes() == engine.records(GATHER)
    assert engine.snapshot() == before  # a gather only reads the engine

    targets = [t for _, t in SCATTER]
    records = np.frombuffer(engine.records([s for s, _ in SCATTER]), np.uint8).copy()
    table = chunk_table(plan_arrays(engine.placements, targets, engine.record_bytes), engine.bases,
                        records.ctypes.data, gather=False, max_piece=64)
    run_chunk_table(table, AddressSpace([*engine.buffers, records]))
    assert engine.records(targets) == records.tobytes()


@settings(max_examples=80, deadline=None)
@given(s=scenarios())
def test_chunk_table_twin_matches_host_mover(s: Scenario):
    rng = np.random.default_rng(s.seed)
    contents = _region_contents(s, rng)
    buffers = _fill_engine(s, contents, fill=0x5A)
    record_bytes = s.layout.record_bytes
    staging = np.full(max(1, len(s.block_ids) * record_bytes), 0xA5, np.uint8)
    table = chunk_table(plan_arrays(s.placements, s.block_ids, record_bytes), [b.ctypes.data for b in buffers],
                        staging.ctypes.data, gather=True, max_piece=16)
    run_chunk_table(table, AddressSpace([*buffers, staging]))
    host = np.zeros_like(staging)
    HostMover(buffers).gather(copy_plan(s.placements, s.block_ids, record_bytes), host)
    used = len(s.block_ids) * record_bytes
    assert staging[:used].tobytes() == host[:used].tobytes() == _reference_records(s, contents)


def test_address_space_refuses_stray_addresses():
    a = np.zeros(16, np.uint8)
    space = AddressSpace([a])
    assert space.view(a.ctypes.data + 4, 12).size == 12
    with pytest.raises(IndexError):
        space.view(a.ctypes.data + 8, 9)
    with pytest.raises(IndexError):
        run_chunk_table(np.array([[a.ctypes.data, a.ctypes.data + 20, 4]], np.uint64), space)


# -- row plans (paddle's gather/index_put) --------------------------------------------------------

INTERLEAVED = [Placement("k.0", 0, 0, 128, 64, 0), Placement("v.0", 0, 64, 128, 64, 64)]


def test_row_plan_worked_example():
    plan = row_plan(INTERLEAVED, [512], [4096], record_bytes=128)
    assert plan.unit == 8 and plan.dtype == "int64" and plan.record_units == 16
    assert plan.views == (RowView(0, start=0, row_bytes=64, rows=8),)
    assert plan.regions == (RegionRows("k.0", 0, first=0, step=2, per_block=1, column=0, width=8),
                            RegionRows("v.0", 0, first=1, step=2, per_block=1, column=8, width=8))
    assert [i.tolist() for i in plan.indices([3, 0])] == [[6, 0], [7, 1]]


def test_row_plan_contiguous_tensor_is_one_row_per_block():
    plan = row_plan([Placement("k.0", 0, 256, 96, 96, 0)], [256 + 96 * 5], [1 << 20], record_bytes=96)
    assert plan.views == (RowView(0, start=256 % 96, row_bytes=96, rows=(256 + 96 * 5 - 64) // 96),)
    assert plan.regions[0].per_block == 1 and plan.regions[0].step == 1
    assert plan.indices([4, 0])[0].tolist() == [2 + 4, 2]


def test_row_plan_odd_stride_uses_smaller_rows():
    # block 24 bytes every 40: rows of gcd(24, 40) = 8 bytes, 3 per block, 5 per stride
    plan = row_plan([Placement("k.0", 0, 16, 40, 24, 0)], [400], [0], record_bytes=24)
    r = plan.regions[0]
    assert (plan.views[0].row_bytes, r.per_block, r.step, r.first) == (8, 3, 5, 2)
    assert plan.indices([1, 0])[0].tolist() == [7, 8, 9, 2, 3, 4]


@pytest.mark.parametrize("base, offset, expected", [(4096, 0, 8), (4096, 4, 4), (4098, 0, 2), (4097, 0, 1)])
def test_row_plan_unit_is_the_widest_that_divides_every_address(base, offset, expected):
    plan = row_plan([Placement("k.0", 0, offset, 64, 64, 0)], [64 * 4 + offset], [base], record_bytes=64)
    assert plan.unit == expected


def test_row_twin_gathers_and_scatters_each_kind(engine: Engine):
    plan = row_plan(engine.placements, [b.size for b in engine.buffers], engine.bases, engine.record_bytes)
    before = engine.snapshot()
    assert gather_rows(plan, engine.buffers, GATHER).tobytes() == engine.records(GATHER)
    assert engine.snapshot() == before
    targets = [t for _, t in SCATTER]
    records = np.frombuffer(engine.records([s for s, _ in SCATTER]), np.uint8).reshape(len(SCATTER), -1).copy()
    scatter_rows(plan, engine.buffers, targets, records)
    assert engine.records(targets) == records.tobytes()


@settings(max_examples=80, deadline=None)
@given(s=scenarios(distinct=True))
def test_row_twin_matches_the_reference(s: Scenario):
    rng = np.random.default_rng(s.seed)
    contents = _region_contents(s, rng)
    buffers = _fill_engine(s, contents, fill=0x5A)
    record_bytes = s.layout.record_bytes
    plan = row_plan(s.placements, s.handle_sizes, [b.ctypes.data for b in buffers], record_bytes)
    assert gather_rows(plan, buffers, s.block_ids).tobytes() == _reference_records(s, contents)

    # scatter writes exactly the chunks, and nothing else
    records = rng.integers(1, 256, size=(len(s.block_ids), record_bytes), dtype=np.uint8)
    zeroed = [np.zeros(size, np.uint8) for size in s.handle_sizes]
    scatter_rows(plan, zeroed, s.block_ids, records)
    expected = [np.zeros(size, np.uint8) for size in s.handle_sizes]
    HostMover(expected).scatter(copy_plan(s.placements, s.block_ids, record_bytes), records.reshape(-1))
    assert [z.tobytes() for z in zeroed] == [e.tobytes() for e in expected]


# -- requests: batches, duplicates, slots ----------------------------------------------------------


def test_batches():
    assert batches(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert batches(0, 3) == []
    assert batches(3, 8) == [range(0, 3)]


def test_records_per_batch():
    assert records_per_batch(1000, 64 * 1000) == 64
    assert records_per_batch(10_000, 100) == 1  # always at least one record


def test_last_wins():
    assert last_wins([5, 3, 5], "abc") == ([3, 5], ["b", "c"])
    assert last_wins([], []) == ([], [])
    assert last_wins([1, 1, 1], [7, 8, 9]) == ([1], [9])


def test_slot_runs_worked_example():
    assert slot_runs([4096, 8192, 12288, 40960, 45056], 100) == [SlotRun(0, 3, 4096), SlotRun(3, 2, 4096)]


def test_slot_runs_breaks_on_overlap_reverse_and_huge_pitch():
    assert slot_runs([1000, 1050], 100) == [SlotRun(0, 1, 100), SlotRun(1, 1, 100)]   # overlap
    assert slot_runs([8192, 4096], 100) == [SlotRun(0, 1, 100), SlotRun(1, 1, 100)]   # backwards
    assert slot_runs([0, 2**32], 100) == [SlotRun(0, 1, 100), SlotRun(1, 1, 100)]     # pitch too large
    assert slot_runs([0, 100, 200], 100) == [SlotRun(0, 3, 100)]                       # packed
    assert slot_runs([], 100) == []


# -- validating cuda_ipc handles -----------------------------------------------------------------

GOOD = {"kind": "cuda_ipc", "ipc_handle": bytes(range(64)), "size": 1 << 20, "device": 0,
        "device_uuid": "GPU-0123abcd-0000-1111-2222-333344445555"}


def test_parse_cuda_handles_accepts_a_good_handle():
    (spec,) = parse_cuda_handles([GOOD])
    assert (spec.index, spec.ipc_handle, spec.size, spec.device) == (0, bytes(range(64)), 1 << 20, 0)
    assert spec.device_uuid == GOOD["device_uuid"]
    assert parse_cuda_handles([{**GOOD, "device_uuid": None}])[0].device_uuid is None


@pytest.mark.parametrize("change, field", [
    ({"kind": "shm"}, "handles[0].kind"),
    ({"ipc_handle": b"\x00" * 63}, "handles[0].ipc_handle"),
    ({"ipc_handle": "0" * 64}, "handles[0].ipc_handle"),
    ({"size": 0}, "handles[0].size"),
    ({"size": True}, "handles[0].size"),
    ({"size": None}, "handles[0].size"),
    ({"device": -1}, "handles[0].device"),
    ({"device_uuid": "GPU-nope"}, "handles[0].device_uuid"),
    ({"device_uuid": 17}, "handles[0].device_uuid"),
])
def test_parse_cuda_handles_names_the_bad_field(change, field):
    with pytest.raises(InvalidLayout) as err:
        parse_cuda_handles([{**GOOD, **change}])
    assert err.value.details["field"] == field


def test_parse_cuda_handles_refuses_two_gpus():
    other = {**GOOD, "device": 1, "device_uuid": "GPU-ffffffff-0000-1111-2222-333344445555"}
    with pytest.raises(InvalidLayout, match="more than one GPU"):
        parse_cuda_handles([GOOD, other])


def test_check_fits_names_the_region():
    p = [Placement("k.0", 0, 100, 64, 64, 0)]
    check_fits(p, [100 + 64 * 4], num_blocks=4)
    with pytest.raises(InvalidLayout) as err:
        check_fits(p, [100 + 64 * 4 - 1], num_blocks=4)
    assert err.value.details == {"region": "k.0", "need": 356, "have": 355}
