"""The paddle mover's kernels (kvswap.daemon.movers.PaddleKernels) on CPU paddle: the same
DLPack views, row plans, gather/concat and split/index_put ops the GPU path runs, over host
memory, compared byte for byte with each block's reference record and with the host mover.
Skipped where paddle is not installed."""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import numpy as np
import pytest
from hypothesis import given, settings

paddle = pytest.importorskip("paddle")

from kvswap.daemon.movers.copy_plan import Placement, copy_plan  # noqa: E402
from kvswap.daemon.movers.device import DeviceMover
from kvswap.daemon.movers.kernels import DLPackView, PaddleKernels, host_upload
from kvswap.daemon.movers.copiers import HostCopier# noqa: E402
from kvswap.daemon.staging import StagingPool  # noqa: E402
from kvswap.testing.reference_mover import HostMover  # noqa: E402
from test_copy_plan import Scenario, _fill_engine, _reference_records, _region_contents, scenarios  # noqa: E402
from test_gpu_plans import GATHER, KINDS, SCATTER, Engine  # noqa: E402


@pytest.fixture(autouse=True)
def on_cpu() -> Iterator[None]:
    previous = paddle.get_device()
    paddle.set_device("cpu")
    yield
    paddle.set_device(previous)


@pytest.fixture(params=sorted(KINDS))
def engine(request) -> Iterator[Engine]:
    e = Engine(request.param)
    yield e
    e.close()


def paddle_mover(buffers, placements, record_bytes, batch_records=4) -> DeviceMover:
    kernels = PaddleKernels(paddle, [b.ctypes.data for b in buffers], [b.nbytes for b in buffers], placements,
                            record_bytes, host_upload)
    return DeviceMover(kernels, HostCopier(), placements, record_bytes, batch_records)


# -- DLPack views: shared memory, not copies ------------------------------------------------


@pytest.mark.parametrize("unit, dtype", [(8, "int64"), (4, "int32"), (2, "int16"), (1, "uint8")])
def test_dlpack_view_shares_memory_both_ways(unit, dtype):
    buf = np.arange(256, dtype=np.uint8)
    view = DLPackView(buf.ctypes.data + 32, rows=4, cols=32 // unit, unit=unit, on_gpu=False, device_id=0)
    t = paddle.utils.dlpack.from_dlpack(view.capsule())
    assert t.shape == [4, 32 // unit] and str(t.dtype).endswith(dtype)
    assert t.data_ptr() == buf.ctypes.data + 32
    assert t.numpy().view(np.uint8).reshape(-1).tobytes() == bytes(range(32, 160))
    row = paddle.full([1, 32 // unit], -1, dtype=dtype)
    t.index_put_((paddle.to_tensor([2], dtype="int64"),), row)
    assert buf[32 + 64: 32 + 96].tobytes() == b"\xff" * 32      # written through
    assert buf[:32 + 64].tobytes() == bytes(range(96))          # and nothing else
    assert buf[32 + 96:].tobytes() == bytes(range(128, 256))


# -- the mover on CPU paddle, per layout kind --------------------------------------------------


def test_paddle_mover_gathers_each_kind(engine: Engine):
    mover = paddle_mover(engine.buffers, engine.placements, engine.record_bytes, batch_records=4)
    pool = StagingPool(engine.record_bytes, 16 * 4096)
    slots = [pool._slots[i].view for i in [0, 1, 2, 8, 9, 4]]
    before = engine.snapshot()
    assert mover.gather_blocks(GATHER, slots, lambda: True)
    assert b"".join(s.tobytes() for s in slots) == engine.records(GATHER)
    assert engine.snapshot() == before
    mover.close()
    pool.close()


def test_paddle_mover_scatters_each_kind_like_the_host_mover(engine: Engine):
    twin = Engine(engine.kind)
    try:
        targets = [t for _, t in SCATTER] + [SCATTER[0][1]]  # the first target again: last wins
        sources = [s for s, _ in SCATTER] + [9]
        slots = [np.frombuffer(engine.cache.block_record(s), np.uint8).copy() for s in sources]
        mover = paddle_mover(twin.buffers, twin.placements, twin.record_bytes, batch_records=2)
        assert mover.scatter_blocks(targets, slots, lambda: True)
        assert engine.registration.mover.scatter_blocks(targets, slots, lambda: True)
        assert twin.snapshot() == engine.snapshot()
        assert twin.cache.block_record(SCATTER[0][1]) == slots[-1].tobytes()
        mover.close()
    finally:
        twin.close()


def test_paddle_mover_interleaved_and_odd_strided_layouts():
    """k and v of a block side by side (vLLM-style), and a region whose stride is not a
    multiple of its block: rows of gcd(block, stride) bytes, several per block."""
    placements = [Placement("k.0", 0, 0, 128, 64, 0), Placement("v.0", 0, 64, 128, 64, 64),
                  Placement("ks.0", 1, 4, 40, 24, 128)]
    rng = np.random.default_rng(3)
    buffers = [rng.integers(0, 256, 128 * 6, dtype=np.uint8), rng.integers(0, 256, 4 + 40 * 6, dtype=np.uint8)]
    record_bytes = 152
    reference = np.zeros(3 * record_bytes, np.uint8)
    HostMover(buffers).gather(copy_plan(placements, [5, 0, 3], record_bytes), reference)
    mover = paddle_mover(buffers, placements, record_bytes)
    assert mover.kernels.plan.unit == 4 and len(mover.kernels.plan.views) == 2
    slots = [np.zeros(record_bytes, np.uint8) for _ in range(3)]
    assert mover.gather_blocks([5, 0, 3], slots, lambda: True)
    assert b"".join(s.tobytes() for s in slots) == reference.tobytes()

    expected = [b.copy() for b in buffers]
    HostMover(expected).scatter(copy_plan(placements, [1, 4], record_bytes), np.concatenate(slots[:2]))
    assert mover.scatter_blocks([1, 4], slots[:2], lambda: True)
    assert [b.tobytes() for b in buffers] == [e.tobytes() for e in expected]
    mover.close()


@settings(max_examples=25, deadline=None)
@given(s=scenarios(distinct=True))
def test_paddle_mover_matches_the_reference(s: Scenario):
    rng = np.random.default_rng(s.seed)
    contents = _region_contents(s, rng)
    buffers = _fill_engine(s, contents, fill=0x5A)
    record_bytes = s.layout.record_bytes
    mover = paddle_mover(buffers, s.placements, record_bytes, batch_records=3)
    slots = [np.zeros(record_bytes, np.uint8) for _ in s.block_ids]
    assert mover.gather_blocks(s.block_ids, slots, lambda: True)
    assert b"".join(x.tobytes() for x in slots) == _reference_records(s, contents)

    records = [rng.integers(0, 256, record_bytes, dtype=np.uint8) for _ in s.block_ids]
    expected = [b.copy() for b in buffers]
    if records:
        HostMover(expected).scatter(copy_plan(s.placements, s.block_ids, record_bytes), np.concatenate(records))
    assert mover.scatter_blocks(s.block_ids, records, lambda: True)
    assert [b.tobytes() for b in buffers] == [e.tobytes() for e in expected]
    mover.close()


def test_close_drops_every_view(engine: Engine):
    mover = paddle_mover(engine.buffers, engine.placements, engine.record_bytes)
    assert mover.kernels.views
    mover.close()
    assert mover.kernels.views == [] and mover.kernels._hold == []


# -- signals: the daemon's SIGTERM drain survives loading paddle ------------------------------

SIGNAL_PROBE = """
import os, signal, sys, time
hit = []
signal.signal(signal.SIGTERM, lambda *a: hit.append(1))
if sys.argv[1] == "kvswap":
    from kvswap.daemon.movers.cuda_attach import import_paddle
    paddle = import_paddle()
else:
    import paddle
paddle.to_tensor([1, 2]) * 2
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("handled" if hit else "missed", flush=True)
"""


@pytest.mark.parametrize("how, survives", [("plain", False), ("kvswap", True)])
def test_loading_paddle_keeps_the_daemons_sigterm_handler(how, survives):
    """A plain ``import paddle`` replaces the process's SIGTERM handler with paddle's, which
    aborts; the daemon loads paddle through import_paddle, which puts its handlers back."""
    out = subprocess.run([sys.executable, "-c", SIGNAL_PROBE, how], capture_output=True, text=True, timeout=120)
    if survives:
        assert out.returncode == 0 and out.stdout.strip() == "handled", out.stderr[-2000:]
    else:
        assert out.returncode != 0 and "handled" not in out.stdout
