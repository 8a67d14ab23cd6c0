"""The shared-memory mover's copy paths, side by side on the same segment in one run.

    python benchmarks/segment_copy.py [--presets small,8b] [--mbytes 256] [--repeats 5] [--ping]

For each preset layout: gather (engine blocks -> staging records, 4 blocks a call, as the
daemon's swap_out does) and scatter (one record a call, as swap_in does) in GB/s through

- ``mapped memmove``: the old path, one ``ctypes.memmove`` per region chunk through a mapping
  (``HostMover``, now the tests' reference mover in ``kvswap/testing/reference_mover.py``; not crash-safe
  against a truncated segment);
- ``preadv``: the fallback, one ``preadv``/``pwritev`` per region chunk on the descriptor;
- ``native``: one fault-guarded ``copy_rows`` call per batch (``_fastcopy.c``);

against ``numpy memcpy``: one ``np.copyto`` of the same number of bytes, contiguous (the
ceiling). Each figure is the median of ``--repeats`` passes over the same blocks; the order of
the paths rotates between passes so a noisy neighbour hits all of them alike.

``--ping`` then runs ``kvswap bench``'s ping-under-a-swap_out-stream phase (a real daemon)
with the native path and with ``KVSWAP_NATIVE_COPY=0``, alternating, and prints the p50/p99
of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

from kvswap.daemon.movers.native import ENV_VAR, load_copy_rows
from kvswap.daemon.registration import Registration
from kvswap.daemon.tools.presets import preset_layout
from kvswap.protocol import HostKVCache
from kvswap.protocol.errors import KvswapError
from kvswap.testing.reference_mover import HostMover

GATHER_BATCH = 4  # the swapper's GATHER_CHUNK


def _time(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_lag(work: Callable[[], None], seconds: float = 2.0) -> tuple[float, float, int]:
    """p50/p99 lateness (ms) of a thread that sleeps 1 ms at a time while ``work`` runs in a loop
    on this one: how long a Python thread (the daemon's event loop) waits to run behind copies."""
    import threading

    stop = threading.Event()
    late: list[float] = []

    def tick() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            late.append((time.perf_counter() - t - 0.001) * 1e3)

    ticker = threading.Thread(target=tick)
    ticker.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()
    stop.set()
    ticker.join()
    q = statistics.quantiles(late, n=100)
    return q[49], q[98], len(late)


def copy_paths(preset: str, mbytes: int, repeats: int) -> None:
    probe = preset_layout(preset, 1)
    blocks = max(GATHER_BATCH, mbytes * 2**20 // probe.record_bytes)
    layout = preset_layout(preset, blocks)
    record = layout.record_bytes
    total = record * blocks
    print(f"\n{preset}: {blocks} blocks of {record / 2**20:.2f} MiB, {len(layout.regions)} regions "
          f"({total / 2**20:.0f} MiB per pass)")
    with HostKVCache.create(layout) as cache:
        cache.fill_random(1)
        body = cache.registration()
        engine = np.frombuffer(cache.segment.buffer, dtype=np.uint8)
        staging = np.ones(total, np.uint8)  # touched once: the timed copies pay no page faults
        slots = [staging[i * record:(i + 1) * record] for i in range(blocks)]
        ids = list(range(blocks))
        movers: dict = {}
        registrations = {}
        for name, native in (("preadv", False), ("native", True)):
            if native and load_copy_rows(True) is None:
                print("  native: not built here, skipped")
                continue
            os.environ[ENV_VAR] = "1" if native else "0"
            registrations[name] = Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])
            movers[name] = registrations[name].mover
        movers["mapped memmove"] = HostMover([engine], registrations["preadv"].placements, record)
        def live() -> bool:
            return True

        def gather(m) -> None:
            for s in range(0, blocks, GATHER_BATCH):
                m.gather_blocks(ids[s:s + GATHER_BATCH], slots[s:s + GATHER_BATCH], live)

        def scatter(m) -> None:
            for b in ids:
                m.scatter_blocks([b], [slots[b]], live)

        def memcpy_out() -> None:
            np.copyto(staging, engine[:total])

        def memcpy_in() -> None:
            np.copyto(engine[:total], staging)

        # Correctness first: every path gathers the same bytes.
        gather(movers["mapped memmove"])
        want = staging.tobytes()
        for name, m in movers.items():
            staging[:] = 0
            gather(m)
            assert staging.tobytes() == want, f"{name} gathered other bytes"

        results: dict[str, list[float]] = {}
        names = ["numpy memcpy", *movers]
        for rep in range(repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                if name == "numpy memcpy":
                    g, s = _time(memcpy_out), _time(memcpy_in)
                else:
                    g, s = _time(lambda: gather(movers[name])), _time(lambda: scatter(movers[name]))
                results.setdefault(name + " gather", []).append(total / g / 1e9)
                results.setdefault(name + " scatter", []).append(total / s / 1e9)
        lags = {name: loop_lag(lambda m=m: gather(m)) for name, m in movers.items()}
        lags["idle"] = loop_lag(lambda: time.sleep(0.05))
        for r in registrations.values():
            r.close()

    print(f"  {'path':<16}{'gather GB/s':>12}{'scatter GB/s':>13}{'vs memcpy':>11}{'vs memmove':>11}"
          f"{'vs preadv':>10}  (gather, scatter ratios)")
    med = {k: statistics.median(v) for k, v in results.items()}
    for name in names:
        g, s = med[name + " gather"], med[name + " scatter"]

        def ratio(base: str) -> str:
            if base + " gather" not in med:
                return "-"
            return f"{g / med[base + ' gather']:.2f},{s / med[base + ' scatter']:.2f}"

        print(f"  {name:<16}{g:>12.2f}{s:>13.2f}{ratio('numpy memcpy'):>11}{ratio('mapped memmove'):>11}"
              f"{ratio('preadv'):>10}")
    print("  lateness of a 1 ms timer thread while gathers loop on another thread (the GIL's share), ms:")
    for name, (p50, p99, n) in lags.items():
        print(f"    {name:<16} p50 {p50:6.3f}  p99 {p99:6.3f}  ({n} ticks)")


def ping_under_stream(preset: str, blocks: int, rounds: int, samples: int) -> None:
    """``kvswap bench`` (a real daemon) per copy path, alternating; its ping/lookup rows only."""
    from kvswap.daemon.tools.bench import run_bench

    print(f"\nping under a swap_out stream (kvswap bench, preset {preset}, {blocks} blocks, {samples} pings), "
          f"alternating paths, {rounds} rounds")
    rows: dict[str, dict[str, list[float]]] = {}
    for rnd in range(rounds):
        for path in (("native", "preadv") if rnd % 2 == 0 else ("preadv", "native")):
            os.environ[ENV_VAR] = "1" if path == "native" else "0"
            report = run_bench(preset=preset, blocks=blocks, idle_s=0.5, latency_samples=samples)
            for row in report.rows:
                if "under load" in row.name or row.name in ("blocks streamed meanwhile", "swap_out copied"):
                    rows.setdefault(path, {}).setdefault(row.name, []).append(row.value)
    names = list(next(iter(rows.values())))
    print(f"  {'metric':<28}{'native':>12}{'preadv':>12}{'native/preadv':>15}  (median of rounds)")
    for name in names:
        n, p = (statistics.median(rows[path][name]) for path in ("native", "preadv"))
        print(f"  {name:<28}{n:>12.3f}{p:>12.3f}{n / p if p else float('nan'):>15.2f}")


def ping_at_rate(preset: str, blocks: int, rate_mbs: float, seconds: float, rounds: int) -> None:
    """Ping latency of a real daemon while a swap_out stream runs at the SAME fixed byte rate on
    both paths (kvswap bench's stream is closed-loop: a faster copy path streams more bytes in
    its ping window, which is a different load)."""
    import tempfile
    import threading

    from kvswap.daemon.tools.local_daemon import LocalDaemon
    from kvswap.protocol import Client

    layout = preset_layout(preset, blocks)
    batch = 8
    per_s = rate_mbs * 2**20 / layout.record_bytes / batch  # swap_out calls a second
    print(f"\nping under a swap_out stream held at {rate_mbs:.0f} MiB/s ({per_s:.1f} calls of {batch} blocks a "
          f"second, preset {preset}), {seconds:.0f} s per path, alternating, {rounds} rounds")
    results: dict[str, dict[str, list[float]]] = {}
    for rnd in range(rounds):
        for path in (("native", "preadv") if rnd % 2 == 0 else ("preadv", "native")):
            os.environ[ENV_VAR] = "1" if path == "native" else "0"
            with tempfile.TemporaryDirectory(prefix="kvswap-segbench-", dir=os.getcwd()) as storage, \
                    LocalDaemon(storage, ("--direct-io", "auto")) as daemon, HostKVCache.create(layout) as cache, \
                    Client(daemon.endpoint, timeout=60) as c:
                cache.fill_random(rnd)
                c.register(cache)
                assert c.stats()["registration"]["mover"]["copy"] == path
                stop = threading.Event()
                sent = [0, 0]  # calls, busy answers

                def stream() -> None:
                    with Client(daemon.endpoint, timeout=60) as s:
                        start = time.perf_counter()
                        n = 0
                        while not stop.is_set():
                            ids = [(n * batch + i) % blocks for i in range(batch)]
                            try:
                                s.swap_out(ids, [f"{path}{rnd}-{n}-{i}" for i in ids], wait="copied")
                            except KvswapError:  # busy: the disk is behind; the rate is what we hold
                                sent[1] += 1
                            n += 1
                            sent[0] = n
                            delay = start + n / per_s - time.perf_counter()
                            if delay > 0:
                                time.sleep(delay)

                pid = daemon.proc.pid  # type: ignore[union-attr]
                cpu0 = _cpu_seconds(pid)
                streamer = threading.Thread(target=stream)
                streamer.start()
                pings = []
                end = time.perf_counter() + seconds
                time.sleep(0.2)
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    c.ping()
                    pings.append((time.perf_counter() - t) * 1e3)
                    time.sleep(0.002)
                stop.set()
                streamer.join()
                cpu = (_cpu_seconds(pid) - cpu0) / seconds * 100
                q = statistics.quantiles(pings, n=100)
                row = results.setdefault(path, {})
                row.setdefault("ping p50 ms", []).append(q[49])
                row.setdefault("ping p99 ms", []).append(q[98])
                row.setdefault("MiB/s streamed", []).append(sent[0] * batch * layout.record_bytes / 2**20 / seconds)
                row.setdefault("daemon CPU % core", []).append(cpu)
                row.setdefault("busy answers", []).append(sent[1])
                c.clear()
    print(f"  {'metric':<18}{'native':>10}{'preadv':>10}{'native/preadv':>15}  (median of rounds)")
    for name in results["native"]:
        n, p = (statistics.median(results[path][name]) for path in ("native", "preadv"))
        print(f"  {name:<18}{n:>10.3f}{p:>10.3f}{n / p if p else float('nan'):>15.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,8b")
    ap.add_argument("--mbytes", type=int, default=256, help="bytes per pass, MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ping", action="store_true", help="also run kvswap bench's ping phase per path")
    ap.add_argument("--ping-preset", default="small")
    ap.add_argument("--ping-blocks", type=int, default=256)
    ap.add_argument("--ping-rounds", type=int, default=2)
    ap.add_argument("--ping-samples", type=int, default=300)
    ap.add_argument("--rate", type=float, default=0, help="also ping under a stream held at this many MiB/s")
    ap.add_argument("--rate-seconds", type=float, default=8)
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f} (a shared machine moves these numbers)")
    for preset in args.presets.split(","):
        copy_paths(preset, args.mbytes, args.repeats)
    if args.ping:
        ping_under_stream(args.ping_preset, args.ping_blocks, args.ping_rounds, args.ping_samples)
    if args.rate:
        ping_at_rate(args.ping_preset, args.ping_blocks, args.rate, args.rate_seconds, args.ping_rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
