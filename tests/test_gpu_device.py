"""On a CUDA machine: the GPU movers over real device memory, byte for byte against the host
mover, and the whole device check (benchmarks/gpu_check.py --quick: a second process exports
its cache over CUDA IPC, a daemon attaches, blocks round-trip, the engine dies). Every test here
carries the ``gpu`` marker and skips where no CUDA device is present."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvswap.common.cuda_driver import CudaDriver, CudaError
from kvswap.daemon.movers.copy_plan import Placement
from kvswap.daemon.movers.kernels import ChunkKernels, CupyChunkRunner
from kvswap.daemon.movers.copiers import CudaCopier
from kvswap.daemon.movers.device import DeviceMover
from kvswap.daemon.staging import StagingPool
from kvswap.testing.reference_mover import HostMover
from test_gpu_plans import KINDS, kind_layout


def cuda_device_count() -> int:
    try:
        return CudaDriver.load().device_count()
    except CudaError:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device here")]
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy is not installed")
GATHER = [11, 0, 4, 4, 9, 2, 7]
TARGETS = [3, 5, 3, 10]  # 3 twice: the third record wins


@needs_cupy
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cupy_mover_on_device_memory_matches_the_host_mover(kind):
    import cupy

    from kvswap.daemon.movers.cuda import CudaDevice

    layout = kind_layout(kind)
    rng = np.random.default_rng(5)
    host = [rng.integers(0, 256, layout.num_blocks * r.block_bytes, dtype=np.uint8) for r in layout.regions]
    device_arrays = [cupy.asarray(h) for h in host]
    placements = [Placement(r.name, i, 0, r.block_bytes, r.block_bytes, r.record_offset)
                  for i, r in enumerate(layout.regions)]
    rb = layout.record_bytes
    device = CudaDevice(CudaDriver.load(), 0)
    device.activate()
    runner = CupyChunkRunner(cupy, device)
    kernels = ChunkKernels(runner, [a.data.ptr for a in device_arrays], placements, rb, batch_records=3)
    mover = DeviceMover(kernels, CudaCopier(device, runner.stream), placements, rb, 3,
                        synchronize=lambda: device.synchronize(runner.stream), activate=device.activate)
    pool = StagingPool(rb, 16 * 4096)
    try:
        slots = [pool._slots[i].view for i in [1, 2, 3, 7, 8, 0, 12]]
        reference = [np.zeros(rb, np.uint8) for _ in GATHER]
        assert HostMover(host, placements, rb).gather_blocks(GATHER, reference, lambda: True)
        assert mover.gather_blocks(GATHER, slots, lambda: True)
        assert [s.tobytes() for s in slots] == [r.tobytes() for r in reference]

        records = [rng.integers(0, 256, rb, dtype=np.uint8) for _ in TARGETS]
        assert HostMover(host, placements, rb).scatter_blocks(TARGETS, records, lambda: True)
        assert mover.scatter_blocks(TARGETS, records, lambda: True)
        assert [cupy.asnumpy(a).tobytes() for a in device_arrays] == [h.tobytes() for h in host]
    finally:
        mover.close()
        pool.close()
        device.release()


def test_device_check_script_passes_quick():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=600)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert summary["result"] == "pass"
    assert all(c["ok"] for c in summary["checks"]) and len(summary["checks"]) >= 2 * len(KINDS) + 1
