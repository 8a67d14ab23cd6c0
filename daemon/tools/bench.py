"""``kvswap bench``: the daemon's throughput and latency next to baselines measured in the same
run on the same directory (raw O_DIRECT sequential I/O, memcpy of the same bytes).

Phases, in order: baselines; swap_out answered at "copied" (a stream, writes overlapping);
swap_out answered at "persisted"; swap_in hot (right after the write, page cache warm where
buffered I/O is used) and cold (page cache dropped where permitted, else O_DIRECT reads);
ping and 1,000-key lookup latency while a swap_out stream runs; host layout conversion vs
memcpy; the daemon's CPU use while busy and while idle.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvswap.protocol import Busy, Client, HostKVCache, KvswapError

from ..movers.copy_plan import Placement
from ..movers.host import HostMover
from .local_daemon import LocalDaemon
from .presets import preset_layout
from ..staging import aligned_empty

CHUNK = 4 * 1024 * 1024
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass
class Row:
    name: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float = 0.0

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline_value if self.baseline_value else None


@dataclass
class Report:
    preset: str
    record_bytes: int
    blocks: int
    batch: int
    direct_io: bool
    cold_method: str
    rows: list[Row] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0) -> None:
        self.rows.append(Row(name, value, unit, baseline, baseline_value))

    def as_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset, "record_bytes": self.record_bytes, "blocks": self.blocks, "batch": self.batch,
            "direct_io": self.direct_io, "cold_method": self.cold_method,
            "results": {r.name: {"value": _sig(r.value), "unit": r.unit, "baseline": r.baseline or None,
                                 "baseline_value": _sig(r.baseline_value) or None,
                                 "ratio": _sig(r.ratio) if r.ratio is not None else None} for r in self.rows},
        }

    def table(self) -> str:
        lines = [f"preset {self.preset}: {self.blocks} blocks of {self.record_bytes / 2**20:.2f} MiB, "
                 f"{self.batch} per request, direct I/O {'on' if self.direct_io else 'off'}, "
                 f"cold reads: {self.cold_method}", "",
                 f"{'measure':34}{'value':>12}  {'unit':8}{'baseline':>28}{'ratio':>8}"]
        for r in self.rows:
            base = f"{r.baseline} {r.baseline_value:.2f}" if r.baseline else ""
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
            lines.append(f"{r.name:34}{r.value:12.3f}  {r.unit:8}{base:>28}{ratio:>8}")
        return "\n".join(lines)


def _sig(x: float) -> float:
    """Four significant digits: small ratios stay visible, big numbers stay readable."""
    return float(f"{x:.4g}")


# -- baselines ---------------------------------------------------------------------------------


def memcpy_gbps(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)  # written once so the timed copy pays no page faults
    t = time.perf_counter()
    np.copyto(dst, src)
    return nbytes / (time.perf_counter() - t) / 1e9


def raw_sequential_gbps(directory: str, nbytes: int) -> tuple[float, float, bool]:
    """O_DIRECT sequential write then read of ``nbytes`` in 4 MiB requests (buffered with a
    page-cache drop where O_DIRECT is refused). Returns (write GB/s, read GB/s, direct)."""
    buf = aligned_empty(CHUNK)
    buf[:] = np.random.default_rng(1).integers(0, 256, CHUNK, dtype=np.uint8)
    nbytes = max(CHUNK, nbytes // CHUNK * CHUNK)
    path = os.path.join(directory, f".bench-raw-{os.getpid()}")
    direct = bool(_O_DIRECT)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
        except OSError:
            direct = False
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.pwritev(fd, [buf], off)
        if not direct:
            os.fdatasync(fd)
        write_s = time.perf_counter() - t
        os.close(fd)
        if not direct:
            drop_page_cache()
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        t = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.preadv(fd, [buf], off)
        read_s = time.perf_counter() - t
        os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9, direct


def drop_page_cache() -> bool:
    """Drop clean page-cache pages (needs root). True if it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def conversion_vs_memcpy(layout_name: str, blocks: int) -> tuple[float, float, float]:
    """Host gather (engine layout -> one record per staging slot) GB/s, and two memcpy
    baselines of the same bytes: into the same slots, one record-sized copy each (the least
    any record pipeline must do), and as one bulk copy (the machine's best case)."""
    layout = preset_layout(layout_name, blocks)
    total = layout.record_bytes * blocks
    with HostKVCache.create(layout) as cache:
        cache.fill_random(2)
        reg = cache.registration()
        placements = [Placement(r["name"], 0, r["offset"], r["stride"], region.block_bytes, region.record_offset)
                      for r, region in zip(reg["regions"], layout.regions)]
        engine = np.frombuffer(cache.segment.buffer, dtype=np.uint8)
        mover = HostMover([engine], placements, layout.record_bytes)
        slots = [aligned_empty(layout.record_bytes) for _ in range(blocks)]
        for s in slots:
            s.fill(1)
        ids = list(range(blocks))
        mover.gather_blocks(ids, slots, lambda: True)  # warm
        t = time.perf_counter()
        mover.gather_blocks(ids, slots, lambda: True)
        gather_s = time.perf_counter() - t
        mover.close()
        src = engine[:total] if engine.nbytes >= total else np.resize(engine, total)
        t = time.perf_counter()
        for i, slot in enumerate(slots):
            np.copyto(slot, src[i * layout.record_bytes:(i + 1) * layout.record_bytes])
        per_record_s = time.perf_counter() - t
        del engine, src
    return total / gather_s / 1e9, total / per_record_s / 1e9, memcpy_gbps(total)


# -- the daemon under test -----------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantiles(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return (samples[0], samples[0]) if samples else (0.0, 0.0)
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49], q[98]


def _retry_busy(call: Callable[[], Any]) -> Any:
    while True:
        try:
            return call()
        except Busy:
            time.sleep(0.002)


def run_bench(preset: str = "small", blocks: int = 512, batch: int = 32, storage_dir: str | None = None,
              daemon_args: tuple[str, ...] = (), idle_s: float = 5.0, latency_samples: int = 300,
              say: Callable[[str], None] = lambda s: None) -> Report:
    layout = preset_layout(preset, blocks)
    record = layout.record_bytes
    total = record * blocks
    batch = min(batch, blocks)
    owned_tmp = None
    if storage_dir is None:
        owned_tmp = tempfile.TemporaryDirectory(prefix="kvswap-bench-", dir=".")
        storage_dir = owned_tmp.name
    os.makedirs(storage_dir, mode=0o700, exist_ok=True)
    try:
        say("baselines: memcpy, raw sequential write and read")
        copy_gbps = memcpy_gbps(total)
        raw_w, raw_r, raw_direct = raw_sequential_gbps(storage_dir, total)
        raw_name = "raw O_DIRECT" if raw_direct else "raw buffered"
        args = ("--direct-io", "auto", *daemon_args)
        with LocalDaemon(storage_dir, args) as daemon, HostKVCache.create(layout) as cache, \
                Client(daemon.endpoint, timeout=120) as c:
            cache.fill_random(int.from_bytes(os.urandom(4), "little"))
            c.register(cache)
            direct = bool(c.stats()["tiers"]["file"].get("direct_io"))
            pid = daemon.proc.pid  # type: ignore[union-attr]
            tag = os.urandom(3).hex()
            batches = [list(range(s, min(s + batch, blocks))) for s in range(0, blocks, batch)]
            report = Report(preset, record, blocks, batch, direct, "")

            say("swap_out, answered when copied")
            keys_a = [f"a{tag}-{i}" for i in range(blocks)]
            cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
            lat = []
            for ids in batches:
                t = time.perf_counter()
                _retry_busy(lambda: c.swap_out(ids, [keys_a[i] for i in ids], wait="copied"))
                lat.append(time.perf_counter() - t)
            copied_s = time.perf_counter() - t0
            c.flush()
            drained_s = time.perf_counter() - t0
            busy_cpu = (_cpu_seconds(pid) - cpu0) / drained_s
            p50, p99 = _quantiles(lat)
            report.add("swap_out copied", total / copied_s / 1e9, "GB/s", "memcpy", copy_gbps)
            report.add("swap_out copied, until written", total / drained_s / 1e9, "GB/s", raw_name + " write", raw_w)
            report.add("swap_out copied latency p50", p50 * 1e3, "ms")
            report.add("swap_out copied latency p99", p99 * 1e3, "ms")

            say("swap_out, answered when persisted")
            keys_b = [f"b{tag}-{i}" for i in range(blocks)]
            t0 = time.perf_counter()
            for ids in batches:
                _retry_busy(lambda: c.swap_out(ids, [keys_b[i] for i in ids], wait="persisted"))
            persisted_s = time.perf_counter() - t0
            report.add("swap_out persisted", total / persisted_s / 1e9, "GB/s", raw_name + " write", raw_w)

            say("swap_in hot")
            t0 = time.perf_counter()
            for ids in batches:
                r = c.swap_in([keys_b[i] for i in ids], ids)
                if r.loaded != len(ids):
                    raise RuntimeError(f"swap_in loaded {r.loaded} of {len(ids)}: {r.status}")
            report.add("swap_in hot", total / (time.perf_counter() - t0) / 1e9, "GB/s", "memcpy", copy_gbps)

            say("swap_in cold")
            dropped = drop_page_cache()
            report.cold_method = ("page cache dropped" if dropped else "O_DIRECT reads" if direct
                                  else "page cache NOT dropped (not root): cold = hot")
            t0 = time.perf_counter()
            for ids in batches:
                r = c.swap_in([keys_a[i] for i in ids], ids)
                if r.loaded != len(ids):
                    raise RuntimeError(f"swap_in loaded {r.loaded} of {len(ids)}: {r.status}")
            report.add("swap_in cold", total / (time.perf_counter() - t0) / 1e9, "GB/s", raw_name + " read", raw_r)

            say("ping and lookup latency under a swap_out stream")
            stop = threading.Event()
            streamed = [0]

            def stream() -> None:
                with Client(daemon.endpoint, timeout=60) as s:
                    n = 0
                    while not stop.is_set():
                        ids = batches[n % len(batches)]
                        try:
                            s.swap_out(ids, [f"s{tag}-{n}-{i}" for i in ids], wait="copied")
                            streamed[0] += len(ids)
                        except KvswapError:
                            time.sleep(0.002)
                        n += 1

            streamer = threading.Thread(target=stream, daemon=True)
            streamer.start()
            try:
                lookup_keys = (keys_a * (1000 // len(keys_a) + 1))[:1000]
                pings, lookups = [], []
                for _ in range(latency_samples):
                    t = time.perf_counter()
                    c.ping()
                    pings.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    c.lookup(lookup_keys)
                    lookups.append(time.perf_counter() - t)
            finally:
                stop.set()
                streamer.join(120)
            c.flush()
            for name, samples in (("ping", pings), ("lookup 1000 keys", lookups)):
                p50, p99 = _quantiles(samples)
                report.add(f"{name} p50 under load", p50 * 1e3, "ms")
                report.add(f"{name} p99 under load", p99 * 1e3, "ms")
            report.add("blocks streamed meanwhile", streamed[0], "blocks")

            say(f"idle CPU over {idle_s:.0f} s")
            report.add("daemon CPU while swapping", busy_cpu * 100, "% core")
            cpu0 = _cpu_seconds(pid)
            time.sleep(idle_s)
            report.add("daemon CPU idle", (_cpu_seconds(pid) - cpu0) / idle_s * 100, "% core")
            c.clear()

        say("host layout conversion vs memcpy")
        gather, per_record, bulk = conversion_vs_memcpy(preset, min(blocks, 256))
        report.add("host layout conversion", gather, "GB/s", "memcpy into slots", per_record)
        report.add("host layout conversion vs bulk", gather, "GB/s", "memcpy bulk", bulk)
        return report
    finally:
        if owned_tmp is not None:
            owned_tmp.cleanup()


def plot_sweep(path: str, preset: str, block_sizes: list[int], blocks_bytes: int, storage_dir: str | None,
               daemon_args: tuple[str, ...], say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Throughput vs record size: one bench per block size (tokens), plotted to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import presets

    points = []
    base = dict(presets.PRESETS[preset][1])
    for tokens in block_sizes:
        name = f"{preset}-bs{tokens}"
        presets.PRESETS[name] = (f"{preset} with {tokens}-token blocks", {**base, "block_size": tokens})
        record = preset_layout(name, 1).record_bytes
        blocks = max(16, blocks_bytes // record)
        say(f"sweep: {tokens}-token blocks ({record / 2**20:.2f} MiB records), {blocks} blocks")
        report = run_bench(name, blocks, 32, storage_dir, daemon_args, idle_s=0.5, latency_samples=20)
        results = {r.name: r for r in report.rows}
        points.append({"block_tokens": tokens, "record_mib": record / 2**20,
                       **{k: results[k].value for k in ("swap_out persisted", "swap_in cold", "swap_out copied")},
                       "raw_write": results["swap_out persisted"].baseline_value,
                       "raw_read": results["swap_in cold"].baseline_value})
    x = [p["record_mib"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, style, label in (("swap_out persisted", "o-", "swap_out persisted"), ("raw_write", "o--", "raw write"),
                              ("swap_in cold", "s-", "swap_in cold"), ("raw_read", "s--", "raw read"),
                              ("swap_out copied", "^-", "swap_out copied")):
        ax.plot(x, [p[key] for p in points], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("record size (MiB per block)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvswap throughput vs block size ({preset} preset)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return points
