"""The swap pipeline checked by the bytes it moves, through a daemon in this process driven by
the real client over a real socket, with faults at the ``Disk`` seam, in both file layouts:

- swap_in with a miss, a corrupt record or a read error ahead of hits: ``loaded`` is the
  leading run of loaded keys (an engine uses exactly that many blocks as its prefix), the hole's
  block is untouched, and every block the daemon says it loaded holds its record's bytes;
- staging slots under held writes: with every write slowed, many distinct payloads swapped out
  through a few slots land on disk each under its own key, byte for byte (a slot handed to the
  next swap_out before its write read it would put one key's bytes under another's).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvswap.protocol import Busy, CacheLayout, Client, HostKVCache

from disk_records import LAYOUTS, checked_records, fail_reads_of, record_of
from support import InProcessDaemon

SENTINEL = 0x6B  # what a block the daemon must not write holds before and after


def fill(cache: HostKVCache, blocks: list[int], value: int) -> None:
    for arr in cache.arrays.values():
        for b in blocks:
            arr[b].view(np.uint8).reshape(-1)[:] = value


# -- swap_in: the leading run, never past a hole ----------------------------------------------------


def make_hole(kind: str, d: InProcessDaemon, c: Client, root: Path, key: str) -> tuple[str, Callable[[], None]]:
    """Turn the stored ``key`` into a hole of the given kind; returns the status swap_in must
    report for it, and what undoes the fault once that swap_in is over."""
    if kind == "miss":
        assert c.delete([key]) == 1
        return "miss", lambda: None
    if kind == "corrupt":
        # The payload's last byte: the header still parses, the checksum fails.
        record_of(root, key).flip(-1)
        return "corrupt", lambda: None
    return "error", fail_reads_of(d.daemon.file_backend.disk, record_of(root, key))


@pytest.mark.parametrize("file_layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["miss", "corrupt", "error"])
def test_loaded_is_the_leading_run_and_the_hole_is_untouched(tmp_path: Path, cache: HostKVCache, kind: str,
                                                             file_layout: str) -> None:
    root = tmp_path / "s"
    # No RAM tier: holes in the file tier.
    with InProcessDaemon(root, host_tier_bytes=0, file_layout=file_layout) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        # The hole first, second, and last of four keys.
        for round_, hole in enumerate((0, 1, 3)):
            keys = [f"{kind}-{round_}-{i}" for i in range(4)]
            sources = [4 * round_ + i for i in range(4)]
            expected = [cache.block_record(b) for b in sources]
            assert c.swap_out(sources, keys, wait="persisted").stored == 4
            want, undo = make_hole(kind, d, c, root, keys[hole])
            targets = [20, 21, 22, 23]
            fill(cache, targets, SENTINEL)
            untouched = cache.block_record(targets[hole])

            result = c.swap_in(keys, targets)
            undo()

            assert result.status[hole] == want, result.status
            assert result.status[:hole] == ["loaded"] * hole
            assert result.loaded == hole, (hole, result.status)
            for i in range(hole):
                assert cache.block_record(targets[i]) == expected[i]
            assert cache.block_record(targets[hole]) == untouched, "the hole's block was written"
            # After the hole the daemon may load or not, but what it says it loaded is right
            # and what it did not load it left alone.
            for i in range(hole + 1, 4):
                got = cache.block_record(targets[i])
                assert got == (expected[i] if result.status[i] == "loaded" else untouched), (i, result.status)
        assert c.ping() < 1.0


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_every_hole_kind_in_one_request(tmp_path: Path, cache: HostKVCache, file_layout: str) -> None:
    root = tmp_path / "s"
    # No RAM tier: holes in the file tier.
    with InProcessDaemon(root, host_tier_bytes=0, file_layout=file_layout) as d, Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        keys = ["h0", "h1", "h2", "h3", "h4"]
        expected = [cache.block_record(b) for b in range(5)]
        assert c.swap_out(list(range(5)), keys, wait="persisted").stored == 5
        assert make_hole("corrupt", d, c, root, "h2")[0] == "corrupt"
        assert make_hole("error", d, c, root, "h4")[0] == "error"
        fill(cache, list(range(10, 16)), SENTINEL)
        untouched = cache.block_record(10)
        result = c.swap_in(["h0", "h1", "h2", "never-stored", "h3", "h4"], list(range(10, 16)))
        assert result.status[:4] == ["loaded", "loaded", "corrupt", "miss"]
        assert result.status[5] == "error"
        assert result.loaded == 2
        assert [cache.block_record(10), cache.block_record(11)] == expected[:2]
        assert cache.block_record(12) == untouched and cache.block_record(13) == untouched
        assert cache.block_record(15) == untouched
        assert cache.block_record(14) == (expected[3] if result.status[4] == "loaded" else untouched)


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_a_long_swap_in_through_one_read_slot_per_thread_moves_every_record_byte_for_byte(
        tmp_path: Path, cache: HostKVCache, file_layout: str) -> None:
    """With no RAM tier, each read thread reads its records one after another into the same
    read slot (swapper.py, ``reuse``): 24 records through 2 slots, one request. A slot handed
    to the next record before the last was scattered, or a record scattered from another's
    slot, puts the wrong bytes in a block; a hole (corrupt, miss) read into a slot already used
    must not scatter what the slot held before."""
    root = tmp_path / "s"
    with InProcessDaemon(root, host_tier_bytes=0, read_threads=2, file_layout=file_layout) as d, \
            Client(d.endpoint, timeout=10) as c:
        c.register(cache)
        cache.fill_random(7)
        keys = [f"long-{i}" for i in range(24)]
        expected = [cache.block_record(b) for b in range(24)]
        assert c.swap_out(list(range(24)), keys, wait="persisted").stored == 24
        targets = list(range(24))
        fill(cache, targets, SENTINEL)
        untouched = cache.block_record(0)
        result = c.swap_in(keys, targets)
        assert result.status == ["loaded"] * 24
        assert [cache.block_record(b) for b in targets] == expected
        # Holes late in each thread's run: their slot held another record's bytes just before.
        record_of(root, keys[21]).flip(-1)
        assert c.delete([keys[22]]) == 1
        fill(cache, targets, SENTINEL)
        result = c.swap_in(keys, targets)
        assert result.status[21:23] == ["corrupt", "miss"] and result.loaded == 21
        assert [cache.block_record(b) for b in targets[:21]] == expected[:21]
        assert cache.block_record(21) == untouched and cache.block_record(22) == untouched
        assert cache.block_record(23) == (expected[23] if result.status[23] == "loaded" else untouched)
        staging = c.stats()["read_staging"]
        assert staging["free"] == staging["slots"]  # every read slot went back


# -- staging slots are reused only after their write read them -------------------------------------------


class SlowWrites:
    """Record writes (Disk.write_file in the files layout, Disk.write_at in the slab layout)
    that wait ``delay_s`` first, so writes are still pending when later swap_outs want staging
    slots."""

    def __init__(self, disk, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self._lock = threading.Lock()
        disk.write_file, disk.write_at = self._slowed(disk.write_file), self._slowed(disk.write_at)

    def _slowed(self, write):
        def slow(*args, **kwargs):
            with self._lock:
                self.calls += 1
            time.sleep(self.delay_s)  # the fault itself (a slow disk), not a wait for a condition
            return write(*args, **kwargs)

        return slow


@pytest.mark.parametrize("file_layout", LAYOUTS)
def test_records_on_disk_are_the_bytes_swapped_out_while_slots_are_reused(tmp_path: Path, file_layout: str) -> None:
    layout = CacheLayout("slot-reuse", num_layers=2, num_blocks=8, block_size=8, num_kv_heads=2, head_dim=16)
    root = tmp_path / "s"
    slots = 4
    # Records of 2 KiB each take one 4 KiB staging slot: 4 write slots in all.
    with InProcessDaemon(root, write_staging_bytes=slots * 4096, file_layout=file_layout) as d, \
            HostKVCache.create(layout) as cache, Client(d.endpoint, timeout=30) as c:
        assert c.register(cache)["write_slots"] == slots
        slow = SlowWrites(d.daemon.file_backend.disk, delay_s=0.03)
        rng = np.random.default_rng(5)
        swapped: dict[str, bytes] = {}
        busy = 0
        for n in range(24):
            keys = [f"p{n}.a", f"p{n}.b"]
            blocks = [2 * (n % 4), 2 * (n % 4) + 1]  # the engine reuses its blocks at once
            for b in blocks:
                for arr in cache.arrays.values():
                    arr[b].view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, arr[b].nbytes, dtype=np.uint8)
            payloads = [cache.block_record(b) for b in blocks]
            while True:
                try:
                    out = c.swap_out(blocks, keys, wait="copied")
                    break
                except Busy:  # every slot holds a pending write: the daemon said so; retry
                    busy += 1
                    time.sleep(0.005)
            assert out.status == ["queued", "queued"]
            swapped.update(zip(keys, payloads))
        c.flush()
        # The bytes first: each record on disk is what was swapped out under its key.
        on_disk, torn = checked_records(root)
        wrong = sorted(k for k in swapped if k in on_disk and on_disk[k] != swapped[k])
        assert (wrong, torn) == ([], []), f"{len(wrong)} records hold other keys' bytes, {len(torn)} are torn"
        assert sorted(on_disk) == sorted(swapped)
        assert slow.calls >= len(swapped)
        assert c.stats()["pending_writes"] == 0
        assert c.stats()["write_staging"]["free"] == slots
    print(f"\nslot reuse: {len(swapped)} records through {slots} slots, {busy} busy answers")
    assert busy > 0  # the writes really were held: slots ran out and were reused
