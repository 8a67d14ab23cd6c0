"""LMCache's local disk backend under the workload of ``peers.py``; run by peers.py with the
Python of a separate environment that has LMCache (``pip install lmcache`` pulls torch and
CUDA libraries; kept apart so it cannot disturb kvswap's environment).

    /work/venv-lmcache/bin/python benchmarks/peers_lmcache.py DIR BLOCKS BLOCK_BYTES

Prints one JSON object: write, cold read and hot read seconds, or ``{"error": ...}``.

What is timed, to match the other two columns of peers.py:

- before any timing, the allocator's buffer is touched (faulted in), as peers.py warms the
  kvswap daemon's pool;
- write: copy each engine block into a buffer from LMCache's own CPU allocator (its GPU
  connector's job), submit all puts, wait until every put's completion callback has run
  (the record is on disk and indexed). LMCache does not fsync.
- cold read: the backend's files dropped from the page cache (``posix_fadvise(DONTNEED)``
  per file, not the whole machine), then ``batched_get_blocking`` of every key and a copy of
  each returned buffer into its engine block.
- hot read: the same again at once (the files are now in the page cache).

The backend runs in its default I/O mode (buffered: ``use_odirect`` off), with LMCache's
default number of disk threads, on CPU (torch reports no CUDA device here; LMCache's CPU
platform stub is used).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time


def drop_files(directory: str) -> int:
    dropped = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
    return dropped


def main() -> dict:
    directory, blocks, block_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        import numpy as np
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    except Exception as exc:  # reported as the column's reason, not a traceback
        return {"error": f"cannot import LMCache: {type(exc).__name__}: {exc}"}
    total = blocks * block_bytes
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=(total * 2.2) / 2**30, local_disk=directory + "/",
        max_local_disk_size=(total * 1.5) / 2**30)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    allocator = MixedMemoryAllocator(int(total * 2.2))
    allocator.buffer.fill_(0)  # faulted in before the clock starts, like kvswap's warmed pool
    cpu = LocalCPUBackend(config, memory_allocator=allocator)
    disk = LocalDiskBackend(config, loop, cpu)
    engine = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    shape, dtype = torch.Size([block_bytes // 2]), torch.bfloat16
    keys = [CacheEngineKey("peers-2mib", 1, 0, i, dtype) for i in range(blocks)]

    t0 = time.perf_counter()
    objs = []
    for i in range(blocks):
        obj = cpu.allocate(shape, dtype, MemoryFormat.KV_2LTD)
        obj.tensor.view(torch.uint8).numpy()[:] = engine[i * block_bytes:(i + 1) * block_bytes]
        objs.append(obj)
    done = threading.Event()
    finished = [0]
    lock = threading.Lock()

    def on_done(_key: object) -> None:
        with lock:
            finished[0] += 1
            if finished[0] == blocks:
                done.set()

    disk.batched_submit_put_task(keys, objs, on_complete_callback=on_done)
    if not done.wait(600):
        return {"error": f"only {finished[0]} of {blocks} puts completed in 600 s"}
    write_s = time.perf_counter() - t0
    for obj in objs:
        obj.ref_count_down()

    out = np.zeros_like(engine)

    def read_all() -> float:
        t = time.perf_counter()
        got = disk.batched_get_blocking(keys)
        for i, obj in enumerate(got):
            if obj is None:
                raise RuntimeError(f"LMCache lost block {i}")
            out[i * block_bytes:(i + 1) * block_bytes] = obj.tensor.view(torch.uint8).numpy()
            obj.ref_count_down()
        return time.perf_counter() - t

    drop_files(directory)
    cold_s = read_all()
    hot_s = read_all()
    if not np.array_equal(out, engine):
        return {"error": "LMCache read back different bytes"}
    disk.close()
    loop.call_soon_threadsafe(loop.stop)
    return {"write_s": write_s, "cold_s": cold_s, "hot_s": hot_s, "mode": "buffered (use_odirect off), no fsync",
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


if __name__ == "__main__":
    result = main()
    print(json.dumps(result))
