"""Reads while writes stream: swap_in throughput and latency with and without a concurrent
swap_out stream (reads have their own pool and staging; this shows what they still share: the disk).

    python benchmarks/mixed_rw.py [--preset small] [--blocks 256] [--seconds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from kvswap.daemon.tools.local_daemon import LocalDaemon
from kvswap.daemon.tools.presets import PRESETS, preset_layout
from kvswap.protocol import Client, HostKVCache, KvswapError


def read_pass(endpoint: str, keys: list[str], blocks: list[int], seconds: float) -> tuple[float, list[float]]:
    lat: list[float] = []
    nbytes = 0
    deadline = time.monotonic() + seconds
    with Client(endpoint, timeout=120) as c:
        while time.monotonic() < deadline:
            for s in range(0, len(keys), 16):
                t = time.perf_counter()
                r = c.swap_in(keys[s:s + 16], blocks[s:s + 16])
                lat.append(time.perf_counter() - t)
                assert r.loaded == len(keys[s:s + 16]), r.status
                nbytes += r.loaded
    return nbytes, lat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--storage-dir", default=".")
    args = parser.parse_args()
    layout = preset_layout(args.preset, args.blocks * 2)
    half = args.blocks
    with tempfile.TemporaryDirectory(prefix="kvswap-mixed-", dir=args.storage_dir) as d, \
            LocalDaemon(d, ("--direct-io", "auto")) as daemon, HostKVCache.create(layout) as cache:
        cache.fill_random(4)
        keys = [f"r-{i}" for i in range(half)]
        read_blocks = list(range(half))
        with Client(daemon.endpoint, timeout=300) as c:
            c.register(cache)
            for s in range(0, half, 32):
                c.swap_out(read_blocks[s:s + 32], keys[s:s + 32], wait="persisted")
        alone_n, alone_lat = read_pass(daemon.endpoint, keys, read_blocks, args.seconds)

        stop = threading.Event()
        written = [0]

        def writer() -> None:
            write_blocks = list(range(half, 2 * half))
            n = 0
            with Client(daemon.endpoint, timeout=300) as c:
                while not stop.is_set():
                    ids = write_blocks[(n * 32) % half:(n * 32) % half + 32]
                    try:
                        c.swap_out(ids, [f"w-{n}-{i}" for i in ids], wait="persisted")
                        written[0] += len(ids)
                    except KvswapError:
                        time.sleep(0.002)
                    n += 1

        w = threading.Thread(target=writer)
        w.start()
        t0 = time.monotonic()
        mixed_n, mixed_lat = read_pass(daemon.endpoint, keys, read_blocks, args.seconds)
        stop.set()
        w.join()
        elapsed = time.monotonic() - t0
    rec = layout.record_bytes
    for name, n, lat in (("reads alone", alone_n, alone_lat), ("reads + write stream", mixed_n, mixed_lat)):
        q = statistics.quantiles(lat, n=100)
        print(f"{name:22} {n * rec / args.seconds / 1e9:6.2f} GB/s   swap_in(16) p50 {q[49] * 1e3:7.1f} ms"
              f"  p99 {q[98] * 1e3:7.1f} ms")
    print(f"{'write stream':22} {written[0] * rec / elapsed / 1e9:6.2f} GB/s meanwhile")


if __name__ == "__main__":
    main()
