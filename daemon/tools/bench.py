"""``kvswap bench``: the daemon's throughput and latency next to baselines measured in the same
run on the same directory (raw I/O with the daemon's own thread counts and request size,
memcpy of the same bytes).

Phases, in order: baselines; swap_out answered at "copied" (a stream, writes overlapping);
swap_out answered at "persisted", one request after another; swap_in hot (the daemon as
configured, right after the write: its host tier where it has one, and there only the newest
batches that fit in it); swap_out answered at "persisted" with two requests in flight (two
clients);
swap_in cold (a second daemon on the same directory
with no host tier and O_DIRECT reads, so no cache can serve it; or, only with
``drop_caches``, buffered reads after dropping the machine's page cache); swap_in warm (a
third daemon, buffered I/O, no host tier, reading each record a second time: the page cache);
ping and 1,000-key lookup latency while another process streams swap_outs, timed alternately
with a bare pyzmq + msgpack echo server's answers to the same requests (the machine's floor,
latency_floor.py), and the daemon's p99 over the floor's; host layout conversion vs memcpy;
the daemon's CPU use while busy and while idle.

"Host layout conversion" is the copy swap_out runs for a shared-memory cache, measured in this
process: the segment registered as the daemon registers it, its ``SegmentMover`` gathering the
engine's blocks into host-pool slots on the native fault-guarded copy (``preadv`` where the
helper is not built or ``KVSWAP_NATIVE_COPY=0``), in the swapper's calls (one block, then four
a call). The report names the path (``conversion_copy``). Before issue 23 the rows measured
``HostMover``, a mapped ``memmove`` the daemon never ran; the row names stayed, so readers of
the JSON keep working.

(Over 500 lines on purpose: each phase sits next to the baseline it is divided by, so a reader
can check in one place that every ratio compares like with like.)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.backends.host_arena import HostArena
from kvswap.protocol import Busy, Client, HostKVCache, KvswapError
from kvswap.protocol.limits import MAX_KEYS_PER_REQUEST

from ..config import Config
from ..deadline import CopyGuard, Deadline
from ..registration import Registration
from ..staging import aligned_empty
from ..swapper import gather_chunks
from .latency_floor import EchoServer, StreamProcess
from .local_daemon import LocalDaemon
from .presets import preset_layout

CHUNK = 4 * 1024 * 1024
ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Requests in flight in the "swap_out persisted, N in flight" row: an engine saving two
#: sequences at once, which keeps the disk busy across each request's first copy and its
#: answer (docs/operations.md, Performance).
PERSISTED_DEPTH = 2
#: Fewer samples than this and the p99 is just the worst one or two: the report says so.
P99_MIN_SAMPLES = 100


@dataclass
class Row:
    name: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float = 0.0
    #: How many measurements the value summarises (latency quantiles), 0 when not a sample.
    samples: int = 0
    #: Each round's own ratio, where the value and its baseline were timed in alternating rounds.
    rounds: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.value / self.baseline_value if self.baseline_value else None

    @property
    def is_count(self) -> bool:
        return self.unit in ("blocks", "samples")


@dataclass
class Report:
    preset: str
    record_bytes: int
    blocks: int
    batch: int
    direct_io: bool
    cold_method: str
    fsync: str = "none"
    host_tier: bool = False
    threads: tuple[int, int] = (0, 0)
    #: The shared-memory mover's copy path the host layout conversion ran on (native, preadv).
    conversion_copy: str = ""
    #: Rounds the disk rows alternated with their raw baselines (Alternation).
    rounds: int = 1
    rows: list[Row] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, unit: str, baseline: str = "", baseline_value: float = 0.0,
            samples: int = 0, rounds: Sequence[float] = ()) -> None:
        self.rows.append(Row(name, value, unit, baseline, baseline_value, samples, list(rounds)))
        if samples and samples < P99_MIN_SAMPLES and "p99" in name:
            self.warnings.append(f"{name}: only {samples} samples, too few for a p99 "
                                 f"(want {P99_MIN_SAMPLES}+; the value is about the worst sample)")

    def as_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset, "record_bytes": self.record_bytes, "blocks": self.blocks, "batch": self.batch,
            "direct_io": self.direct_io, "cold_method": self.cold_method, "fsync": self.fsync,
            "host_tier": self.host_tier, "write_threads": self.threads[0], "read_threads": self.threads[1],
            "conversion_copy": self.conversion_copy, "rounds": self.rounds,
            "machine": machine(), "warnings": list(self.warnings),
            "results": {r.name: {"value": int(r.value) if r.is_count else _sig(r.value), "unit": r.unit,
                                 "baseline": r.baseline or None,
                                 "baseline_value": _sig(r.baseline_value) or None,
                                 "ratio": _sig(r.ratio) if r.ratio is not None else None,
                                 **({"samples": r.samples} if r.samples else {}),
                                 **({"round_ratios": [_sig(x) for x in r.rounds]} if r.rounds else {})}
                        for r in self.rows},
        }

    def table(self) -> str:
        lines = [f"preset {self.preset}: {self.blocks} blocks of {self.record_bytes / 2**20:.2f} MiB, "
                 f"{self.batch} per request, direct I/O {'on' if self.direct_io else 'off'}, "
                 f"fsync {self.fsync}, host tier {'on' if self.host_tier else 'off'}, "
                 f"{self.threads[0]} write / {self.threads[1]} read threads",
                 f"cold reads: {self.cold_method}", f"machine: {machine()}",
                 f"disk rows: {self.rounds} rounds alternated with their raw baselines "
                 "(each row's range of round ratios at the end)",
                 *([f"host layout conversion: the shared-memory mover, {self.conversion_copy} copy"]
                   if self.conversion_copy else []), "",
                 f"{'measure':42}{'value':>12}  {'unit':8}{'baseline':>36}{'ratio':>8}"]
        for r in self.rows:
            base = f"{r.baseline} {r.baseline_value:.2f}" if r.baseline else ""
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
            value = f"{int(r.value):12d}" if r.is_count else f"{r.value:12.3f}"
            name = f"{r.name} (n={r.samples})" if r.samples else r.name
            lines.append(f"{name:42}{value}  {r.unit:8}{base:>36}{ratio:>8}")
        lines += [f"{r.name}: rounds {min(r.rounds):.2f}x to {max(r.rounds):.2f}x"
                  for r in self.rows if r.rounds]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _sig(x: float) -> float:
    """Four significant digits: small ratios stay visible, big numbers stay readable."""
    return float(f"{x:.4g}")


def machine() -> str:
    """What the numbers were measured on: CPUs (model and count) and memory."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = 0.0
    return f"{os.cpu_count()} CPUs{' (' + model + ')' if model else ''}, {mem:.0f} GiB RAM"


# -- baselines ---------------------------------------------------------------------------------


def memcpy_gbps(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)  # written once so the timed copy pays no page faults
    t = time.perf_counter()
    np.copyto(dst, src)
    return nbytes / (time.perf_counter() - t) / 1e9


@dataclass
class RawIO:
    """Raw I/O of the same bytes the daemon moves, with the daemon's request size (one record,
    rounded up to 4 KiB) and thread counts: a ratio above 1 would mean the baseline hid
    something, not that kvswap beat the disk."""

    write: float
    cold_read: float  # O_DIRECT (the page cache never helps), or buffered after a drop
    warm_read: float  # buffered, the file just read once: the page cache
    direct: bool
    cold_method: str


class RawFile:
    """A raw baseline's file beside the daemon's records: ``count`` record-sized requests
    (one record rounded up to 4 KiB), written and read by ``threads`` threads, each request
    ``i`` at offset ``i * request``; O_DIRECT where the file system takes it. With ``fsync``
    other than none every write is followed by an fdatasync, as the daemon does per record.

    ``preallocate``: the file's blocks are allocated at once (``posix_fallocate``), as the
    slab layout grows its slab files, so each request's first write lands where the daemon's
    first write of a record does: in allocated, never written blocks. That matters: on this
    VM's ext4 such writes ran 1.7-1.8 GB/s where overwrites of written blocks ran 2.6-3.2
    (4 threads, 2 MiB), so a baseline that overwrote would flatter the disk against a daemon
    filling new slots."""

    def __init__(self, directory: str, record_bytes: int, count: int, threads: int, fsync: str = "none",
                 name: str = "", preallocate: bool = False) -> None:
        self.request = (record_bytes + ALIGN - 1) // ALIGN * ALIGN
        self.count = max(1, count)
        self.sync = fsync != "none"
        self.path = os.path.join(directory, f".bench-raw-{os.getpid()}{name}")
        self.bufs = [aligned_empty(self.request) for _ in range(max(1, threads))]
        for b in self.bufs:
            b[:] = np.random.default_rng(1).integers(0, 256, self.request, dtype=np.uint8)
        fd, self.direct = _create_for_write(self.path, bool(_O_DIRECT))
        try:
            if preallocate:
                os.posix_fallocate(fd, 0, self.count * self.request)
        finally:
            os.close(fd)

    def write(self, threads: int, first: int = 0, count: int | None = None) -> float:
        """Seconds to write requests ``first .. first + count`` (all by default)."""
        fd = os.open(self.path, os.O_WRONLY | (_O_DIRECT if self.direct else 0))
        try:
            return self._run(fd, threads, os.pwritev, first, self.count if count is None else count, self.sync)
        finally:
            os.close(fd)

    def read(self, threads: int, direct: bool, first: int = 0, count: int | None = None) -> float:
        """Seconds to read requests ``first .. first + count``; ``direct``: with O_DIRECT."""
        fd = os.open(self.path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        try:
            return self._run(fd, threads, os.preadv, first, self.count if count is None else count, False)
        finally:
            os.close(fd)

    def _run(self, fd: int, threads: int, op: Callable[[int, list, int], int], first: int, count: int,
             sync: bool) -> float:
        def worker(w: int) -> None:
            for i in range(first + w, first + count, threads):
                op(fd, [self.bufs[w]], i * self.request)
                if sync:
                    os.fdatasync(fd)

        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        return time.perf_counter() - t

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def raw_parallel_io(raw: RawFile, write_threads: int, read_threads: int, drop_caches: bool = False) -> RawIO:
    """Write then read the whole raw file once, spread over the daemon's thread counts: the
    up-front baselines (the rounds that alternate with the daemon's passes are
    :class:`Alternation`'s)."""
    write_s = raw.write(write_threads)
    cold_s = 0.0
    cold_method = ""
    if raw.direct:
        cold_s = raw.read(read_threads, direct=True)
        cold_method = "O_DIRECT reads"
    if not raw.direct and drop_caches and drop_page_cache():
        cold_s = raw.read(read_threads, direct=False)
        cold_method = "buffered reads after drop_caches"
    raw.read(read_threads, direct=False)  # fills the page cache
    warm_s = raw.read(read_threads, direct=False)
    total = raw.count * raw.request
    return RawIO(total / write_s / 1e9, total / cold_s / 1e9 if cold_s else 0.0, total / warm_s / 1e9, raw.direct,
                 cold_method)


@dataclass
class Alternation:
    """A daemon pass and its raw baseline over the same bytes, timed in rounds that take turns
    (daemon first in even rounds, raw first in odd ones), so the disk's own drift (this VM's
    virtio disk wrote 1.2 to 5 GB/s minutes apart) falls on both alike. The value is bytes
    over the daemon's seconds summed, the baseline the same for the raw passes; ``ratios``
    are the rounds' own."""

    daemon_s: float = 0.0
    raw_s: float = 0.0
    daemon_bytes: int = 0
    raw_bytes: int = 0
    ratios: list[float] = field(default_factory=list)

    def round(self, daemon_bytes: int, raw_bytes: int, daemon: Callable[[], float], raw: Callable[[], float]) -> None:
        """One round: ``daemon()`` moves ``daemon_bytes`` (its records), ``raw()`` as many
        requests of ``raw_bytes`` in all (records rounded up to 4 KiB); each returns its seconds."""
        if len(self.ratios) % 2 == 0:
            d = daemon()
            r = raw()
        else:
            r = raw()
            d = daemon()
        self.daemon_s += d
        self.raw_s += r
        self.daemon_bytes += daemon_bytes
        self.raw_bytes += raw_bytes
        self.ratios.append((daemon_bytes / d) / (raw_bytes / r) if d and r else 0.0)

    @property
    def gbps(self) -> float:
        return self.daemon_bytes / self.daemon_s / 1e9 if self.daemon_s else 0.0

    @property
    def raw_gbps(self) -> float:
        return self.raw_bytes / self.raw_s / 1e9 if self.raw_s else 0.0


def in_rounds(batches: list[list[int]], rounds: int) -> list[list[list[int]]]:
    """``batches`` cut into ``rounds`` consecutive groups of whole batches (fewer groups when
    there are fewer batches). ``in_rounds([[0, 1], [2, 3], [4]], 2) == [[[0, 1], [2, 3]], [[4]]]``."""
    rounds = max(1, min(rounds, len(batches)))
    size = -(-len(batches) // rounds)
    return [batches[i:i + size] for i in range(0, len(batches), size)]


def _create_for_write(path: str, direct: bool) -> tuple[int, bool]:
    """Create ``path`` for the raw write baseline, with O_DIRECT where ``direct`` and the file
    system takes it; returns the descriptor and whether it is direct."""
    if direct:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600), True
        except OSError:
            pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), False


def raw_sequential_gbps(directory: str, nbytes: int) -> tuple[float, float, bool]:
    """Single-threaded O_DIRECT sequential write then read of ``nbytes`` in 4 MiB requests
    (buffered where O_DIRECT is refused; then the read may come from the page cache).
    Returns (write GB/s, read GB/s, direct). For scenarios that want the disk's best case."""
    buf = aligned_empty(CHUNK)
    buf[:] = np.random.default_rng(1).integers(0, 256, CHUNK, dtype=np.uint8)
    nbytes = max(CHUNK, nbytes // CHUNK * CHUNK)
    path = os.path.join(directory, f".bench-raw-{os.getpid()}")
    direct = bool(_O_DIRECT)
    try:
        fd, direct = _create_for_write(path, direct)
        t = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.pwritev(fd, [buf.data], off)
        if not direct:
            os.fdatasync(fd)
        write_s = time.perf_counter() - t
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        t = time.perf_counter()
        for off in range(0, nbytes, CHUNK):
            os.preadv(fd, [buf.data], off)
        read_s = time.perf_counter() - t
        os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9, direct


def drop_page_cache() -> bool:
    """Drop clean page-cache pages of the WHOLE MACHINE (needs root); every other process
    loses its cached files too, so the bench does it only when asked (``--drop-caches``).
    True if it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def daemon_threads(daemon_args: Sequence[str]) -> tuple[int, int]:
    """The write and read thread counts the daemon will run with: its flags, else its defaults."""
    defaults = Config()
    found = {"--write-threads": defaults.write_threads, "--read-threads": defaults.read_threads}
    args = list(daemon_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in found:
            found[name] = int(value if eq else args[i + 1])
    return found["--write-threads"], found["--read-threads"]


def daemon_flag(daemon_args: Sequence[str], flag: str, default: str) -> str:
    args = list(daemon_args)
    value = default
    for i, arg in enumerate(args):
        name, eq, rest = arg.partition("=")
        if name == flag:
            value = rest if eq else args[i + 1]
    return value


def conversion_vs_memcpy(layout_name: str, blocks: int) -> tuple[float, float, float, str]:
    """Host gather GB/s on the path swap_out runs for a shared-memory cache, and two memcpy
    baselines of the same bytes: into the same slots, one record-sized copy each (the least
    any record pipeline must do), and as one bulk copy (the machine's best case). The fourth
    value is the copy path measured: ``native`` or ``preadv`` (see :mod:`..movers.segment`).

    The path is the daemon's own: a ``HostKVCache`` segment registered as the daemon registers
    it (:meth:`Registration.attach`: the segment opened by descriptor, its
    :class:`~..movers.segment.SegmentMover` on the native fault-guarded copy where it is built,
    else ``preadv``; ``KVSWAP_NATIVE_COPY`` decides as it does for the daemon), gathering
    in the swapper's calls (:func:`~..swapper.gather_chunks`: one block, then ``GATHER_CHUNK``
    a call) under a request's :class:`CopyGuard` into host-pool slots. Until issue 23 this
    measured ``HostMover`` (a ``memmove`` per region chunk through a mapping), which the daemon
    never ran; the row names stayed."""
    layout = preset_layout(layout_name, blocks)
    total = layout.record_bytes * blocks
    pool = HostArena(layout.record_bytes, staging_slots=blocks)
    with HostKVCache.create(layout) as cache:
        cache.fill_random(2)
        body = cache.registration()
        registration = Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])
        taken = pool.take(blocks)
        assert taken is not None  # a fresh pool of exactly ``blocks`` staging slots
        slots = [slot.view for slot in taken]
        for view in slots:
            view.fill(1)  # touched once: the timed copies pay no page faults
        ids = list(range(blocks))
        guard = CopyGuard(Deadline(600.0), lambda: registration.closing)
        mover = registration.mover
        path = str(mover.describe().get("copy", mover.kind))

        def gather() -> float:
            t = time.perf_counter()
            for start, stop in gather_chunks(blocks):
                with guard.copying() as allowed:
                    if not allowed or not mover.gather_blocks(ids[start:stop], slots[start:stop], guard):
                        raise RuntimeError("the conversion's gather was cut short")
            return time.perf_counter() - t

        try:
            gather()  # warm
            gather_s = gather()
            if slots[-1].tobytes() != cache.block_record(blocks - 1):
                raise RuntimeError("the conversion's gather moved other bytes than the engine's last block")
        finally:
            registration.close()
        engine = np.frombuffer(cache.segment.buffer, dtype=np.uint8)
        src = engine[:total] if engine.nbytes >= total else np.resize(engine, total)
        t = time.perf_counter()
        for i, view in enumerate(slots):
            np.copyto(view, src[i * layout.record_bytes:(i + 1) * layout.record_bytes])
        per_record_s = time.perf_counter() - t
        del engine, src, slots
    for slot in taken:
        slot.release()
    pool.retire()
    return total / gather_s / 1e9, total / per_record_s / 1e9, memcpy_gbps(total), path


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


def _swap_in_all(c: Client, keys: list[str], batches: list[list[int]]) -> float:
    """swap_in every batch; seconds taken. Raises if a block did not load."""
    t0 = time.perf_counter()
    for ids in batches:
        r = c.swap_in([keys[i] for i in ids], ids)
        if r.loaded != len(ids):
            raise RuntimeError(f"swap_in loaded {r.loaded} of {len(ids)}: {r.status}")
    return time.perf_counter() - t0


def _reader_pass(storage_dir: str, daemon_args: Sequence[str], extra: Sequence[str], cache: HostKVCache,
                 keys: list[str], batches: list[list[int]], passes: int) -> float:
    """Seconds of the last of ``passes`` swap_in passes over ``keys`` by a fresh daemon on the
    same directory (the records are read from the file tier: the flags here turn the host
    tier off)."""
    with LocalDaemon(storage_dir, (*daemon_args, *extra)) as daemon, Client(daemon.endpoint, timeout=120) as c:
        c.register(cache)
        for _ in range(passes - 1):
            _swap_in_all(c, keys, batches)
        return _swap_in_all(c, keys, batches)


def _count(group: list[list[int]]) -> int:
    return sum(map(len, group))


def _bytes(group: list[list[int]], record: int) -> int:
    return _count(group) * record


def _swap_out_persisted(c: Client, keys: list[str], group: list[list[int]]) -> float:
    """One round of swap_outs answered "persisted", one request after another; seconds."""
    t0 = time.perf_counter()
    for ids in group:
        _retry_busy(lambda: c.swap_out(ids, [keys[i] for i in ids], wait="persisted"))
    return time.perf_counter() - t0


def _swap_out_persisted_in_flight(endpoint: str, keys: list[str], group: list[list[int]], depth: int) -> float:
    """One round of swap_outs answered "persisted", ``depth`` requests in flight: as many
    clients (connections), each sending its share of the batches one after another, as
    engine threads saving different sequences do; seconds until the last answer."""
    def client(share: list[list[int]]) -> None:
        with Client(endpoint, timeout=120) as c:
            _swap_out_persisted(c, keys, share)

    with ThreadPoolExecutor(depth) as pool:
        t0 = time.perf_counter()
        list(pool.map(client, [group[i::depth] for i in range(depth)]))
        return time.perf_counter() - t0


class _CopiedStream:
    """swap_outs answered "copied" in rounds: each round streams its batches (the next request
    sent as the last is answered) and then flushes, timed until written; the time until the
    last answer, each request's latency and the daemon's CPU are summed over the rounds."""

    def __init__(self, c: Client, keys: list[str], record: int, pid: int) -> None:
        self.c, self.keys, self.record, self.pid = c, keys, record, pid
        self.copied_s = 0.0
        self.latencies: list[float] = []
        self._cpu = 0.0
        self._drained_s = 0.0

    def run(self, group: list[list[int]]) -> float:
        cpu0, t0 = _cpu_seconds(self.pid), time.perf_counter()
        for ids in group:
            t = time.perf_counter()
            _retry_busy(lambda: self.c.swap_out(ids, [self.keys[i] for i in ids], wait="copied"))
            self.latencies.append(time.perf_counter() - t)
        self.copied_s += time.perf_counter() - t0
        self.c.flush()
        drained = time.perf_counter() - t0
        self._drained_s += drained
        self._cpu += _cpu_seconds(self.pid) - cpu0
        return drained

    @property
    def busy_cpu(self) -> float:
        """The daemon's CPU seconds per second while it copied and wrote."""
        return self._cpu / self._drained_s if self._drained_s else 0.0


def _cold_rounds(storage_dir: str, daemon_args: Sequence[str], extra: Sequence[str], cache: HostKVCache,
                 keys: list[str], groups: list[list[list[int]]], raw_file: RawFile, threads: int,
                 record: int) -> Alternation:
    """swap_in by a fresh daemon on the same directory (the flags here: no host tier, O_DIRECT
    reads) in rounds alternated with raw O_DIRECT reads of as many requests."""
    cold = Alternation()
    with LocalDaemon(storage_dir, (*daemon_args, *extra)) as daemon, Client(daemon.endpoint, timeout=120) as c:
        c.register(cache)
        for group in groups:
            cold.round(_bytes(group, record), _bytes(group, raw_file.request), lambda: _swap_in_all(c, keys, group),
                       lambda: raw_file.read(threads, True, group[0][0], _count(group)))
    return cold


def run_bench(preset: str = "small", blocks: int = 512, batch: int = 32, storage_dir: str | None = None,
              daemon_args: tuple[str, ...] = (), idle_s: float = 5.0, latency_samples: int = 300,
              say: Callable[[str], None] = lambda s: None, drop_caches: bool = False, rounds: int = 4) -> Report:
    layout = preset_layout(preset, blocks)
    record = layout.record_bytes
    total = record * blocks
    batch = min(batch, blocks)
    write_threads, read_threads = daemon_threads(daemon_args)
    fsync = daemon_flag(daemon_args, "--fsync", Config().fsync)
    owned_tmp = None
    if storage_dir is None:
        owned_tmp = tempfile.TemporaryDirectory(prefix="kvswap-bench-", dir=".")
        storage_dir = owned_tmp.name
    os.makedirs(storage_dir, mode=0o700, exist_ok=True)
    raw_files: list[RawFile] = []
    try:
        say(f"baselines: memcpy; raw write and read, {write_threads}/{read_threads} threads, "
            f"{record / 2**20:.2f} MiB requests")
        copy_gbps = memcpy_gbps(total)
        up_front = RawFile(storage_dir, record, blocks, max(write_threads, read_threads), fsync)
        try:
            raw = raw_parallel_io(up_front, write_threads, read_threads, drop_caches)
        finally:
            up_front.remove()
        # The rounds' raw writes land in never written blocks, as the daemon's records do in
        # new slots: one preallocated file per write phase. The cold rounds read the copied
        # phase's file, written round by round beside the records they read (keys_a): this VM's
        # disk reads recently written blocks faster, and a cold pass over the persisted phase's
        # newer file against keys_a's gave the daemon 0.59x where the reverse gave it 1.34x.

        def fresh(name: str) -> RawFile:
            raw_files.append(RawFile(storage_dir, record, blocks, max(write_threads, read_threads), fsync, name,
                                     preallocate=True))
            return raw_files[-1]

        mode = "O_DIRECT" if raw.direct else "buffered"
        raw_write = f"raw {mode} write x{write_threads}"
        alternated = f"{raw_write}, alternated"
        args = ("--direct-io", "auto", *daemon_args)
        with HostKVCache.create(layout) as cache:
            cache.fill_random(int.from_bytes(os.urandom(4), "little"))
            with LocalDaemon(storage_dir, args) as daemon, Client(daemon.endpoint, timeout=120) as c:
                token = c.register(cache)["token"]
                stats = c.stats()
                direct = bool(stats["tiers"]["file"].get("direct_io"))
                host_tier = "host" in stats["tiers"]
                pid = daemon.proc.pid  # type: ignore[union-attr]
                tag = os.urandom(3).hex()
                batches = [list(range(s, min(s + batch, blocks))) for s in range(0, blocks, batch)]
                groups = in_rounds(batches, rounds)
                report = Report(preset, record, blocks, batch, direct, "", fsync, host_tier,
                                (write_threads, read_threads), rounds=len(groups))

                if host_tier:
                    fill_gbps = _fill_ram_tier(c, stats, batches, record, tag, say)
                    report.add("swap_out persisted, RAM tier's first fill", fill_gbps, "GB/s", raw_write, raw.write)

                say("swap_out of one request to an idle daemon, answered when copied")
                single = []
                for n in range(5):
                    ids = batches[0]
                    t = time.perf_counter()
                    c.swap_out(ids, [f"i{tag}-{n}-{i}" for i in ids], wait="copied")
                    single.append(len(ids) * record / (time.perf_counter() - t) / 1e9)
                    c.flush()
                report.add(f"swap_out copied, one request of {len(batches[0])}, idle", statistics.median(single),
                           "GB/s", "memcpy", copy_gbps)

                say(f"swap_out, answered when copied; {len(groups)} rounds alternated with raw writes")
                keys_a = [f"a{tag}-{i}" for i in range(blocks)]
                copied = _CopiedStream(c, keys_a, record, pid)
                until_written = Alternation()
                raw_copied = fresh("-copied")
                for group in groups:
                    until_written.round(_bytes(group, record), _bytes(group, raw_copied.request),
                                        lambda: copied.run(group),
                                        lambda: raw_copied.write(write_threads, group[0][0], _count(group)))
                p50, p99 = _quantiles(copied.latencies)
                report.add("swap_out copied", total / copied.copied_s / 1e9, "GB/s", "memcpy", copy_gbps)
                report.add("swap_out copied, until written", until_written.gbps, "GB/s", alternated,
                           until_written.raw_gbps, rounds=until_written.ratios)
                report.add("swap_out copied latency p50", p50 * 1e3, "ms", samples=len(copied.latencies))
                report.add("swap_out copied latency p99", p99 * 1e3, "ms", samples=len(copied.latencies))
                busy_cpu = copied.busy_cpu

                say(f"swap_out, answered when persisted; {len(groups)} rounds alternated with raw writes")
                keys_b = [f"b{tag}-{i}" for i in range(blocks)]
                persisted = Alternation()
                raw_persisted = fresh("-persisted")
                for group in groups:
                    persisted.round(_bytes(group, record), _bytes(group, raw_persisted.request),
                                    lambda: _swap_out_persisted(c, keys_b, group),
                                    lambda: raw_persisted.write(write_threads, group[0][0], _count(group)))
                report.add("swap_out persisted", persisted.gbps, "GB/s", alternated, persisted.raw_gbps,
                           rounds=persisted.ratios)

                # Hot from RAM means the records RAM holds: where the tier is smaller than the
                # key set (8b records of 8 MiB against a 3 GiB tier), the newest batches that fit.
                hot = _ram_resident(batches, record, stats) if host_tier else batches
                say("swap_in hot" + (f" (host tier, the newest {sum(map(len, hot))} blocks)" if host_tier
                                     else " (no host tier: from the file tier)"))
                hot_s = _swap_in_all(c, keys_b, hot)
                report.add("swap_in hot (RAM tier)" if host_tier else "swap_in hot (no RAM tier)",
                           record * sum(map(len, hot)) / hot_s / 1e9, "GB/s", "memcpy", copy_gbps)
                report.add("swap_in hot, blocks read", sum(map(len, hot)), "blocks")

                say(f"swap_out, answered when persisted, {PERSISTED_DEPTH} in flight; {len(groups)} rounds "
                    "alternated with raw writes")
                keys_c = [f"c{tag}-{i}" for i in range(blocks)]
                in_flight = Alternation()
                raw_in_flight = fresh("-in-flight")
                for group in groups:
                    in_flight.round(_bytes(group, record), _bytes(group, raw_in_flight.request),
                                    lambda: _swap_out_persisted_in_flight(daemon.endpoint, keys_c, group,
                                                                          PERSISTED_DEPTH),
                                    lambda: raw_in_flight.write(write_threads, group[0][0], _count(group)))
                report.add(f"swap_out persisted, {PERSISTED_DEPTH} in flight", in_flight.gbps, "GB/s", alternated,
                           in_flight.raw_gbps, rounds=in_flight.ratios)
                # Deleted, so the directory holds what it held before: under a capacity cap they
                # could push out keys_a, which the cold phase reads.
                for i in range(0, len(keys_c), MAX_KEYS_PER_REQUEST):
                    c.delete(keys_c[i:i + MAX_KEYS_PER_REQUEST])

                say("ping and lookup latency under a swap_out stream, beside the echo floor")
                under = _latency_under_stream(daemon.endpoint, c, token, keys_a, batches, tag, latency_samples)
                quantiles = {}
                for name, samples in (("ping", under.pings), ("lookup 1000 keys", under.lookups),
                                      ("echo ping", under.echo_pings), ("echo lookup 1000 keys", under.echo_lookups)):
                    p50, p99 = quantiles[name] = _quantiles(samples)
                    report.add(f"{name} p50 under load", p50 * 1e3, "ms", samples=len(samples))
                    report.add(f"{name} p99 under load", p99 * 1e3, "ms", samples=len(samples))
                # The daemon's p99 over the echo floor's, from the same window (the ratio column).
                for name in ("ping", "lookup 1000 keys"):
                    report.add(f"{name} p99 under load vs echo floor", quantiles[name][1] * 1e3, "ms",
                               f"echo {name} p99", quantiles[f"echo {name}"][1] * 1e3)
                report.add("blocks streamed meanwhile", under.streamed, "blocks")
                # A rate, so runs whose latency phase lasted longer or shorter compare.
                report.add("swap_out stream meanwhile", under.streamed * record / under.seconds / 1e9, "GB/s")

                say(f"idle CPU over {idle_s:.0f} s")
                report.add("daemon CPU while swapping", busy_cpu * 100, "% core")
                cpu0 = _cpu_seconds(pid)
                time.sleep(idle_s)
                report.add("daemon CPU idle", (_cpu_seconds(pid) - cpu0) / idle_s * 100, "% core")

            # Reads no cache can serve: a daemon without host tier reading with O_DIRECT, or
            # (asked for explicitly) buffered reads after dropping the machine's page cache.
            no_host = ("--host-tier-bytes", "0")
            cold_extra: tuple[str, ...] | None = None
            if raw.direct:
                cold_extra, report.cold_method = (*no_host, "--direct-io", "on"), "O_DIRECT reads, no host tier"
            elif drop_caches:
                say("dropping the page cache of the whole machine (--drop-caches)")
                if drop_page_cache():
                    cold_extra = (*no_host, "--direct-io", "off")
                    report.cold_method = "buffered reads after drop_caches (whole machine, --drop-caches)"
                else:
                    report.cold_method = "not measured: drop_caches needs root"
            else:
                report.cold_method = "not measured: no O_DIRECT here; pass --drop-caches (as root) to drop the page cache"
            if cold_extra is not None and raw.direct:
                say(f"swap_in cold: {report.cold_method}; {len(groups)} rounds alternated with raw O_DIRECT reads")
                cold = _cold_rounds(storage_dir, args, cold_extra, cache, keys_a, groups, raw_copied, read_threads,
                                    record)
                report.add("swap_in cold", cold.gbps, "GB/s", f"raw {mode} read x{read_threads}, alternated",
                           cold.raw_gbps, rounds=cold.ratios)
            elif cold_extra is not None:  # after a drop of the page cache: one pass, the up-front baseline
                say("swap_in cold: " + report.cold_method)
                cold_s = _reader_pass(storage_dir, args, cold_extra, cache, keys_a, batches, 1)
                report.add("swap_in cold", total / cold_s / 1e9, "GB/s", f"raw {mode} read x{read_threads}",
                           raw.cold_read)
            say("swap_in warm: buffered reads from the page cache, no host tier")
            warm_s = _reader_pass(storage_dir, args, (*no_host, "--direct-io", "off"), cache, keys_a, batches, 2)
            report.add("swap_in warm (page cache)", total / warm_s / 1e9, "GB/s",
                       f"raw buffered warm read x{read_threads}", raw.warm_read)
            with LocalDaemon(storage_dir, args) as daemon, Client(daemon.endpoint, timeout=120) as c:
                c.register(cache)
                c.clear()

        say("host layout conversion vs memcpy (the shared-memory mover's gather, as swap_out runs it)")
        gather, per_record, bulk, report.conversion_copy = conversion_vs_memcpy(preset, min(blocks, 256))
        report.add("host layout conversion", gather, "GB/s", "memcpy into slots", per_record)
        report.add("host layout conversion vs bulk", gather, "GB/s", "memcpy bulk", bulk)
        return report
    finally:
        for raw_file in raw_files:
            raw_file.remove()
        if owned_tmp is not None:
            owned_tmp.cleanup()


def _ram_resident(batches: list[list[int]], record: int, stats: dict[str, Any]) -> list[list[int]]:
    """The newest whole batches that fit in the RAM tier (all of them where it holds the set)."""
    fit = int(stats["tiers"]["host"].get("capacity_bytes") or 0) // record
    kept: list[list[int]] = []
    for ids in reversed(batches):
        if sum(map(len, kept)) + len(ids) > fit:
            break
        kept.insert(0, ids)
    return kept or batches[-1:]


def _fill_ram_tier(c: Client, stats: dict[str, Any], batches: list[list[int]], record: int, tag: str,
                   say: Callable[[str], None]) -> float:
    """Swap out enough records to fill the RAM tier once, then delete them: the pool faults its
    RAM-tier share in as records first fill it (once per daemon lifetime), so the measured
    phases after this see the daemon in its steady state. Returns the fill's GB/s."""
    capacity = int(stats["tiers"]["host"].get("capacity_bytes") or 0)
    count = capacity // record + 1  # the staging share was faulted in at registration
    say(f"filling the RAM tier once: {count} records ({count * record / 2**30:.2f} GiB)")
    keys: list[str] = []
    t0 = time.perf_counter()
    n = 0

    def faulted_in() -> bool:  # daemons with a host pool say how much of it is faulted in
        pool = c.stats().get("host_pool")
        return pool is None or pool["faulted"] >= pool["slots"]

    # Fill once; where the pool is still faulting in the background, keep going (up to 3x).
    while len(keys) < count or (len(keys) < 3 * count and not faulted_in()):
        ids = batches[n % len(batches)]
        batch_keys = [f"f{tag}-{n}-{i}" for i in ids]
        _retry_busy(lambda: c.swap_out(ids, batch_keys, wait="copied"))
        keys += batch_keys
        n += 1
    c.flush()
    fill_s = time.perf_counter() - t0
    waited = time.monotonic() + 120
    while (c.stats().get("host_pool") or {}).get("growing") and time.monotonic() < waited:
        time.sleep(0.2)  # the rest of the pool is faulting in on its own; let it finish
    for start in range(0, len(keys), 1000):
        c.delete(keys[start:start + 1000])
    return len(keys) * record / fill_s / 1e9


class SwapOutStream:
    """A client on its own thread that keeps swap_outs (answered "copied") going over
    ``batches`` until stopped. A busy daemon is retried after a short pause. ``blocks`` counts
    the blocks it got accepted. (benchmarks/loop_latency.py's load; ``kvswap bench`` streams
    from another process instead, :class:`.latency_floor.StreamProcess`.)"""

    def __init__(self, endpoint: str, batches: list[list[int]], prefix: str) -> None:
        self.endpoint, self.batches, self.prefix = endpoint, batches, prefix
        self.blocks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "SwapOutStream":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        with Client(self.endpoint, timeout=60) as s:
            n = 0
            while not self._stop.is_set():
                ids = self.batches[n % len(self.batches)]
                try:
                    s.swap_out(ids, [f"{self.prefix}-{n}-{i}" for i in ids], wait="copied")
                    self.blocks += len(ids)
                except KvswapError:
                    time.sleep(0.002)
                n += 1


def _latency_under_stream(endpoint: str, c: Client, token: str, keys: list[str], batches: list[list[int]],
                          tag: str, samples: int) -> "StreamLatency":
    """ping and 1,000-key lookup latency of the daemon while another process streams swap_outs
    at it, and of the echo floor (latency_floor.py) answering the same requests from the same
    client, timed alternately in the same window: for each sample, one daemon ping, one echo
    ping, one daemon lookup, one echo lookup, which of the two goes first alternating, so a
    stall of the machine falls on both alike."""
    lookup_keys = (keys * (1000 // len(keys) + 1))[:1000]
    out = StreamLatency()
    with EchoServer() as echo, Client(echo.endpoint, timeout=60) as e:
        e.wait_ready(30)
        stream = StreamProcess(endpoint, len(keys), len(batches[0]), f"s{tag}", token).start()
        t0 = time.perf_counter()
        try:
            for n in range(samples):
                pair = ((c, out.pings, out.lookups), (e, out.echo_pings, out.echo_lookups))
                for client, pings, _ in pair[:: 1 if n % 2 == 0 else -1]:
                    t = time.perf_counter()
                    client.ping()
                    pings.append(time.perf_counter() - t)
                for client, _, lookups in pair[:: -1 if n % 2 == 0 else 1]:
                    t = time.perf_counter()
                    hits = client.lookup(lookup_keys)
                    lookups.append(time.perf_counter() - t)
                    if hits != len(lookup_keys):
                        raise RuntimeError(f"lookup found {hits} of {len(lookup_keys)} stored keys")
        finally:
            out.seconds = time.perf_counter() - t0
            stream.stop()
    out.streamed = stream.blocks
    c.flush()
    return out


@dataclass
class StreamLatency:
    """Seconds per request, daemon and echo floor, from one window under one stream."""

    pings: list[float] = field(default_factory=list)
    lookups: list[float] = field(default_factory=list)
    echo_pings: list[float] = field(default_factory=list)
    echo_lookups: list[float] = field(default_factory=list)
    streamed: int = 0
    seconds: float = 0.0


#: Rows the block-size sweep plots: (result name or baseline key, style, legend label).
SWEEP_SERIES = (("swap_out persisted", "o-", "swap_out persisted"), ("raw_write", "o--", "raw write (same threads)"),
                ("swap_in cold", "s-", "swap_in cold"), ("raw_read", "s--", "raw read (same threads)"),
                ("swap_out copied", "^-", "swap_out copied"))


def plot_sweep(path: str, preset: str, block_sizes: list[int], blocks_bytes: int, storage_dir: str | None,
               daemon_args: tuple[str, ...], say: Callable[[str], None], repeats: int = 3,
               drop_caches: bool = False) -> list[dict[str, Any]]:
    """Throughput vs record size: ``repeats`` benches per block size (tokens), plotted to
    ``path`` as mean with min-max error bars. The caller checks matplotlib is importable."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import presets

    points: list[dict[str, Any]] = []
    base = dict(presets.PRESETS[preset][1])
    fsync = "none"
    for tokens in block_sizes:
        name = f"{preset}-bs{tokens}"
        presets.PRESETS[name] = (f"{preset} with {tokens}-token blocks", {**base, "block_size": tokens})
        record = preset_layout(name, 1).record_bytes
        blocks = max(16, blocks_bytes // record)
        runs: dict[str, list[float]] = {key: [] for key, _, _ in SWEEP_SERIES}
        for rep in range(repeats):
            say(f"sweep: {tokens}-token blocks ({record / 2**20:.2f} MiB records), {blocks} blocks, "
                f"run {rep + 1}/{repeats}")
            report = run_bench(name, blocks, 32, storage_dir, daemon_args, idle_s=0.5, latency_samples=20,
                               drop_caches=drop_caches)
            fsync = report.fsync
            results = {r.name: r for r in report.rows}
            for key in ("swap_out persisted", "swap_out copied"):
                runs[key].append(results[key].value)
            runs["raw_write"].append(results["swap_out persisted"].baseline_value)
            if "swap_in cold" in results:
                runs["swap_in cold"].append(results["swap_in cold"].value)
                runs["raw_read"].append(results["swap_in cold"].baseline_value)
        points.append({"block_tokens": tokens, "record_mib": record / 2**20, "blocks": blocks, "runs": runs})
    for tokens in block_sizes:  # leave the table of presets as it was
        presets.PRESETS.pop(f"{preset}-bs{tokens}", None)
    x = [p["record_mib"] for p in points]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for key, style, label in SWEEP_SERIES:
        series = [p["runs"][key] for p in points]
        if not all(series):
            continue  # not measured (cold reads without O_DIRECT or --drop-caches)
        mean = [statistics.fmean(v) for v in series]
        err = [[m - min(v) for m, v in zip(mean, series)], [max(v) - m for m, v in zip(mean, series)]]
        ax.errorbar(x, mean, yerr=err, fmt=style, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("record size (MiB per block)")
    ax.set_ylabel("GB/s (mean of runs; bars: min to max)")
    sizes = ", ".join(f"{p['blocks']}" for p in points)
    ax.set_title(f"kvswap throughput vs block size ({preset} preset, fsync {fsync}, {repeats} runs per point)\n"
                 f"{machine()}; blocks per run: {sizes}", fontsize=9)
    ax.grid(True, alpha=0.3)
    # Outside the axes, so it never covers a data point.
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return points
