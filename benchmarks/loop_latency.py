"""Does the control loop wait behind bytes? ping and 1,000-key lookup latency while a
swap_out stream runs, for several daemon configurations in one run (each one's idle latency
is measured first, as its baseline), optionally with a py-spy profile of the daemon.

    python benchmarks/loop_latency.py [--preset small] [--samples 400]
        [--variant NAME='--flag value ...'] [--py-spy DIR]

Without --variant it compares the default daemon only. A variant's flags go to kvswapd as
given (shlex-split); ``env:NAME=VALUE`` items set an environment variable for that daemon
instead. With --py-spy, each variant's daemon is recorded (all threads, GIL holders marked)
while the stream runs; ``py-spy top``-style totals are printed and the raw folded stacks
saved under DIR for flame graphs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter

from kvswap.daemon.tools.bench import SwapOutStream
from kvswap.daemon.tools.local_daemon import LocalDaemon
from kvswap.daemon.tools.presets import PRESETS, preset_layout
from kvswap.protocol import Client, HostKVCache


def quantiles(samples: list[float]) -> tuple[float, float, int]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49] * 1e3, q[98] * 1e3, len(samples)


def measure(endpoint: str, keys: list[str], samples: int) -> tuple[list[float], list[float]]:
    pings, lookups = [], []
    with Client(endpoint, timeout=60) as c:
        for _ in range(samples):
            t = time.perf_counter()
            c.ping()
            pings.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.lookup(keys)
            lookups.append(time.perf_counter() - t)
    return pings, lookups


def summarize_folded(path: str, top: int = 12) -> list[str]:
    """Self-time by frame and the share of samples holding the GIL, from py-spy's raw output
    (``--format raw``: one folded stack and its count per line)."""
    by_leaf: Counter[str] = Counter()
    by_thread: Counter[str] = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            n = int(count)
            total += n
            frames = stack.split(";")
            by_thread[frames[0]] += n
            by_leaf[frames[-1]] += n
    out = [f"  {total} samples"]
    out += [f"  thread {t}: {n / total:.0%}" for t, n in by_thread.most_common(8)]
    out += [f"  {n / total:6.1%}  {leaf}" for leaf, n in by_leaf.most_common(top)]
    return out


def run_variant(name: str, spec: str, layout_name: str, blocks: int, samples: int, storage: str,
                spy_dir: str | None) -> dict:
    args, env = [], {}
    for item in shlex.split(spec):
        if item.startswith("env:"):
            k, _, v = item[4:].partition("=")
            env[k] = v
        else:
            args.append(item)
    layout = preset_layout(layout_name, blocks)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        daemon = LocalDaemon(os.path.join(storage, name), ("--direct-io", "auto", *args)).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        with HostKVCache.create(layout) as cache, Client(daemon.endpoint, timeout=120) as c:
            cache.fill_random(3)
            c.register(cache)
            keys = [f"k-{i}" for i in range(blocks)]
            for s in range(0, blocks, 32):
                c.swap_out(list(range(s, min(s + 32, blocks))), keys[s:s + 32], wait="persisted")
            lookup_keys = (keys * (1000 // blocks + 1))[:1000]
            idle = measure(daemon.endpoint, lookup_keys, samples // 2)
            # The same load as `kvswap bench`'s latency phase: 32-block swap_outs, "copied".
            stream = SwapOutStream(daemon.endpoint, [list(range(s, min(s + 32, blocks))) for s in range(0, blocks, 32)],
                                   "s").start()
            spy = None
            if spy_dir:
                raw = os.path.join(spy_dir, f"{name}.folded")
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(daemon.proc.pid), "--threads", "--gil",
                                        "--rate", "200", "--format", "raw", "--output", raw, "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            t0 = time.perf_counter()
            try:
                loaded = measure(daemon.endpoint, lookup_keys, samples)
            finally:
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(30)
                stream.stop()
            elapsed = time.perf_counter() - t0
            c.flush()
            c.clear()
    finally:
        daemon.stop()
    return {"name": name, "idle": idle, "loaded": loaded,
            "stream_gbps": stream.blocks * layout.record_bytes / elapsed / 1e9,
            "spy": os.path.join(spy_dir, f"{name}.folded") if spy_dir else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--storage-dir", default=".")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS")
    parser.add_argument("--py-spy", dest="spy_dir", default=None, metavar="DIR")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, interleaved (a shared machine's load drifts); "
                             "each round is printed, then the median p99 per variant")
    args = parser.parse_args()
    if args.spy_dir:
        if shutil.which("py-spy") is None:
            parser.error("--py-spy needs py-spy on PATH: pip install py-spy")
        os.makedirs(args.spy_dir, exist_ok=True)
    variants = [v.partition("=")[::2] for v in args.variant] or [("default", "")]
    if args.samples < 100:
        print(f"warning: {args.samples} samples are too few for a p99 (the p99 is one of the worst few)")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvswap-loop-", dir=args.storage_dir) as d:
        for _ in range(args.rounds):
            for name, spec in variants:
                results.append(run_variant(name, spec, args.preset, args.blocks, args.samples, d, args.spy_dir))
    print(f"preset {args.preset}, {os.cpu_count()} CPUs; ms; idle = same daemon before the stream")
    print(f"{'variant':14}{'ping p50':>10}{'p99':>8}{'idle p99':>10}{'lookup p50':>12}{'p99':>8}"
          f"{'idle p99':>10}{'stream GB/s':>13}{'n':>6}")
    for r in results:
        ip, il = quantiles(r["idle"][0]), quantiles(r["idle"][1])
        lp, ll = quantiles(r["loaded"][0]), quantiles(r["loaded"][1])
        print(f"{r['name']:14}{lp[0]:10.2f}{lp[1]:8.2f}{ip[1]:10.2f}{ll[0]:12.2f}{ll[1]:8.2f}{il[1]:10.2f}"
              f"{r['stream_gbps']:13.2f}{lp[2]:6d}")
    if args.rounds > 1:
        print("median over rounds (ms): variant, ping p99, idle ping p99, lookup p99, idle lookup p99, stream GB/s")
        for name, _ in variants:
            mine = [r for r in results if r["name"] == name]
            med = [statistics.median(quantiles(r[phase][which])[1] for r in mine)
                   for phase, which in (("loaded", 0), ("idle", 0), ("loaded", 1), ("idle", 1))]
            print(f"  {name:14}" + "".join(f"{v:8.2f}" for v in med)
                  + f"{statistics.median(r['stream_gbps'] for r in mine):8.2f}")
    for r in results:
        if r["spy"] and os.path.exists(r["spy"]):
            print(f"py-spy, {r['name']} (self time by frame, all threads):")
            print("\n".join(summarize_folded(r["spy"])))


if __name__ == "__main__":
    main()
