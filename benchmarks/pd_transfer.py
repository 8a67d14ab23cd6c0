"""Prefill-to-decode transfer between two kvswapds on loopback, next to the transfer engine alone
and a memcpy of the same bytes, in the same run.

    python benchmarks/pd_transfer.py [--records 64] [--record-mib 1] [--transport auto|mooncake|inline]
                                     [--repeat 3] [--out pd_transfer.json] [--smoke]

Two daemons, A (prefill) and B (decode), each with peer transfer on and an engine cache
registered. Per round, ``--records`` records of fresh keys are swapped out on A (persisted; not
timed), then B's ``lookup(keys, peer=A)`` is timed: the wait for A's answer, A's copy into its
export buffer, the transfer (a transfer-engine read, or the bytes inline in the reply), B's checks
and B's copy into staging. After the rounds B loads the last round's records with a swap_in and
the bytes are compared with A's engine blocks.

Baselines, same sizes: ``te_alone`` is two Mooncake transfer engines in this process, one reading
the records from the other (one batched read of ``--records`` pieces of a record each), and
``memcpy`` a numpy copy of the same bytes. Each is the best of ``--repeat`` rounds (best, not
mean: on a shared machine slow rounds measure the neighbours). Progress goes to stderr; the
report (JSON) to stdout and to ``--out``. ``--smoke`` is 8 records of 256 KiB, 2 rounds: seconds,
for CI (tests/test_peer_bench.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvswap.protocol import CacheLayout, Client, HostKVCache
from kvswap.testing.daemon_process import DaemonProcess, free_port

MiB = 1 << 20
#: The layout's shape apart from the block size: 8 layers of K and V, 8 heads of 128 bf16
#: channels, so a record is 32 KiB per token of block.
LAYERS, HEADS, HEAD_DIM, BYTES_PER_TOKEN = 8, 8, 128, 2 * 8 * 8 * 128 * 2


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def te_available() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


def layout_for(records: int, record_bytes: int) -> CacheLayout:
    return CacheLayout("pd-bench", num_layers=LAYERS, num_blocks=records, block_size=record_bytes // BYTES_PER_TOKEN,
                       num_kv_heads=HEADS, head_dim=HEAD_DIM)


def daemon(root: Path, name: str, transport: str, total: int) -> DaemonProcess:
    port = free_port()
    buffer = max(64 * MiB, total + 4 * MiB)  # one round trip for the whole transfer
    return DaemonProcess(root / name, port, free_port(), extra_args=[
        "--peer-address", f"tcp://127.0.0.1:{port}", "--peer-transport", transport,
        "--peer-export-bytes", str(buffer), "--host-tier-bytes", str(2 * total + 64 * MiB),
        "--write-staging-bytes", str(total + 16 * MiB), "--log-level", "warning"]).start()


def direct(records: int, record_bytes: int, transport: str, repeat: int) -> dict[str, Any]:
    layout = layout_for(records, record_bytes)
    total = records * record_bytes
    with tempfile.TemporaryDirectory() as tmp:
        a = daemon(Path(tmp), "prefill", transport, total)
        b = daemon(Path(tmp), "decode", transport, total)
        try:
            with HostKVCache.create(layout) as a_cache, HostKVCache.create(layout) as b_cache, \
                    Client(a.endpoint, timeout=120) as pa, Client(b.endpoint, timeout=120) as pb:
                a_cache.fill_random(1)
                pa.register(a_cache)
                pb.register(b_cache)
                chosen = pb.hello()["peer"]["transport"]
                best = float("inf")
                keys: list[str] = []
                for r in range(repeat):
                    keys = [f"r{r}-{i}" for i in range(records)]
                    pa.swap_out(list(range(records)), keys, wait="persisted")
                    started = time.perf_counter()
                    hits = pb.lookup(keys, peer=f"tcp://127.0.0.1:{a.port}")
                    seconds = time.perf_counter() - started
                    if hits != records:
                        raise SystemExit(f"round {r}: {hits} of {records} records pulled")
                    best = min(best, seconds)
                    say(f"  direct ({chosen}) round {r + 1}/{repeat}: {total / seconds / 1e9:.2f} GB/s")
                loaded = pb.swap_in(keys, list(range(records)))
                same = loaded.loaded == records and all(
                    b_cache.block_record(i) == a_cache.block_record(i) for i in range(records))
                if not same:
                    raise SystemExit("the decode daemon's records differ from the prefill engine's blocks")
        finally:
            a.stop()
            b.stop()
    return {"records": records, "bytes": total, "seconds": best, "transport": chosen, "bytes_checked": True}


def te_alone(records: int, record_bytes: int, repeat: int) -> dict[str, Any] | None:
    if not te_available():
        return None
    from mooncake.engine import TransferEngine

    total = records * record_bytes
    exporter, importer = TransferEngine(), TransferEngine()
    for engine in (exporter, importer):
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            return None
    src = np.random.default_rng(2).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    exporter.register_memory(src.ctypes.data, total)
    importer.register_memory(dst.ctypes.data, total)
    segment = f"127.0.0.1:{exporter.get_rpc_port()}"
    offsets = [i * record_bytes for i in range(records)]
    best = float("inf")
    for r in range(repeat):
        started = time.perf_counter()
        rc = importer.batch_transfer_sync_read(segment, [dst.ctypes.data + o for o in offsets],
                                               [src.ctypes.data + o for o in offsets], [record_bytes] * records)
        seconds = time.perf_counter() - started
        if rc != 0 or not np.array_equal(src, dst):
            raise SystemExit(f"transfer engine read failed (code {rc})")
        best = min(best, seconds)
        dst[:] = 0
        say(f"  te_alone round {r + 1}/{repeat}: {total / seconds / 1e9:.2f} GB/s")
    importer.unregister_memory(dst.ctypes.data)
    exporter.unregister_memory(src.ctypes.data)
    return {"bytes": total, "seconds": best}


def memcpy(total: int, repeat: int) -> dict[str, Any]:
    src = np.random.default_rng(3).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    dst[:] = src  # fault the pages in first: the daemons' buffers are warm too
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return {"bytes": total, "seconds": best}


def rate(row: dict[str, Any] | None) -> float | None:
    return row["bytes"] / row["seconds"] / 1e9 if row and row["seconds"] > 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--record-mib", type=float, default=1.0)
    parser.add_argument("--transport", choices=["auto", "mooncake", "inline"], default="auto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="8 records of 256 KiB, 2 rounds (seconds, for CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.records, args.record_mib, args.repeat = 8, 0.25, 2
    record_bytes = max(1, round(args.record_mib * MiB / BYTES_PER_TOKEN)) * BYTES_PER_TOKEN
    total = args.records * record_bytes
    say(f"pd_transfer: {args.records} records of {record_bytes} bytes ({total / MiB:.1f} MiB), "
        f"transport {args.transport}, best of {args.repeat}")
    report: dict[str, Any] = {"records": args.records, "record_bytes": record_bytes,
                              "direct": direct(args.records, record_bytes, args.transport, args.repeat),
                              "te_alone": te_alone(args.records, record_bytes, args.repeat),
                              "memcpy": memcpy(total, args.repeat)}
    d, te, mc = rate(report["direct"]), rate(report["te_alone"]), rate(report["memcpy"])
    report["gbps"] = {"direct": d, "te_alone": te, "memcpy": mc}
    report["ratios"] = {"direct_over_te_alone": d / te if d and te else None,
                        "direct_over_memcpy": d / mc if d and mc else None}
    say(f"direct {d:.2f} GB/s ({report['direct']['transport']}); transfer engine alone "
        f"{te:.2f} GB/s; memcpy {mc:.2f} GB/s" if te else f"direct {d:.2f} GB/s; memcpy {mc:.2f} GB/s "
        "(no transfer engine here)")
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
