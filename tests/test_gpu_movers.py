"""The GPU mover (kvswap.daemon.movers.DeviceMover) run whole on the CPU: its chunk kernels
executed by the numpy runner (the CuPy kernel's twin) and its host copies by HostCopier, or by
the real CudaCopier over a host stand-in for the driver's copy and pinning calls. Checked byte
for byte against each block's reference record and against the host mover, for every layout
kind, with batching, duplicates, deadlines, failures and close."""

from __future__ import annotations

import mmap
from typing import Iterator

import numpy as np
import pytest

from kvswap.common.cuda_driver import CudaError
from kvswap.daemon.movers.kernels import ChunkKernels, NumpyChunkRunner
from kvswap.daemon.movers.copiers import CudaCopier, HostCopier, host_view
from kvswap.daemon.movers.device import DeviceMover
from kvswap.daemon.movers.gpu_plan import AddressSpace
from kvswap.daemon.staging import StagingPool
from kvswap.protocol import KvswapError
from test_gpu_plans import GATHER, KINDS, Engine

PAGE = 4096


def twin_mover(engine: Engine, batch_records: int = 4, copier=None, runner=None, on_close=()) -> DeviceMover:
    runner = runner or NumpyChunkRunner(engine.buffers)
    kernels = ChunkKernels(runner, engine.bases, engine.placements, engine.record_bytes, batch_records)
    return DeviceMover(kernels, copier or HostCopier(), engine.placements, engine.record_bytes, batch_records,
                       on_close=on_close)


@pytest.fixture(params=sorted(KINDS))
def engine(request) -> Iterator[Engine]:
    e = Engine(request.param)
    yield e
    e.close()


@pytest.fixture
def pool(engine: Engine) -> Iterator[StagingPool]:
    p = StagingPool(engine.record_bytes, 16 * PAGE)
    p.arena[:] = 0xEE
    yield p
    p.close()


def pool_slots(pool: StagingPool, order: list[int]) -> list[np.ndarray]:
    return [pool._slots[i].view for i in order]


# -- gather and scatter, per layout kind ----------------------------------------------------------


def test_gather_in_batches_into_scattered_slots(engine: Engine, pool: StagingPool):
    copier = HostCopier()
    mover = twin_mover(engine, batch_records=4, copier=copier)
    slots = pool_slots(pool, [5, 6, 7, 0, 1, 9])  # runs of 3, 2 and 1 slots
    before = engine.snapshot()
    assert mover.gather_blocks(GATHER, slots, lambda: True)
    assert b"".join(s.tobytes() for s in slots) == engine.records(GATHER)
    assert engine.snapshot() == before
    assert mover.kernels.runner.tables == [4 * len(engine.placements), 2 * len(engine.placements)]
    assert mover.kernels.runner.uploads == 1  # the whole call's table in one upload
    # batch one: slots 5,6,7 evenly spaced, then 0; batch two: slots 1 and 9, 8 slots apart
    assert copier.runs == [3, 1, 2]
    mover.close()


def test_scatter_into_other_blocks_last_record_wins(engine: Engine, pool: StagingPool):
    twin_engine = Engine(engine.kind)  # same bytes: one gets the host mover, one the GPU mover's twin
    try:
        sources, targets = [1, 4, 6, 8], [5, 2, 5, 11]  # block 5 twice: the record of block 6 must win
        slots = pool_slots(pool, [3, 4, 5, 12])
        for slot, b in zip(slots, sources):
            slot[:] = np.frombuffer(engine.cache.block_record(b), np.uint8)
        expected = engine.records(sources)
        mover = twin_mover(twin_engine, batch_records=2)
        assert mover.scatter_blocks(targets, slots, lambda: True)
        assert engine.registration.mover.scatter_blocks(targets, slots, lambda: True)
        assert twin_engine.snapshot() == engine.snapshot()
        rb = engine.record_bytes
        assert twin_engine.records([2, 5, 11]) == expected[rb:2 * rb] + expected[2 * rb:3 * rb] + expected[3 * rb:]
        mover.close()
    finally:
        twin_engine.close()


def test_gather_stops_between_batches_when_the_deadline_passes(engine: Engine, pool: StagingPool):
    mover = twin_mover(engine, batch_records=2)
    answers = iter([True, False])
    slots = pool_slots(pool, [0, 1, 2, 3])
    assert mover.gather_blocks([3, 4, 5, 6], slots, lambda: next(answers)) is False
    assert b"".join(s.tobytes() for s in slots[:2]) == engine.records([3, 4])
    assert all(s.tobytes() == b"\xee" * engine.record_bytes for s in slots[2:])
    mover.close()


def test_scatter_stops_between_batches_when_the_deadline_passes(engine: Engine, pool: StagingPool):
    mover = twin_mover(engine, batch_records=1)
    answers = iter([True, False])
    before = engine.records([0, 1])
    slots = pool_slots(pool, [0, 1])
    slots[0][:] = 1
    slots[1][:] = 2
    assert mover.scatter_blocks([0, 1], slots, lambda: next(answers)) is False
    assert engine.records([0]) == b"\x01" * engine.record_bytes
    assert engine.records([1]) == before[engine.record_bytes:]
    mover.close()


def test_no_blocks_is_a_no_op(engine: Engine):
    mover = twin_mover(engine)
    before = engine.snapshot()
    assert mover.gather_blocks([], [], lambda: True) and mover.scatter_blocks([], [], lambda: True)
    assert mover.kernels.runner.tables == [] and engine.snapshot() == before
    mover.close()


def test_bad_slots_are_refused_before_any_copy(engine: Engine):
    mover = twin_mover(engine)
    with pytest.raises(ValueError, match="2 block ids but 1 slots"):
        mover.gather_blocks([0, 1], [np.zeros(engine.record_bytes, np.uint8)], lambda: True)
    with pytest.raises(ValueError, match="contiguous buffer of at least"):
        mover.gather_blocks([0], [np.zeros(engine.record_bytes - 1, np.uint8)], lambda: True)
    assert mover.kernels.runner.tables == []
    mover.close()


# -- failures and close -------------------------------------------------------------------------


class FailingRunner(NumpyChunkRunner):
    def __init__(self, handles, fail_on: int) -> None:
        super().__init__(handles)
        self.fail_on = fail_on

    def run(self, table_address, first, rows):
        if len(self.tables) == self.fail_on:
            self.tables.append(-1)
            raise CudaError("cuLaunchKernel", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        super().run(table_address, first, rows)


def test_a_device_failure_is_a_typed_error_and_the_mover_stays_usable(engine: Engine, pool: StagingPool):
    mover = twin_mover(engine, batch_records=1, runner=FailingRunner(engine.buffers, fail_on=1))
    with pytest.raises(CudaError) as err:
        mover.gather_blocks([0, 1], pool_slots(pool, [0, 1]), lambda: True)
    assert err.value.code == "unavailable" and err.value.details["cuda_error"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    slot = pool_slots(pool, [2])
    assert mover.gather_blocks([7], slot, lambda: True)  # the lock was released
    assert slot[0].tobytes() == engine.records([7])
    mover.close()


def test_close_frees_staging_runs_every_step_once_and_refuses_later_calls(engine: Engine):
    closed = []
    runner = NumpyChunkRunner(engine.buffers)
    mover = twin_mover(engine, runner=runner, on_close=[lambda: closed.append("mappings"),
                                                        lambda: closed.append("device")])
    assert len(runner._buffers) == 1  # the device staging
    mover.close()
    mover.close()
    assert closed == ["mappings", "device"]
    assert runner._buffers == {}
    with pytest.raises(KvswapError, match="closed"):
        mover.gather_blocks([0], [np.zeros(engine.record_bytes, np.uint8)], lambda: True)


def test_close_keeps_going_when_a_step_fails(engine: Engine):
    closed = []

    def broken() -> None:
        raise CudaError("cuIpcCloseMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")

    mover = twin_mover(engine, on_close=[broken, lambda: closed.append("device")])
    mover.close()
    assert closed == ["device"]


# -- CudaCopier over a host stand-in for the driver ------------------------------------------


class HostDriverTwin:
    """The driver calls CudaCopier makes, on host memory: pitched copies through a bounds
    checked address space, and host registration with the driver's rules (page ranges,
    overlapping registrations refused, copies over partly registered memory refused)."""

    def __init__(self, arrays) -> None:
        self.arrays = arrays
        self.registered: dict[int, int] = {}
        self.copies: list[tuple[int, int]] = []  # (height, host pitch)
        self.fail_register = False

    def is_pinned(self, ptr: int) -> bool:
        return any(s <= ptr < s + n for s, n in self.registered.items())

    def host_register(self, ptr: int, nbytes: int) -> bool:
        assert ptr % PAGE == 0 and nbytes % PAGE == 0
        if self.fail_register:
            raise CudaError("cuMemHostRegister_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        if any(ptr < s + n and s < ptr + nbytes for s, n in self.registered.items()):
            return False
        self.registered[ptr] = nbytes
        return True

    def host_unregister(self, ptr: int) -> None:
        if self.registered.pop(ptr, None) is None:
            raise CudaError("cuMemHostUnregister", 713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")

    def _pinned_bytes(self, a: int, n: int) -> int:
        return sum(max(0, min(a + n, s + m) - max(a, s)) for s, m in self.registered.items())

    def copy_2d(self, dst, dst_pitch, dst_host, src, src_pitch, src_host, width, height, stream) -> None:
        host, pitch = (dst, dst_pitch) if dst_host else (src, src_pitch)
        self.copies.append((height, pitch))
        space = AddressSpace(self.arrays())  # device memory: bounds checked

        def view(address: int, is_host: bool) -> np.ndarray:
            return host_view(address, width) if is_host else space.view(address, width)

        for r in range(height):
            if self._pinned_bytes(host + r * pitch, width) not in (0, width):
                raise CudaError("cuMemcpy2DAsync_v2", 1, "CUDA_ERROR_INVALID_VALUE")
            view(dst + r * dst_pitch, dst_host)[:] = view(src + r * src_pitch, src_host)


def copier_mover(engine: Engine, extra, batch_records=8, two_d=True):
    runner = NumpyChunkRunner(engine.buffers)
    device = HostDriverTwin(lambda: [*runner._buffers.values(), *extra])
    copier = CudaCopier(device, stream=0, two_d=two_d)
    kernels = ChunkKernels(runner, engine.bases, engine.placements, engine.record_bytes, batch_records)
    return DeviceMover(kernels, copier, engine.placements, engine.record_bytes, batch_records), device


@pytest.mark.parametrize("kind", ["bf16", "fp8_scales"])
def test_cuda_copier_pins_the_arena_once_and_copies_runs_in_one_2d_copy(kind):
    engine = Engine(kind)
    pool = StagingPool(engine.record_bytes, 16 * PAGE)
    raw = pool.arena.base
    mover, device = copier_mover(engine, [raw])
    try:
        slots = pool_slots(pool, [2, 3, 4, 5])
        assert mover.gather_blocks([9, 1, 1, 6], slots, lambda: True)
        assert b"".join(s.tobytes() for s in slots) == engine.records([9, 1, 1, 6])
        assert device.copies == [(4, pool.slot_bytes)]
        ((start, length),) = device.registered.items()
        assert start % PAGE == 0 and start <= pool.arena.ctypes.data
        assert start + length >= pool.arena.ctypes.data + pool.arena.nbytes

        for slot in slots:
            slot[:] = 0x3C
        assert mover.scatter_blocks([0, 10], slots[1:3], lambda: True)
        assert engine.records([0, 10]) == b"\x3c" * 2 * engine.record_bytes
        assert device.copies[1] == (2, pool.slot_bytes) and len(device.registered) == 1

        assert mover.pin_host(pool.arena) is False  # already pinned: nothing to do
        mover.close()
        assert device.registered == {}
    finally:
        pool.close()
        engine.close()


def test_cuda_copier_one_copy_per_slot_when_2d_is_off():
    engine = Engine("bf16")
    pool = StagingPool(engine.record_bytes, 16 * PAGE)
    mover, device = copier_mover(engine, [pool.arena.base], two_d=False)
    try:
        slots = pool_slots(pool, [0, 1, 2])
        assert mover.gather_blocks([4, 5, 6], slots, lambda: True)
        assert b"".join(s.tobytes() for s in slots) == engine.records([4, 5, 6])
        assert device.copies == [(1, engine.record_bytes)] * 3
    finally:
        mover.close()
        pool.close()
        engine.close()


def test_cuda_copier_bounces_a_slot_that_straddles_pinned_memory():
    """Slots of a plain buffer (not an arena): the whole pages inside it are pinned, and a slot
    that crosses the pinned edge goes through a bounce buffer, since the driver refuses it."""
    engine = Engine("bf16")
    rb = engine.record_bytes
    region = mmap.mmap(-1, 3 * PAGE + 100)  # page aligned: whole pages are [0, 3 * PAGE)
    owner = np.frombuffer(region, np.uint8)
    owner[:] = 0xEE
    cut = 3 * PAGE - (rb - 50)              # a slot from here crosses the pinned edge
    # pinned, straddling, pinned: the two pinned slots are evenly spaced but their records are
    # not neighbours in device staging, so they must not share one 2D copy
    slots = [owner[:rb], owner[cut:cut + rb], owner[2 * rb:3 * rb]]
    mover, device = copier_mover(engine, [owner])
    try:
        assert mover.gather_blocks([3, 8, 5], slots, lambda: True)
        assert device.registered == {owner.ctypes.data: 3 * PAGE}
        assert b"".join(s.tobytes() for s in slots) == engine.records([3, 8, 5])
        slots[1][:] = 0x11
        assert mover.scatter_blocks([2], slots[1:2], lambda: True)
        assert engine.records([2]) == b"\x11" * rb
    finally:
        mover.close()
        engine.close()
    assert device.registered == {}


def test_cuda_copier_without_pinning_still_copies():
    """Memory someone else registered (712) or that cannot be pinned is copied as it is."""
    engine = Engine("mla")
    pool = StagingPool(engine.record_bytes, 16 * PAGE)
    mover, device = copier_mover(engine, [pool.arena.base])
    try:
        device.registered[pool.arena.ctypes.data] = pool.arena.nbytes  # pinned by another owner
        slots = pool_slots(pool, [0, 1])
        assert mover.gather_blocks([1, 2], slots, lambda: True)
        assert b"".join(s.tobytes() for s in slots) == engine.records([1, 2])
        mover.close()
        assert device.registered == {pool.arena.ctypes.data: pool.arena.nbytes}  # not ours to unpin
    finally:
        pool.close()
        engine.close()


def test_cuda_copier_pin_failure_is_a_typed_error():
    engine = Engine("fp16")
    pool = StagingPool(engine.record_bytes, 16 * PAGE)
    mover, device = copier_mover(engine, [pool.arena.base])
    device.fail_register = True
    try:
        with pytest.raises(CudaError) as err:
            mover.gather_blocks([1], pool_slots(pool, [0]), lambda: True)
        assert err.value.details["cuda_error"] == "CUDA_ERROR_OUT_OF_MEMORY"
        assert device.copies == []
    finally:
        mover.close()
        pool.close()
        engine.close()
