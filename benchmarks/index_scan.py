"""How long a restart takes to index a big directory, and whether lookups work meanwhile.

    python benchmarks/index_scan.py --records 1000000 --dir /var/tmp/kvswap-scan

Creates N small records (once; reruns reuse them), starts kvswapd on the directory, registers
the matching layout, and measures: time to the daemon answering, lookup latency while the
start-up scan runs (answered from the directory), and the scan's own duration (from the
daemon's ``kvswap_index_scan_seconds``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import urllib.request

from kvswap.backends.file_store import FileBackend
from kvswap.daemon.tools.local_daemon import LocalDaemon
from kvswap.protocol import CacheLayout, Client, HostKVCache

LAYOUT = CacheLayout("scan-bench", num_layers=1, num_blocks=16, block_size=1, num_kv_heads=1, head_dim=64)


def populate(root: str, n: int) -> None:
    store = FileBackend(root).open_store(LAYOUT.fingerprint(), LAYOUT.to_wire(), LAYOUT.record_bytes)
    payload = memoryview(bytes(LAYOUT.record_bytes))
    have = 0
    started = time.monotonic()
    for i in range(n):
        if os.path.exists(store.path_of(f"scan-{i}")[1]):
            have += 1
            continue
        store.put(f"scan-{i}", payload)
        if i and i % 50_000 == 0:
            rate = i / (time.monotonic() - started)
            print(f"  created {i:,} records ({rate:,.0f}/s)", file=sys.stderr)
    print(f"directory holds {n:,} records ({have:,} were there already)")


def metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--dir", default="/var/tmp/kvswap-scan-bench")
    args = parser.parse_args()
    populate(args.dir, args.records)
    rng = random.Random(0)
    t0 = time.monotonic()
    with LocalDaemon(args.dir) as daemon, HostKVCache.create(LAYOUT) as cache, \
            Client(daemon.endpoint, timeout=30) as c:
        ready_s = time.monotonic() - t0
        c.register(cache)
        during: list[float] = []
        hits = 0
        while metric(daemon.metrics_url, "kvswap_index_scan_complete") != 1.0:
            key = f"scan-{rng.randrange(args.records)}"
            t = time.perf_counter()
            hits += c.lookup([key])
            during.append(time.perf_counter() - t)
        scan_s = metric(daemon.metrics_url, "kvswap_index_scan_seconds")
        after = []
        for _ in range(2000):
            t = time.perf_counter()
            c.lookup([f"scan-{rng.randrange(args.records)}"])
            after.append(time.perf_counter() - t)
        stats = c.stats()["tiers"]["file"]
    print(f"records indexed          {stats['records']:,}")
    print(f"daemon answering after   {ready_s:.2f} s (the scan does not hold up readiness)")
    print(f"start-up scan            {scan_s:.1f} s ({stats['records'] / scan_s:,.0f} records/s)")
    if during:
        q = statistics.quantiles(during, n=100)
        print(f"lookups during the scan  {len(during):,}, {hits:,} hits; p50 {q[49] * 1e3:.2f} ms, "
              f"p99 {q[98] * 1e3:.2f} ms")
    q = statistics.quantiles(after, n=100)
    print(f"lookups after the scan   p50 {q[49] * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
