"""How long a restart takes to have its whole index, and what lookups cost meanwhile.

    python benchmarks/index_scan.py --records 1000000 --dir /var/tmp/kvswap-scan

Creates N small records (once; reruns reuse them) in the layout asked for (``--layout slab``,
the default, or ``files``), starts kvswapd on the directory, registers the matching layout,
and measures: time to the daemon answering, time to ``register`` answering (the slab layout
replays its journals there), time to a complete index (``kvswap_index_scan_complete`` and
every record indexed), lookup latency before and after, and the daemon's resident memory
before registering and with the whole index (their difference per record is what the index
costs a record).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request

from kvswap.backends.file_backend import FileBackend
from kvswap.daemon.tools.local_daemon import LocalDaemon
from kvswap.protocol import CacheLayout, Client, HostKVCache

LAYOUT = CacheLayout("scan-bench", num_layers=1, num_blocks=16, block_size=1, num_kv_heads=1, head_dim=64)


def populate(root: str, n: int, layout: str) -> None:
    store = FileBackend(root, layout=layout).open_store(LAYOUT.fingerprint(), LAYOUT.to_wire(), LAYOUT.record_bytes)
    payload = memoryview(bytes(LAYOUT.record_bytes))
    have = 0
    started = time.monotonic()
    for i in range(n):
        there = store.contains(f"scan-{i}") if layout == "slab" else os.path.exists(store.path_of(f"scan-{i}")[1])
        if there:
            have += 1
            continue
        store.put(f"scan-{i}", payload)
        if i and i % 50_000 == 0:
            rate = i / (time.monotonic() - started)
            print(f"  created {i:,} records ({rate:,.0f}/s)", file=sys.stderr)
    store.close()
    print(f"directory holds {n:,} records ({have:,} were there already)")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def metric(url: str, name: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


def empty_baseline(layout: str) -> tuple[float, float]:
    """(seconds to register, RSS MiB after) of a daemon on an empty directory: what register
    and the daemon cost without any index."""
    with tempfile.TemporaryDirectory() as empty:
        with LocalDaemon(empty, ["--file-layout", layout]) as daemon, HostKVCache.create(LAYOUT) as cache, \
                Client(daemon.endpoint, timeout=120) as c:
            assert daemon.proc is not None
            t = time.monotonic()
            c.register(cache)
            return time.monotonic() - t, rss_mib(daemon.proc.pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--dir", default="/var/tmp/kvswap-scan-bench")
    parser.add_argument("--layout", choices=["slab", "files"], default="slab")
    args = parser.parse_args()
    populate(args.dir, args.records, args.layout)
    rng = random.Random(0)
    t0 = time.monotonic()
    with LocalDaemon(args.dir, ["--file-layout", args.layout]) as daemon, HostKVCache.create(LAYOUT) as cache, \
            Client(daemon.endpoint, timeout=120) as c:
        assert daemon.proc is not None
        ready_s = time.monotonic() - t0
        rss_before = rss_mib(daemon.proc.pid)
        t1 = time.monotonic()
        c.register(cache)
        registered_s = time.monotonic() - t1
        during: list[float] = []
        hits = 0
        while (metric(daemon.metrics_url, "kvswap_index_scan_complete") != 1.0
               or c.stats()["tiers"]["file"]["records"] < args.records):
            key = f"scan-{rng.randrange(args.records)}"
            t = time.perf_counter()
            hits += c.lookup([key])
            during.append(time.perf_counter() - t)
        complete_s = time.monotonic() - t0
        after = []
        for _ in range(2000):
            t = time.perf_counter()
            c.lookup([f"scan-{rng.randrange(args.records)}"])
            after.append(time.perf_counter() - t)
        stats = c.stats()["tiers"]["file"]
        rss_after = rss_mib(daemon.proc.pid)
    empty_register_s, empty_rss = empty_baseline(args.layout)
    print(f"layout                   {args.layout}")
    print(f"records indexed          {stats['records']:,}")
    print(f"daemon answering after   {ready_s:.2f} s")
    print(f"register answered after  {registered_s:.2f} s (the slab layout replays its journals here; "
          f"{empty_register_s:.2f} s on an empty directory: staging set-up)")
    print(f"whole index after        {complete_s:.2f} s from the daemon's start")
    if during:
        q = statistics.quantiles(during, n=100) if len(during) > 1 else [during[0]] * 99
        print(f"lookups before complete  {len(during):,}, {hits:,} hits; p50 {q[49] * 1e3:.2f} ms, "
              f"p99 {q[98] * 1e3:.2f} ms")
    else:
        print("lookups before complete  none: the index was whole when register answered")
    q = statistics.quantiles(after, n=100)
    print(f"lookups after            p50 {q[49] * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms")
    print(f"daemon RSS               {rss_before:.0f} MiB before register, {rss_after:.0f} MiB with the index, "
          f"{empty_rss:.0f} MiB registered on an empty directory: "
          f"{(rss_after - empty_rss) * 2**20 / max(1, stats['records']):.0f} B per indexed record")


if __name__ == "__main__":
    main()
