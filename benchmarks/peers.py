"""kvswap side by side with two peers, in one run, on the same disk: the same blocks (default
500 x 2 MiB) written, read cold and read hot through

- **kvswap**: a real daemon, its host pool warmed by two untimed passes (swap_out, delete);
  write = swap_out answered "persisted"; cold = a second daemon
  on the same directory with no RAM tier and O_DIRECT reads; hot = swap_in right after the
  write from the first daemon (its RAM tier where it has one, the default);
- **FileStore method**: the per-block file method published in FastDeploy PR #6188
  (PaddlePaddle/FastDeploy, "FileStore" KV-cache storage): one ``paddle.save`` file per
  block, fsynced; a read is ``paddle.load``, ``.numpy().tobytes()`` and a memmove into the
  block. Re-implemented here from that description (no code of the PR is used), one block at
  a time as the method does; cold = its files dropped from the page cache with
  ``posix_fadvise(DONTNEED)`` (only those files), hot = read again;
- **LMCache** local disk backend, where ``pip install lmcache`` worked in a separate
  environment (``--lmcache-python``, default /work/venv-lmcache/bin/python): see
  ``peers_lmcache.py`` for what it times.

Every read ends in the engine's memory (kvswap: the registered shared-memory cache; the
others: a numpy array standing for it), and each peer's bytes are checked after the reads.

    python benchmarks/peers.py [--blocks 500] [--block-mib 2] [--storage-dir .]
        [--lmcache-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvswap.daemon.tools.bench import machine
from kvswap.daemon.tools.local_daemon import LocalDaemon
from kvswap.protocol import CacheLayout, Client, HostKVCache

HERE = os.path.dirname(os.path.abspath(__file__))


def layout_of(blocks: int, block_mib: int) -> CacheLayout:
    """A layout whose record is ``block_mib`` MiB: K and V of ``4 * block_mib`` layers, 64
    tokens, 8 heads of 128, bf16 (each layer-half is 128 KiB)."""
    return CacheLayout(model_id=f"peers-{block_mib}mib", num_layers=4 * block_mib, num_blocks=blocks, block_size=64,
                       num_kv_heads=8, head_dim=128, dtype="bfloat16")


def drop_files(paths: list[str]) -> None:
    """Evict these files (and only these) from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- kvswap ---------------------------------------------------------------------------------


def run_kvswap(directory: str, layout: CacheLayout, daemon_args: list[str]) -> dict:
    blocks = layout.num_blocks
    batches = [list(range(s, min(s + 32, blocks))) for s in range(0, blocks, 32)]
    keys = [f"p-{i}" for i in range(blocks)]
    with HostKVCache.create(layout) as cache:
        cache.fill_random(11)
        expected = [cache.block_record(i) for i in (0, blocks // 2, blocks - 1)]

        def swap_in_all(c: Client) -> float:
            t = time.perf_counter()
            for ids in batches:
                r = c.swap_in([keys[i] for i in ids], ids)
                if r.loaded != len(ids):
                    raise RuntimeError(f"kvswap loaded {r.loaded} of {len(ids)}: {r.status}")
            return time.perf_counter() - t

        with LocalDaemon(directory, ("--direct-io", "auto", *daemon_args)) as daemon, \
                Client(daemon.endpoint, timeout=300) as c:
            c.register(cache)
            host_tier = "host" in c.stats()["tiers"]
            # Untimed warm-up, as each peer's memory is set up before its clock starts (LMCache
            # allocates and touches its buffer at start-up): a new daemon faults its pool in as
            # records first fill it, once per daemon lifetime.
            for n in range(2):
                for ids in batches:
                    c.swap_out(ids, [f"warm{n}-{i}" for i in ids], wait="persisted")  # never busy
                c.flush()
                c.delete([f"warm{n}-{i}" for i in range(blocks)])
            # ... and the rest of its pool, which it faults in on a background thread once the
            # warm-up's records run its free slots low: timed while that thread ran, the hot
            # pass measured 2.6-7.2 GB/s (2 cores).
            deadline = time.monotonic() + 120
            while (pool := c.stats().get("host_pool")) and pool["growing"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon's host pool is not faulted in after 120 s: {pool}")
                time.sleep(0.1)
            t = time.perf_counter()
            for ids in batches:
                c.swap_out(ids, [keys[i] for i in ids], wait="persisted")
            write_s = time.perf_counter() - t
            cache.fill_random(12)  # the reads must put the bytes back
            hot_s = swap_in_all(c)
        with LocalDaemon(directory, ("--direct-io", "on", *daemon_args, "--host-tier-bytes", "0")) as daemon, \
                Client(daemon.endpoint, timeout=300) as c:
            c.register(cache)
            cache.fill_random(13)
            cold_s = swap_in_all(c)
            got = [cache.block_record(i) for i in (0, blocks // 2, blocks - 1)]
            c.clear()
    if got != expected:
        raise RuntimeError("kvswap read back different bytes")
    return {"write_s": write_s, "cold_s": cold_s, "hot_s": hot_s,
            "mode": f"O_DIRECT, fsync none; hot from {'the RAM tier' if host_tier else 'the file tier (no RAM tier)'}"}


# -- the FileStore method (FastDeploy PR #6188), re-implemented -----------------------------


def run_filestore(directory: str, blocks: int, block_bytes: int) -> dict:
    """One ``paddle.save`` file per block, fsynced; read back with ``paddle.load`` ->
    ``numpy().tobytes()`` -> memmove into the block. Written from the method's description
    in FastDeploy PR #6188; credit for the method is theirs, the code is ours."""
    import ctypes

    import paddle

    paddle.set_device("cpu")
    engine = np.random.default_rng(5).integers(0, 256, blocks * block_bytes, dtype=np.uint8)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    paths = [os.path.join(directory, f"block_{i}.pdparams") for i in range(blocks)]

    t = time.perf_counter()
    for i, path in enumerate(paths):
        tensor = paddle.to_tensor(engine[i * block_bytes:(i + 1) * block_bytes])  # the block, on the host
        paddle.save(tensor, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    write_s = time.perf_counter() - t

    out = np.zeros_like(engine)
    base = out.ctypes.data

    def read_all() -> float:
        t = time.perf_counter()
        for i, path in enumerate(paths):
            data = paddle.load(path).numpy().tobytes()
            ctypes.memmove(base + i * block_bytes, data, len(data))
        return time.perf_counter() - t

    drop_files(paths)
    cold_s = read_all()
    hot_s = read_all()
    if not np.array_equal(out, engine):
        raise RuntimeError("the FileStore method read back different bytes")
    for path in paths:
        os.unlink(path)
    return {"write_s": write_s, "cold_s": cold_s, "hot_s": hot_s,
            "mode": f"buffered + fsync per file, one thread; paddle {paddle.__version__} (CPU)"}


# -- LMCache ----------------------------------------------------------------------------------


def run_lmcache(python: str, directory: str, blocks: int, block_bytes: int) -> dict:
    if not os.path.exists(python):
        return {"error": f"no LMCache environment at {python} (python -m venv DIR && DIR/bin/pip install lmcache)"}
    os.makedirs(directory, mode=0o700, exist_ok=True)
    proc = subprocess.run([python, os.path.join(HERE, "peers_lmcache.py"), directory, str(blocks), str(block_bytes)],
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"LMCache run failed (exit {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=500)
    parser.add_argument("--block-mib", type=int, default=2)
    parser.add_argument("--storage-dir", default=".")
    parser.add_argument("--lmcache-python", default="/work/venv-lmcache/bin/python")
    parser.add_argument("--daemon-arg", action="append", default=[], help="extra kvswapd flag (repeatable)")
    parser.add_argument("--skip", action="append", default=[], choices=["filestore", "lmcache"])
    args = parser.parse_args()
    layout = layout_of(args.blocks, args.block_mib)
    block_bytes = layout.record_bytes
    total = block_bytes * args.blocks
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvswap-peers-", dir=args.storage_dir) as d:
        print(f"kvswap: {args.blocks} blocks of {block_bytes / 2**20:.2f} MiB", file=sys.stderr)
        results["kvswap"] = run_kvswap(os.path.join(d, "kvswap"), layout, args.daemon_arg)
        if "filestore" not in args.skip:
            print("FileStore method (FastDeploy PR #6188)", file=sys.stderr)
            try:
                results["FileStore method"] = run_filestore(os.path.join(d, "filestore"), args.blocks, block_bytes)
            except ImportError as exc:
                results["FileStore method"] = {"error": f"paddle is not installed: {exc}"}
        if "lmcache" not in args.skip:
            print("LMCache local disk backend", file=sys.stderr)
            results["LMCache"] = run_lmcache(args.lmcache_python, os.path.join(d, "lmcache"), args.blocks, block_bytes)
    print(f"{args.blocks} blocks x {block_bytes / 2**20:.2f} MiB = {total / 1e9:.2f} GB per pass; {machine()}; "
          f"{platform.platform()}; shared machine, one run")
    print(f"{'system':18}{'write GB/s':>12}{'x kvswap':>10}{'cold GB/s':>11}{'x kvswap':>10}{'hot GB/s':>10}"
          f"{'x kvswap':>10}  how")
    ours = results["kvswap"]
    for name, r in results.items():
        if "error" in r:
            print(f"{name:18}  not run: {r['error']}")
            continue
        cells = ""
        for col in ("write_s", "cold_s", "hot_s"):
            gbps = total / r[col] / 1e9
            cells += f"{gbps:12.3f}{gbps / (total / ours[col] / 1e9):10.2f}" if col == "write_s" else \
                f"{gbps:11.3f}{gbps / (total / ours[col] / 1e9):10.2f}" if col == "cold_s" else \
                f"{gbps:10.3f}{gbps / (total / ours[col] / 1e9):10.2f}"
        print(f"{name:18}{cells}  {r['mode']}")
    print("kvswap's lead is the inverse of a peer's 'x kvswap' (0.20 = kvswap is 5x faster).")


if __name__ == "__main__":
    main()
