"""Every mover the daemon builds is a kvswap.daemon.movers.base.Mover (the swapper calls
nothing else), and the shared-memory mover moves the same bytes as the reference host mover."""

from __future__ import annotations

import numpy as np
import pytest
from copy_paths import copy_path  # noqa: F401 (a fixture)
from kvswap.testing.reference_mover import HostMover
from test_gpu_movers import twin_mover
from test_gpu_plans import GATHER, KINDS, Engine

from kvswap.daemon.movers.base import Mover
from kvswap.daemon.movers.segment import SegmentMover
from kvswap.protocol.errors import NotRegistered


@pytest.fixture(params=sorted(KINDS))
def engine(request, copy_path: str):  # noqa: F811
    e = Engine(request.param)  # its registration's SegmentMover takes the copy path from the env
    yield e
    e.close()


def test_every_mover_is_a_mover(engine: Engine) -> None:
    host = HostMover(engine.buffers, engine.placements, engine.record_bytes)
    device = twin_mover(engine)
    segment = engine.registration.mover
    assert isinstance(segment, SegmentMover)
    for mover, kind, batches in ((host, "host", False), (segment, "host", False), (device, "cuda", True)):
        assert isinstance(mover, Mover)
        assert mover.batches_scatter is batches
        assert mover.describe()["mover"] == kind
    assert host.pin_host(np.zeros(4096, np.uint8)) is False
    assert segment.pin_host(np.zeros(4096, np.uint8)) is False
    assert "framework" in device.describe() and "backend" not in device.describe()
    device.close()


def test_segment_mover_moves_what_the_host_mover_moves(engine: Engine, copy_path: str) -> None:  # noqa: F811
    host = HostMover(engine.buffers, engine.placements, engine.record_bytes)
    segment = engine.registration.mover
    assert segment.describe()["copy"] == copy_path
    want = [np.zeros(engine.record_bytes, np.uint8) for _ in GATHER]
    got = [np.full(engine.record_bytes, 0xEE, np.uint8) for _ in GATHER]
    assert host.gather_blocks(GATHER, want, lambda: True)
    assert segment.gather_blocks(GATHER, got, lambda: True)
    assert [g.tobytes() for g in got] == [w.tobytes() for w in want] == [engine.cache.block_record(b) for b in GATHER]
    # Scatter: records of blocks 9 and 0 into blocks 1 and 2, through the descriptor.
    assert segment.scatter_blocks([1, 2], got[:2], lambda: True)
    assert engine.cache.block_record(1) == engine.cache.block_record(9)
    assert engine.cache.block_record(2) == engine.cache.block_record(0)
    # live() is asked before each block: nothing moves once it is false.
    before = engine.snapshot()
    assert segment.scatter_blocks([3], got[:1], lambda: False) is False
    assert engine.snapshot() == before
    # A bad block id or slot is refused before a byte moves.
    with pytest.raises(IndexError):
        segment.scatter_blocks([engine.layout.num_blocks], got[:1], lambda: True)
    with pytest.raises(ValueError):
        segment.gather_blocks([0], [np.zeros(engine.record_bytes - 1, np.uint8)], lambda: True)
    assert engine.snapshot() == before
    segment.close()
    with pytest.raises(NotRegistered):  # closed: the descriptors are never used again
        segment.gather_blocks([0], got[:1], lambda: True)
