"""Many engines' worth of mixed swap_out / swap_in / lookup against one daemon, checking every
answer and every byte. Used by tests/test_load.py (10 s in CI) and benchmarks/load.py.

One daemon has one registered cache, so all clients share one HostKVCache and each owns a
slice of its blocks: the first half of a slice is where it swaps out from, the second half
where it swaps in to. Block contents are a pure function of the key, so any key a client
stored can be checked byte for byte whenever it is loaded. Each client counts the requests
it sent and every reply that came off its socket, by id, to catch lost or duplicated replies.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import xxhash

from kvswap.protocol import Busy, CacheLayout, Client, HostKVCache, KvswapError, Timeout
from kvswap.protocol import messages as m

LAYOUT = CacheLayout("load-test", num_layers=4, num_blocks=256, block_size=16, num_kv_heads=2, head_dim=64,
                     dtype="float16")  # 32 KiB records
OPS = ("swap_out", "swap_in", "lookup")


def content_for(key: str, nbytes: int) -> np.ndarray:
    return np.random.default_rng(xxhash.xxh64_intdigest(key.encode())).integers(0, 256, nbytes, dtype=np.uint8)


def write_block(cache: HostKVCache, block: int, record: np.ndarray) -> None:
    """Put a record's bytes into ``block`` of every region (the inverse of block_record)."""
    for region in cache.layout.regions:
        chunk = record[region.record_offset : region.record_offset + region.block_bytes]
        cache.arrays[region.name][block].view(np.uint8).reshape(-1)[:] = chunk


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (peak RSS) of a process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0])
    return out


class CountingClient(Client):
    """A Client that counts every reply arriving on its socket by id, including any the
    ordinary client would drop (duplicates, replies to nobody)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[int] = []
        self.received: Counter = Counter()

    def send(self, *args: Any, **kwargs: Any) -> int:
        request_id = super().send(*args, **kwargs)
        self.sent.append(request_id)
        return request_id

    def _take(self, frame: bytes) -> None:
        try:
            self.received[m.decode_reply(frame).id] += 1
        except KvswapError:
            self.received["<undecodable>"] += 1
        super()._take(frame)

    def drain(self) -> None:
        """Read whatever else has arrived (a duplicate sent beside its answer). Replies the
        daemon sent but that never arrived are caught by comparing its own count of answers
        (``LoadReport.daemon_answers``) with what the clients sent, not by waiting here."""
        while self._sock.poll(0):
            self._take(self._sock.recv())


@dataclass
class WorkerResult:
    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: Counter = field(default_factory=Counter)  # error code -> count (busy included)
    verified_blocks: int = 0
    mismatched_blocks: int = 0
    wrong_answers: list[str] = field(default_factory=list)
    sent: int = 0
    lost: int = 0  # requests with no reply
    duplicated: int = 0  # replies beyond the first for one id
    strays: int = 0  # replies to ids this client never sent


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    workers: list[WorkerResult]
    hung_workers: int
    rss_kib_start: int
    rss_kib_end: int
    peak_rss_kib: int
    #: Requests the clients sent during the run (the admin's flush included), and the answers
    #: the daemon says it sent in the same time (-1: not measured). Each request has exactly one
    #: answer, so the two are equal; a duplicate makes the daemon's count larger.
    requests_sent: int = 0
    daemon_answers: int = -1

    def total(self, name: str) -> int:
        return sum(getattr(w, name) for w in self.workers)

    @property
    def errors(self) -> Counter:
        return sum((w.errors for w in self.workers), Counter())

    @property
    def wrong_answers(self) -> list[str]:
        return [a for w in self.workers for a in w.wrong_answers]

    def latency_ms(self, op: str) -> dict[str, float]:
        values = np.array([v for w in self.workers for v in w.latencies[op]]) * 1000
        if values.size == 0:
            return {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        return {"count": int(values.size), "p50": float(np.percentile(values, 50)),
                "p99": float(np.percentile(values, 99)), "max": float(values.max())}

    @property
    def ok(self) -> bool:
        return (self.hung_workers == 0 and self.total("lost") == 0 and self.total("duplicated") == 0
                and self.total("strays") == 0 and self.total("mismatched_blocks") == 0 and not self.wrong_answers
                and set(self.errors) <= {"busy"})

    def summary(self) -> str:
        lines = [f"load: {self.clients} clients for {self.duration_s:.1f} s: {self.total('sent')} requests sent, "
                 f"{self.total('lost')} lost, {self.total('duplicated')} duplicated, {self.total('strays')} stray; "
                 f"{self.total('verified_blocks')} blocks verified, {self.total('mismatched_blocks')} mismatched; "
                 f"errors {dict(self.errors) or '{}'}; hung clients {self.hung_workers}"]
        for op in OPS:
            lat = self.latency_ms(op)
            lines.append(f"  {op:9s} n={lat['count']:6d}  p50={lat['p50']:7.2f} ms  p99={lat['p99']:7.2f} ms  "
                         f"max={lat['max']:7.2f} ms  ({lat['count'] / self.duration_s:.0f}/s)")
        lines.append(f"  daemon RSS: {self.rss_kib_start / 1024:.1f} MiB after warm-up, {self.rss_kib_end / 1024:.1f} MiB "
                     f"at the end, peak (VmHWM) {self.peak_rss_kib / 1024:.1f} MiB")
        return "\n".join(lines)


class Worker:
    def __init__(self, index: int, clients: int, endpoint: str, cache: HostKVCache, stop: threading.Event,
                 seed: int, max_batch: int = 8) -> None:
        per_client = cache.layout.num_blocks // clients
        assert per_client >= 2, "too many clients for the cache's blocks"
        base = index * per_client
        half = per_client // 2
        self.src = list(range(base, base + half))
        self.dst = list(range(base + half, base + per_client))
        self.index = index
        self.endpoint = endpoint
        self.cache = cache
        self.stop = stop
        self.rng = np.random.default_rng(seed)
        self.max_batch = max(1, min(max_batch, len(self.src), len(self.dst)))
        self.result = WorkerResult()
        self.stored: list[str] = []
        self.counter = 0
        self.record_bytes = cache.layout.record_bytes

    def run(self) -> None:
        client = CountingClient(self.endpoint, timeout=30)
        with client:
            while not self.stop.is_set():
                op = "swap_out" if not self.stored else str(self.rng.choice(OPS, p=[0.4, 0.4, 0.2]))
                started = time.perf_counter()
                try:
                    getattr(self, op)(client)
                except Busy:
                    self.result.errors["busy"] += 1
                    time.sleep(0.005)
                    continue
                except Timeout:
                    self.result.errors["timeout"] += 1
                    continue
                except KvswapError as exc:
                    self.result.errors[exc.code] += 1
                    continue
                self.result.latencies[op].append(time.perf_counter() - started)
            client.drain()
            self._count_replies(client)

    def _count_replies(self, client: CountingClient) -> None:
        sent = set(client.sent)
        self.result.sent = len(client.sent)
        self.result.lost = sum(1 for i in sent if client.received[i] == 0)
        self.result.duplicated = sum(n - 1 for i, n in client.received.items() if i in sent and n > 1)
        self.result.strays = sum(n for i, n in client.received.items() if i not in sent)

    def _wrong(self, what: str) -> None:
        self.result.wrong_answers.append(f"client {self.index}: {what}")

    def swap_out(self, client: CountingClient) -> None:
        count = int(self.rng.integers(1, self.max_batch + 1))
        blocks = self.src[:count]
        keys = [f"c{self.index}-{self.counter + i}" for i in range(count)]
        for block, key in zip(blocks, keys):
            write_block(self.cache, block, content_for(key, self.record_bytes))
        wait = "persisted" if self.rng.random() < 0.3 else "copied"
        result = client.swap_out(blocks, keys, wait=wait)
        self.counter += count  # a refused swap_out (busy) raised above and reuses these keys
        want = "stored" if wait == "persisted" else "queued"
        if any(s not in (want, "stored") for s in result.status):
            self._wrong(f"swap_out {keys} -> {result.status}")
            return
        self.stored.extend(keys)

    def swap_in(self, client: CountingClient) -> None:
        count = int(self.rng.integers(1, min(self.max_batch, len(self.stored)) + 1))
        keys = [str(k) for k in self.rng.choice(self.stored, size=count, replace=False)]
        blocks = self.dst[:count]
        self.cache.zero_blocks(blocks)
        result = client.swap_in(keys, blocks)
        if result.loaded != count:
            self._wrong(f"swap_in {keys} -> loaded {result.loaded}, {result.status}")
            return
        for block, key in zip(blocks, keys):
            got = np.frombuffer(self.cache.block_record(block), dtype=np.uint8)
            if np.array_equal(got, content_for(key, self.record_bytes)):
                self.result.verified_blocks += 1
            else:
                self.result.mismatched_blocks += 1

    def lookup(self, client: CountingClient) -> None:
        """Two lookups pipelined on one socket: a stored chain, and the same chain cut by a
        key never stored. Replies are collected in reverse order."""
        count = int(self.rng.integers(1, min(self.max_batch, len(self.stored)) + 1))
        chain = [str(k) for k in self.rng.choice(self.stored, size=count, replace=False)]
        broken = chain[: count // 2] + [f"c{self.index}-never"] + chain[count // 2 :]
        first = client.send(m.Lookup, {"keys": tuple(chain)})
        second = client.send(m.Lookup, {"keys": tuple(broken)})
        hits_broken = client.wait(second)["hits"]
        hits = client.wait(first)["hits"]
        if hits != count or hits_broken != count // 2:
            self._wrong(f"lookup of {count} stored keys -> {hits}, cut at {count // 2} -> {hits_broken}")


def run_load(endpoint: str, daemon_pid: int, clients: int = 16, duration_s: float = 10.0, seed: int = 0,
             layout: CacheLayout = LAYOUT, report_every_s: float = 0.0, say=print,
             answers: Callable[[], float] | None = None) -> LoadReport:
    """Register one shared cache, run ``clients`` workers for ``duration_s``, check everything.
    ``answers`` is the daemon's count of answers sent (``DaemonProcess.answers``)."""
    with HostKVCache.create(layout) as cache, Client(endpoint, timeout=30) as admin:
        admin.wait_ready(30)
        admin.register(cache)
        answers_before = answers() if answers is not None else 0.0
        stop = threading.Event()
        workers = [Worker(i, clients, endpoint, cache, stop, seed * 1000 + i) for i in range(clients)]
        threads = [threading.Thread(target=w.run, name=f"load-{i}", daemon=True) for i, w in enumerate(workers)]
        rss_start = proc_status(daemon_pid)["VmRSS"]
        started = time.monotonic()
        for t in threads:
            t.start()
        next_report = started + report_every_s if report_every_s else float("inf")
        while (now := time.monotonic()) < started + duration_s:
            time.sleep(min(0.2, started + duration_s - now))
            if time.monotonic() >= next_report:
                rss = proc_status(daemon_pid)
                say(f"  t={time.monotonic() - started:5.1f} s  daemon RSS {rss['VmRSS'] / 1024:.1f} MiB  "
                    f"requests so far ~{sum(len(w.result.latencies[o]) for w in workers for o in OPS)}")
                next_report += report_every_s
        stop.set()
        elapsed = time.monotonic() - started
        for t in threads:
            t.join(60)  # a worker still running now is stuck on an answer that never came
        admin.flush()
        sent = sum(w.result.sent for w in workers) + 1  # + the flush
        daemon_answers = -1
        if answers is not None:
            deadline = time.monotonic() + 10
            # Every request was answered (the clients waited for each), so the count is final
            # once the scrape catches up with the last answer.
            while (daemon_answers := round(answers() - answers_before)) < sent and time.monotonic() < deadline:
                time.sleep(0.05)
        status = proc_status(daemon_pid)
        return LoadReport(clients, elapsed, [w.result for w in workers], sum(t.is_alive() for t in threads),
                          rss_start, status["VmRSS"], status["VmHWM"], sent, daemon_answers)
