"""Aggregate throughput vs number of concurrent engine clients.

    python benchmarks/concurrency_sweep.py [--preset small] [--blocks-per-client 64] [--clients 1,2,4,8,16]

Each client owns a slice of the engine's blocks and, in parallel with the others, swaps its
blocks out (persisted) under fresh keys and back in. Prints GB/s per client count next to a
raw O_DIRECT write/read of the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from kvswap.daemon.tools.bench import raw_sequential_gbps
from kvswap.daemon.tools.local_daemon import LocalDaemon
from kvswap.daemon.tools.presets import PRESETS, preset_layout
from kvswap.protocol import Busy, Client, HostKVCache


def run(preset: str, per_client: int, counts: list[int], storage_dir: str) -> None:
    layout = preset_layout(preset, per_client * max(counts))
    raw_w, raw_r, direct = raw_sequential_gbps(storage_dir, layout.record_bytes * per_client * max(counts))
    print(f"{preset}: {layout.record_bytes / 2**20:.2f} MiB records, {per_client} blocks per client")
    print(f"baseline raw {'O_DIRECT' if direct else 'buffered'}: write {raw_w:.2f} GB/s, read {raw_r:.2f} GB/s\n")
    print(f"{'clients':>8}{'swap_out GB/s':>15}{'vs raw':>8}{'swap_in GB/s':>14}{'vs raw':>8}")
    with LocalDaemon(storage_dir, ("--direct-io", "auto")) as daemon, HostKVCache.create(layout) as cache:
        cache.fill_random(1)
        with Client(daemon.endpoint) as c:
            c.register(cache)
        for n in counts:
            tag = os.urandom(3).hex()
            barrier = threading.Barrier(n + 1)
            times: dict[str, float] = {}

            def worker(w: int) -> None:
                blocks = list(range(w * per_client, (w + 1) * per_client))
                keys = [f"{tag}-{w}-{b}" for b in blocks]
                with Client(daemon.endpoint, timeout=300) as c:
                    barrier.wait()
                    for s in range(0, per_client, 32):
                        while True:
                            try:
                                c.swap_out(blocks[s:s + 32], keys[s:s + 32], wait="persisted")
                                break
                            except Busy:
                                time.sleep(0.002)
                    barrier.wait()
                    barrier.wait()
                    for s in range(0, per_client, 32):
                        r = c.swap_in(keys[s:s + 32], blocks[s:s + 32])
                        assert r.loaded == len(keys[s:s + 32]), r.status
                    barrier.wait()

            threads = [threading.Thread(target=worker, args=(w,)) for w in range(n)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            barrier.wait()
            times["out"] = time.perf_counter() - t0
            os.sync()
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("1\n")
            except OSError:
                pass
            barrier.wait()
            t0 = time.perf_counter()
            barrier.wait()
            times["in"] = time.perf_counter() - t0
            for t in threads:
                t.join()
            nbytes = n * per_client * layout.record_bytes
            out, inn = nbytes / times["out"] / 1e9, nbytes / times["in"] / 1e9
            print(f"{n:8d}{out:15.2f}{out / raw_w:7.2f}x{inn:14.2f}{inn / raw_r:7.2f}x")
            with Client(daemon.endpoint) as c:
                c.clear()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--blocks-per-client", type=int, default=64)
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--storage-dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvswap-sweep-", dir=args.storage_dir or ".") as d:
        run(args.preset, args.blocks_per_client, [int(x) for x in args.clients.split(",")], d)
