"""``kvswap demo``: a daemon on loopback with a local directory, and an engine played by this
process. Swaps blocks out, wipes them, swaps them back into other blocks, checks every byte,
and prints throughput next to plain copies of the same bytes measured in the same run."""

from __future__ import annotations

import os
import time
import urllib.request
from typing import Callable

import numpy as np

from kvswap.protocol import Client, HostKVCache

from .local_daemon import LocalDaemon
from .presets import PRESETS, preset_layout


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _plain_copy_seconds(nbytes: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)  # touched now, so the timed copy pays no page faults
    t = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t


def _plain_file_seconds(directory: str, nbytes: int) -> tuple[float, float]:
    """Write then read ``nbytes`` as one file in ``directory`` (buffered, like the daemon's
    default ``--fsync none``)."""
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    path = os.path.join(directory, f".demo-baseline-{os.getpid()}")
    try:
        t = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(data.data)
        write_s = time.perf_counter() - t
        back = np.zeros_like(data)
        back.fill(1)  # fault the pages in before timing
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(back.data)
        read_s = time.perf_counter() - t
    finally:
        os.unlink(path)
    return write_s, read_s


def _scrape(url: str, names: tuple[str, ...]) -> dict[str, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0]: line.rsplit(" ", 1)[1] for line in text.splitlines()
            if line.startswith(names)}


def run_demo(storage_dir: str, preset: str = "small", blocks: int = 128, linger_s: float = 0.0,
             say: Callable[[str], None] = print) -> bool:
    layout = preset_layout(preset, blocks)
    storage_dir = os.path.abspath(storage_dir)
    total = layout.record_bytes * blocks
    say(f"layout   {preset}: {PRESETS[preset][0]}")
    say(f"blocks   {blocks} x {layout.record_bytes / 2**20:.2f} MiB = {total / 2**20:.1f} MiB")
    with LocalDaemon(storage_dir) as daemon, HostKVCache.create(layout) as cache, \
            Client(daemon.endpoint, timeout=120) as client:
        say(f"daemon   {daemon.endpoint}  (metrics {daemon.metrics_url})")
        cache.fill_random(seed=int.from_bytes(os.urandom(4), "little"))
        info = client.register(cache)
        keys = [f"demo-{info['namespace'][:8]}-{os.getpid()}-{i}" for i in range(blocks)]
        expected = [cache.block_record(b) for b in range(blocks)]

        t = time.perf_counter()
        out = client.swap_out(list(range(blocks)), keys, wait="persisted")
        out_s = time.perf_counter() - t
        if out.stored + out.exists != blocks:
            say(f"swap_out stored only {out.stored} of {blocks}: {out.status}")
            return False

        cache.zero_blocks(list(range(blocks)))
        targets = list(reversed(range(blocks)))  # load into different blocks than we saved from
        t = time.perf_counter()
        result = client.swap_in(keys, targets)
        in_s = time.perf_counter() - t
        exact = result.loaded == blocks and all(cache.block_record(dst) == want
                                                for dst, want in zip(targets, expected))
        copy_s = _plain_copy_seconds(total)
        file_w_s, file_r_s = _plain_file_seconds(storage_dir, total)
        hits = client.lookup(keys)
        counters = _scrape(daemon.metrics_url, ("kvswap_bytes_total", "kvswap_stored_records"))

        say("")
        say(f"{'':22}{'seconds':>9}{'GB/s':>9}")
        for name, secs in (("swap_out (persisted)", out_s), ("swap_in", in_s), ("plain memory copy", copy_s),
                           ("plain file write", file_w_s), ("plain file read", file_r_s)):
            say(f"{name:22}{secs:9.3f}{_gbps(total, secs):9.2f}")
        say("")
        say(f"swap_out is {out_s / file_w_s:.1f}x the time of one plain file write and "
            f"{out_s / copy_s:.0f}x a memory copy; it also gathers {len(layout.regions)} regions per block, "
            f"checksums and writes {blocks} records (one positioned write each, into the file tier's slab slots)")
        say(f"lookup   {hits} of {blocks} keys stored")
        say(f"metrics  {daemon.metrics_url}")
        for series, value in sorted(counters.items()):
            say(f"         {series} {value}")
        say(f"files    {os.path.join(storage_dir, info['namespace'])}")
        say(f"round trip: {'byte-exact' if exact else 'MISMATCH'} "
            f"({result.loaded}/{blocks} blocks, {total} bytes compared)")
        if linger_s > 0:
            say(f"daemon stays up {linger_s:.0f} s for a look at {daemon.metrics_url}")
            time.sleep(linger_s)
        client.unregister()
    return exact
