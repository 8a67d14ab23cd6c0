"""SIGKILL a kvswapd under swap_out load, restart it, and check every stored key.

Block contents are a pure function of the key, so after any number of crashes we know what
every key must hold. Used by tests/test_crash_safety.py (20 kills in CI) and by
benchmarks/crash_loop.py (as many as you like).
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from kvswap.backends import record
from kvswap.backends.file_layout import RECORD_SUFFIX
from kvswap.backends.slab_journal import live_records
from kvswap.backends.slab_store import SLAB_DIR
from kvswap.protocol import CacheLayout, Client, Corrupt, HostKVCache, KvswapError

from .daemon_process import DaemonProcess, free_port

LAYOUT = CacheLayout("crash-test", num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64)
WRITE_BLOCKS = list(range(48))  # blocks the load writes from
CHECK_BLOCKS = list(range(48, 64))  # blocks verification loads into


def content_for(key: str, nbytes: int) -> bytes:
    return np.random.default_rng(xxhash.xxh64_intdigest(key.encode())).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def fill_block(cache: HostKVCache, block: int, key: str) -> None:
    data = np.frombuffer(content_for(key, cache.layout.record_bytes), dtype=np.uint8)
    offset = 0
    for region in cache.layout.regions:
        arr = cache.arrays[region.name][block]
        arr.view(np.uint8).reshape(-1)[:] = data[offset : offset + region.block_bytes]
        offset += region.block_bytes


@dataclass
class CrashReport:
    kills: int = 0
    attempted: int = 0
    acknowledged: int = 0
    found_after_restart: int = 0
    verified: int = 0
    #: Records on disk after the last stop (record files, or slab slots the journals name),
    #: each read back and checked by the test itself.
    files_on_disk: int = 0
    #: Records that fail their own check (torn or wrong bytes), or whose key the daemon did not
    #: serve: each one breaks "a restart serves every fully written record and never a torn one".
    bad_files: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    lost_persisted: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def _load(endpoint: str, cache: HostKVCache, cycle: int, stop: threading.Event, attempted: list[str],
          persisted: list[str], errors: list[BaseException]) -> None:
    rng = random.Random(cycle)
    n = 0
    try:
        # A short deadline: once the daemon is killed, the last request is never answered.
        with Client(endpoint, timeout=0.5) as c:
            while not stop.is_set():
                keys = [f"c{cycle}-{n + i}" for i in range(8)]
                blocks = rng.sample(WRITE_BLOCKS, 8)
                for block, key in zip(blocks, keys):
                    fill_block(cache, block, key)
                attempted.extend(keys)
                wait = "persisted" if n % 3 == 0 else "copied"
                result = c.swap_out(blocks, keys, wait=wait)
                if wait == "persisted":
                    persisted.extend(k for k, s in zip(keys, result.status) if s == "stored")
                n += 8
    except KvswapError:
        pass  # the daemon died under us: that is the point
    except BaseException as exc:  # a harness bug must fail the test, not vanish in a thread
        errors.append(exc)


def verify(endpoint: str, cache: HostKVCache, keys: list[str], report: CrashReport, rng: random.Random) -> set[str]:
    """Every key the daemon has must load byte-exact; lookup must agree with what loads."""
    found: set[str] = set()
    with Client(endpoint, timeout=30) as c:
        c.register(cache)
        for start in range(0, len(keys), len(CHECK_BLOCKS)):
            batch = keys[start : start + len(CHECK_BLOCKS)]
            blocks = CHECK_BLOCKS[: len(batch)]
            result = c.swap_in(batch, blocks)
            for key, block, status in zip(batch, blocks, result.status):
                if status == "miss":
                    continue
                if status != "loaded" or cache.block_record(block) != content_for(key, cache.layout.record_bytes):
                    report.wrong.append(f"{key}:{status}")
                else:
                    report.verified += 1
                    found.add(key)
        for key in rng.sample(keys, min(32, len(keys))):
            if c.lookup([key]) != (1 if key in found else 0):
                report.wrong.append(f"{key}:lookup disagrees with swap_in")
    return found


def crash_loop(storage_dir: Path, cycles: int, seed: int = 0, extra_args: tuple[str, ...] = ()) -> CrashReport:
    rng = random.Random(seed)
    report = CrashReport()
    all_keys: list[str] = []
    all_persisted: list[str] = []
    last_attempted = last_persisted = 0
    daemon = DaemonProcess(storage_dir, free_port(), free_port(),
                           extra_args=["--write-staging-bytes", "8M", "--read-staging-bytes", "4M", *extra_args])
    with HostKVCache.create(LAYOUT) as cache:
        for cycle in range(cycles):
            daemon.start()
            if all_keys:
                # The last cycle's keys, where the kill landed, plus a sample of older ones.
                # Index arithmetic, not [-n:]: a cycle killed before its first answer has n == 0,
                # and [-0:] is the whole list (every persisted key ever, most not in `recent`).
                recent = all_keys[len(all_keys) - last_attempted:] + rng.sample(all_keys, min(64, len(all_keys)))
                found = verify(daemon.endpoint, cache, recent, report, rng)
                report.lost_persisted.extend(k for k in all_persisted[len(all_persisted) - last_persisted:]
                                             if k not in found)
            with Client(daemon.endpoint, timeout=10) as c:
                c.register(cache)
            stop = threading.Event()
            attempted: list[str] = []
            persisted: list[str] = []
            loader = threading.Thread(target=_load, args=(daemon.endpoint, cache, cycle, stop, attempted, persisted,
                                                          report.errors))
            loader.start()
            time.sleep(rng.uniform(0.05, 0.4))
            daemon.kill()
            report.kills += 1
            stop.set()
            loader.join(30)
            all_keys.extend(attempted)
            all_persisted.extend(persisted)
            last_attempted, last_persisted = len(attempted), len(persisted)
            report.attempted += len(attempted)
        daemon.start()
        found = verify(daemon.endpoint, cache, all_keys, report, rng)
        report.found_after_restart = len(found)
        report.lost_persisted.extend(k for k in all_persisted if k not in found)
        assert daemon.stop() == 0
    report.acknowledged = len(all_persisted)
    check_files(storage_dir, found, report)
    return report


def check_files(storage_dir: Path, served: set[str], report: CrashReport) -> None:
    """Read every record the daemon left (record files, and slab slots the journals name), with
    the record format alone (no daemon, no index): each must pass its header and checksum,
    hold exactly ``content_for(key)``, and be a key the daemon served after the last restart."""
    for where, data in _records_on_disk(storage_dir):
        report.files_on_disk += 1
        try:
            header = record.decode_header(data)
            payload = data[header.header_len:]
            record.verify(header, header.namespace, header.key, payload)
        except Corrupt as exc:
            report.bad_files.append(f"{where}: {exc.message}")
            continue
        if payload != content_for(header.key, LAYOUT.record_bytes):
            report.bad_files.append(f"{where}: holds other bytes than {header.key}'s")
        elif header.key not in served:
            report.bad_files.append(f"{where}: {header.key} is on disk but was not served")


def _records_on_disk(storage_dir: Path) -> Iterator[tuple[str, bytes]]:
    """``(where, bytes)`` of every record under ``storage_dir``: each record file of the
    one-file-per-record layout, and each slot the slab layout's journals name, replayed from the
    files as a restart would (a slot written without its journal entry is not a record)."""
    for path in sorted(storage_dir.rglob("*" + RECORD_SUFFIX)):
        yield path.name, path.read_bytes()
    for slab_dir in sorted(storage_dir.rglob(SLAB_DIR)):
        for rec in live_records(str(slab_dir)):
            with open(rec.slab_path, "rb") as f:
                f.seek(rec.offset)
                data = f.read(record.header_len_for(LAYOUT.record_bytes) + LAYOUT.record_bytes)
            yield f"{os.path.basename(rec.slab_path)}#{rec.slot}", data
