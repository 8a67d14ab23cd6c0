"""Remote-tier throughput over loopback: kvswap's Redis and Mooncake adapters next to each
store's own client doing plain put/get of values of the same size, in the same run.

    python benchmarks/remote_throughput.py [--sizes 1MiB,4MiB] [--mib 128] [--batch 8] [--repeat 3]
                                           [--only redis,mooncake] [--redis-url URL] [--mooncake-url URL]

Without URLs it starts ``redis-server`` and ``mooncake_master`` on free loopback ports (the test
helpers in tests/remote_servers.py) and stops them at the end. Rows per store and value size:

- kvswap ``put_many``/``get_many`` (batches of ``--batch``) and ``put``/``get_into`` (one per call),
  verifying every record (header + xxh3 checksum) like the daemon does;
- for Mooncake, the same with the payload in memory registered with the client (the daemon's
  staging pool): header and payload move without a copy;
- the store's own client: redis-py ``SET``/``GET`` (and pipelined), ``redis-benchmark -d SIZE
  -t set,get`` with one connection and with its default 50; Mooncake ``put``/``get`` (copying)
  and ``batch_put_from``/``batch_get_into`` on registered memory (zero-copy).

The ratio column is each row over the store's plain single-call client row of the same op.
Numbers, not assertions; on a 2-core machine the server and the client share the cores.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvswap.backends import record
from kvswap.backends.base import GetStatus
from kvswap.backends.remote import open_remote, parse_remote_url

MiB = 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().lower()
    for unit, mult in (("mib", MiB), ("mb", MiB), ("kib", 1024), ("kb", 1024)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def best_of(repeat: int, nbytes: int, put: Callable[[], object], get: Callable[[], object],
            cleanup: Callable[[], object]) -> dict[str, float]:
    """Best put and best get throughput over ``repeat`` rounds of put-all, get-all, delete-all
    (best, not mean: on a shared 2-core machine the slow rounds measure the neighbours)."""
    t_put = t_get = float("inf")
    for _ in range(repeat):
        t_put = min(t_put, timed(put))
        t_get = min(t_get, timed(get))
        cleanup()
    return {"put": gbps(nbytes, t_put), "get": gbps(nbytes, t_get)}


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str, float, float | None]] = []

    def add(self, store: str, size: int, op: str, how: str, value_gbps: float, baseline: float | None) -> None:
        ratio = value_gbps / baseline if baseline else None
        self.rows.append((store, f"{size // MiB} MiB", op, how, value_gbps, ratio))
        print(f"  {store:8} {size // MiB} MiB {op:4} {how:44} {value_gbps:7.2f} GB/s"
              + (f"  x{ratio:.2f}" if ratio is not None else ""), flush=True)

    def render(self) -> str:
        lines = ["| store | value | op | how | GB/s | vs plain client |", "|---|---|---|---|---:|---:|"]
        for store, size, op, how, value, ratio in self.rows:
            lines.append(f"| {store} | {size} | {op} | {how} | {value:.2f} | "
                         + (f"{ratio:.2f}" if ratio is not None else "baseline") + " |")
        return "\n".join(lines)


def kvswap_rows(table: Table, name: str, backend, size: int, count: int, batch: int, repeat: int,
                baseline: dict[str, float], staging: np.ndarray | None = None, how_suffix: str = "") -> None:
    """put_many/get_many and put/get_into of ``count`` records whose stored value is ``size``."""
    record_bytes = size - record.header_len_for(size)  # so header + payload == size, like the raw rows
    store = backend.open_store(secrets.token_hex(16), {}, record_bytes)
    rng = np.random.default_rng(1)
    if staging is None:
        src = [memoryview(rng.integers(0, 256, record_bytes, dtype=np.uint8).tobytes()) for _ in range(batch)]
        outs = [memoryview(bytearray(record_bytes)) for _ in range(batch)]
    else:
        view = memoryview(staging)
        staging[: batch * record_bytes] = rng.integers(0, 256, batch * record_bytes, dtype=np.uint8)
        src = [view[i * record_bytes:(i + 1) * record_bytes] for i in range(batch)]
        outs = [view[(batch + i) * record_bytes:(batch + i + 1) * record_bytes] for i in range(batch)]
    total = count * size

    for label, per_call in ((f"kvswap put_many/get_many (batch {batch})", batch), ("kvswap put/get_into", 1)):
        keys = [f"k{i}" for i in range(count)]

        def put_all() -> None:
            for s in range(0, count, per_call):
                store.put_many([(k, src[(s + j) % batch]) for j, k in enumerate(keys[s:s + per_call])])

        def get_all() -> None:
            for s in range(0, count, per_call):
                chunk = keys[s:s + per_call]
                got = store.get_many(chunk, outs[:len(chunk)])
                assert all(st is GetStatus.LOADED for st in got), got

        got = best_of(repeat, total, put_all, get_all, store.clear)
        table.add(name, size, "put", label + how_suffix, got["put"], baseline["put"])
        table.add(name, size, "get", label + how_suffix, got["get"], baseline["get"])
    assert bytes(outs[0]) == bytes(src[(count - 1) % batch])  # the last record read back is the last written
    store.close()


def redis_rows(table: Table, url: str, sizes: list[int], mib: int, batch: int, repeat: int) -> None:
    import redis

    spec = parse_remote_url(url)
    raw = redis.Redis(host=spec.host, port=spec.port, db=spec.db, password=spec.password, socket_timeout=30)
    backend = open_remote(url)
    for size in sizes:
        count = max(batch, mib * MiB // size)
        value = os.urandom(size)
        keys = [f"bench/raw/{i}" for i in range(count)]

        def raw_put() -> None:
            for k in keys:
                raw.set(k, value)

        def raw_get() -> None:
            for k in keys:
                assert len(raw.get(k)) == size

        def drop() -> None:
            raw.delete(*keys)
        raw_put()  # warm-up: the server's allocator and the sockets
        drop()
        baseline = best_of(repeat, count * size, raw_put, raw_get, drop)
        table.add("redis", size, "put", "redis-py SET (one per call)", baseline["put"], None)
        table.add("redis", size, "get", "redis-py GET (one per call)", baseline["get"], None)

        def pipe(op: str) -> None:
            for s in range(0, count, batch):
                p = raw.pipeline(transaction=False)
                for k in keys[s:s + batch]:
                    p.set(k, value) if op == "set" else p.get(k)
                p.execute()
        got = best_of(repeat, count * size, lambda: pipe("set"), lambda: pipe("get"), drop)
        table.add("redis", size, "put", f"redis-py pipelined SET (batch {batch})", got["put"], baseline["put"])
        table.add("redis", size, "get", f"redis-py pipelined GET (batch {batch})", got["get"], baseline["get"])
        for clients in (1, 50):
            rps = redis_benchmark(spec.host, spec.port, size, count, clients)
            for op in ("put", "get"):
                if op in rps:
                    table.add("redis", size, op, f"redis-benchmark -d {size} -c {clients}", rps[op] * size / 1e9,
                              baseline[op])
        kvswap_rows(table, "redis", backend, size, count, batch, repeat, baseline)
    backend.close()


def redis_benchmark(host: str, port: int, size: int, count: int, clients: int) -> dict[str, float]:
    """Requests per second of SET and GET from ``redis-benchmark --csv``."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        print("  (redis-benchmark not installed: skipped)")
        return {}
    out = subprocess.run([exe, "-h", host, "-p", str(port), "-d", str(size), "-t", "set,get", "-n", str(count),
                          "-c", str(clients), "--csv"], capture_output=True, text=True, timeout=600, check=True).stdout
    rps: dict[str, float] = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            rps["put" if cells[0] == "SET" else "get"] = float(cells[1])
    return rps


def warm_pool(client, segment_bytes: int) -> None:
    """Fill the pool once and empty it, so no timed row pays for first-touch page faults of
    segment memory that an earlier row did not touch."""
    value = b"\x5a" * (4 * MiB)
    keys = [f"bench/warm/{i}" for i in range(int(segment_bytes * 0.85) // len(value))]
    for k in keys:
        client.put(k, value)
    client.batch_remove(keys, True)


def mooncake_rows(table: Table, url: str, sizes: list[int], mib: int, batch: int, repeat: int) -> None:
    backend = open_remote(url)
    segment_bytes = parse_remote_url(url).segment
    assert backend.probe(), f"mooncake master unreachable: {backend.gate.last_error}"
    client = backend._client  # the store's own client, for the plain rows
    staging = np.zeros(2 * batch * max(sizes), dtype=np.uint8)  # stands in for the daemon's staging pool
    backend.register_buffer(staging)
    warm_pool(client, segment_bytes)
    for size in sizes:
        count = max(batch, mib * MiB // size)
        value = os.urandom(size)
        keys = [f"bench/raw/{size}/{i}" for i in range(count)]

        def raw_put() -> None:
            for k in keys:
                assert client.put(k, value) == 0

        def raw_get() -> None:
            for k in keys:
                assert len(client.get(k)) == size

        def drop() -> None:
            client.batch_remove(keys, True)  # force: reads hold a lease for seconds
        baseline = best_of(repeat, count * size, raw_put, raw_get, drop)
        table.add("mooncake", size, "put", "MooncakeDistributedStore put (copying)", baseline["put"], None)
        table.add("mooncake", size, "get", "MooncakeDistributedStore get (copying)", baseline["get"], None)

        base = int(staging.ctypes.data)
        staging[: batch * size] = np.frombuffer(value * batch, dtype=np.uint8)

        def zc(op: str) -> None:
            for s in range(0, count, batch):
                chunk = keys[s:s + batch]
                if op == "put":
                    codes = client.batch_put_from(chunk, [base + i * size for i in range(len(chunk))], [size] * len(chunk))
                    assert all(c == 0 for c in codes), codes
                else:
                    codes = client.batch_get_into(chunk, [base + (batch + i) * size for i in range(len(chunk))],
                                                  [size] * len(chunk))
                    assert all(c == size for c in codes), codes
        got = best_of(repeat, count * size, lambda: zc("put"), lambda: zc("get"), drop)
        table.add("mooncake", size, "put", f"batch_put_from, registered (batch {batch})", got["put"], baseline["put"])
        table.add("mooncake", size, "get", f"batch_get_into, registered (batch {batch})", got["get"], baseline["get"])
        kvswap_rows(table, "mooncake", backend, size, count, batch, repeat, baseline)
        kvswap_rows(table, "mooncake", backend, size, count, batch, repeat, baseline, staging, ", registered staging")
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1MiB,4MiB", help="stored value sizes (header + payload)")
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="rounds per row; the best is reported")
    parser.add_argument("--only", default="redis,mooncake")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--mooncake-url", default="")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    only = set(args.only.split(","))
    table = Table()
    servers = []
    with tempfile.TemporaryDirectory(prefix="kvswap-remote-bench-") as tmp:
        try:
            if "redis" in only:
                url = args.redis_url
                if not url:
                    from kvswap.testing.remote_servers import RedisServer
                    server = RedisServer(Path(tmp)).start()
                    servers.append(server)
                    url = server.url + "?timeout=30"
                print(f"redis: {parse_remote_url(url).redacted()}")
                redis_rows(table, url, sizes, args.mib, args.batch, args.repeat)
            if "mooncake" in only:
                url = args.mooncake_url
                if not url:
                    from kvswap.testing.remote_servers import MooncakeMaster
                    master = MooncakeMaster(Path(tmp)).start()
                    servers.append(master)
                    segment = 2 * args.mib + 256
                    url = master.url(segment=f"{segment}MiB", buffer=f"{max(64, 2 * max(sizes) // MiB)}MiB", timeout=30)
                print(f"mooncake: {parse_remote_url(url).redacted()}")
                mooncake_rows(table, url, sizes, args.mib, args.batch, args.repeat)
        finally:
            for server in servers:
                server.kill()
    print()
    print(table.render())


if __name__ == "__main__":
    main()
