"""Copies between an engine's POSIX shared-memory segments and staging, surviving the engine
truncating a segment at any moment.

Why care: the engine owns the segment and may truncate it at any time (a bug, or any process
that can write it). A plain copy through a mapping then touches pages past the file's end and
the daemon dies of SIGBUS, which no Python code can catch. Two copy paths, one contract:

- native (default where ``_fastcopy.c`` is built): the segment is mapped, each batch becomes a
  table of (source, destination, bytes) rows, one row per block and region, and one
  ``copy_rows`` call copies it with the GIL released inside a SIGBUS/SIGSEGV guard. A fault
  comes back as the faulting row, which this mover turns into :class:`SegmentShrunk`.
- preadv (the fallback: no compiler at install, or ``KVSWAP_NATIVE_COPY=0``): the segment is
  never mapped; one ``preadv``/``pwritev`` per region chunk on its descriptor, which returns a
  short count where a mapping would fault. One system call and one GIL round trip per chunk.

Before each call (a batch of blocks) it re-checks every segment's size with ``fstat``, under
its lock: a segment shrunk below what the registration needs is refused with
:class:`SegmentShrunk` before a byte moves. A truncate that lands after that check, during the
batch, faults the native copy or gives a short read (typed error either way); on the preadv
path a scatter's ``pwritev`` grows the file back to the offset written instead, which harms only
the engine that truncated its own cache.

The lock also orders :meth:`close` after every copy in progress, so a mapping is never unmapped
and a descriptor never closed (or reused for another file by number) while a copy uses it.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.common.shm import SharedSegment
from kvswap.protocol.errors import InvalidLayout, IOFailure, NotRegistered

from ..deadline import CopyGuard
from .copy_plan import Placement
from .native import load_copy_rows


class SegmentShrunk(InvalidLayout):
    """The engine's segment is now smaller than its registration needs. The registration is
    released; the engine must register again."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message, reason="segment_shrunk", **details)


class SegmentMover:
    """The :class:`~.base.Mover` for ``shm`` registrations."""

    kind = "host"
    #: Records are scattered one by one, on the thread that read them (reads and copies overlap).
    batches_scatter = False

    def __init__(self, segments: Sequence[SharedSegment], placements: Sequence[Placement], record_bytes: int,
                 num_blocks: int, native: bool | None = None) -> None:
        """``native``: True/False picks the copy path where the helper is built; None (the
        daemon's choice) reads ``KVSWAP_NATIVE_COPY``. See :mod:`.native`."""
        if any(s.fd < 0 for s in segments):
            raise ValueError("SegmentMover needs segments attached with mapped=False")
        self.segments = list(segments)
        self.placements = list(placements)
        self.record_bytes = record_bytes
        self.num_blocks = num_blocks
        # (descriptor, offset of block 0, stride, bytes, offset in the record) per region.
        self._chunks = [(self.segments[p.handle].fd, p.offset, p.stride, p.block_bytes, p.record_offset)
                        for p in self.placements]
        #: The bytes each segment must hold for every block of every region in it.
        self.needed = [0] * len(self.segments)
        for p in self.placements:
            end = p.offset + (num_blocks - 1) * p.stride + p.block_bytes
            self.needed[p.handle] = max(self.needed[p.handle], end)
        self._lock = threading.Condition()
        self._active = 0
        self._closed = False
        self._copy_rows = load_copy_rows(native)
        self._maps: list[mmap.mmap] = []
        self._map_views: list[np.ndarray] = []  # hold the mappings' addresses; dropped before unmapping
        if self._copy_rows is not None:
            self._map_segments()

    # -- the Mover interface ----------------------------------------------------------------------

    def gather_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        """Block ``block_ids[i]`` -> record in ``slots[i]``. False if ``live()`` turned false."""
        return self._move(block_ids, slots, live, to_engine=False)

    def scatter_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        return self._move(block_ids, slots, live, to_engine=True)

    def pin_host(self, array: np.ndarray) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"mover": self.kind, "copy": "native" if self._copy_rows is not None else "preadv"}

    def close(self) -> None:
        """Wait for the copies in progress, then close every descriptor. Safe to call twice."""
        with self._lock:
            self._closed = True
            while self._active:
                self._lock.wait()
            self._map_views = []
            for mapping in self._maps:
                mapping.close()
            self._maps = []
            for segment in self.segments:
                segment.close()

    # -- internals ---------------------------------------------------------------------------------

    def check_sizes(self) -> None:
        """Raise :class:`SegmentShrunk` if a segment no longer holds what the registration needs."""
        for i, (segment, needed) in enumerate(zip(self.segments, self.needed)):
            size = segment.current_size()
            if size < needed:
                raise SegmentShrunk(f"shared memory {segment.name!r} shrank to {size} bytes; the registration "
                                    f"needs {needed}", field=f"handles[{i}].size", size=size, needed=needed)

    def _move(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool],
              to_engine: bool) -> bool:
        with self._lock:
            if self._closed:
                raise NotRegistered("the registration of this memory was released")
            self._active += 1
        try:
            self.check_sizes()
            return self._copy(block_ids, slots, live, to_engine)
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._lock.notify_all()

    def _map_segments(self) -> None:
        """Map what each segment must hold, and precompute per region: the address of block 0,
        the stride, the bytes and the offset in the record (the columns of a row table)."""
        bases = []
        try:
            for segment, needed in zip(self.segments, self.needed):
                if needed == 0:  # no region lives in it
                    bases.append(0)
                    continue
                try:
                    mapping = mmap.mmap(segment.fd, needed)  # MAP_SHARED, read-write
                except (ValueError, OSError):  # truncated since register checked its size (issue 22)
                    self.check_sizes()  # raises SegmentShrunk; any other mmap failure stays itself
                    raise
                self._maps.append(mapping)
                self._map_views.append(np.frombuffer(mapping, dtype=np.uint8))
                bases.append(self._map_views[-1].ctypes.data)
        except BaseException:
            self._map_views = []
            for mapping in self._maps:
                mapping.close()
            raise
        self._region_base = np.array([bases[p.handle] + p.offset for p in self.placements], dtype=np.uint64)
        self._region_stride = np.array([p.stride for p in self.placements], dtype=np.uint64)
        self._region_bytes = np.array([p.block_bytes for p in self.placements], dtype=np.uint64)
        self._region_record_offset = np.array([p.record_offset for p in self.placements], dtype=np.uint64)

    def _copy(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool],
              to_engine: bool) -> bool:
        if self._copy_rows is None:
            return self._copy_by_descriptor(block_ids, slots, live, to_engine)
        return self._copy_native(block_ids, slots, live, to_engine)

    def _copy_native(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool],
                     to_engine: bool) -> bool:
        """The whole batch as one row table (blocks x regions) and one guarded ``copy_rows``,
        which reads the request's stop flag between rows. A plain ``live`` callable (no flag)
        is checked before each block's rows instead."""
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)[:len(slots)]  # pairs, as zip() makes
        if len(blocks) == 0:
            return True
        bad = (blocks < 0) | (blocks >= self.num_blocks)
        if bad.any():
            raise IndexError(f"block {int(blocks[bad][0])} is outside the registered cache")
        # One array per slot: its address, and it keeps the slot's buffer alive during the copy.
        records = [self._record_array(slot, writable=not to_engine) for slot in slots[:len(blocks)]]
        record_addr = np.array([r.ctypes.data for r in records], dtype=np.uint64)
        engine = self._region_base + blocks.astype(np.uint64)[:, None] * self._region_stride  # [n, R]
        record = record_addr[:, None] + self._region_record_offset                              # [n, R]
        table = np.empty((len(blocks), len(self.placements), 3), dtype=np.uint64)
        table[..., 0] = record if to_engine else engine
        table[..., 1] = engine if to_engine else record
        table[..., 2] = self._region_bytes
        done = self._copy_table(table.reshape(-1, 3), live)
        if done == len(table) * len(self.placements):
            return True
        if done >= 0:  # stopped between rows: the batch is not whole
            return False
        row = -done - 1
        block = int(blocks[row // len(self.placements)])
        region = self.placements[row % len(self.placements)].name
        self.check_sizes()  # raises with the size it shrank to
        raise SegmentShrunk(f"shared memory faulted while copying block {block} (region {region}); it was "
                            "truncated and grown again", block_id=block, region=region)

    def _copy_table(self, rows: np.ndarray, live: Callable[[], bool]) -> int:
        """``copy_rows`` over ``rows``: rows copied whole, or ``-(row + 1)`` for a fault."""
        assert self._copy_rows is not None
        if isinstance(live, CopyGuard):
            return self._copy_rows(rows, live.stop_flag)
        per_block = len(self.placements)
        for start in range(0, len(rows), per_block):
            if not live():
                return start
            done = self._copy_rows(rows[start:start + per_block])
            if done != min(per_block, len(rows) - start):
                return -(start + (-done - 1) + 1)
        return len(rows)

    def _record_array(self, slot: Any, writable: bool) -> np.ndarray:
        try:
            record = np.frombuffer(slot, dtype=np.uint8)
        except (TypeError, ValueError):
            record = None
        if record is None or record.nbytes < self.record_bytes or (writable and not record.flags.writeable):
            raise ValueError("a staging slot must be a contiguous buffer of one record")
        return record

    def _copy_by_descriptor(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool],
                            to_engine: bool) -> bool:
        for block, slot in zip(block_ids, slots):
            if not 0 <= block < self.num_blocks:
                raise IndexError(f"block {block} is outside the registered cache")
            record = memoryview(slot).cast("B")
            if record.nbytes < self.record_bytes:
                raise ValueError("a staging slot must be a contiguous buffer of one record")
            for fd, base, stride, nbytes, offset in self._chunks:
                if not live():  # before each region's chunk: a stop waits for one system call
                    return False
                chunk = record[offset:offset + nbytes]
                at = base + block * stride
                try:
                    done = os.pwritev(fd, [chunk], at) if to_engine else os.preadv(fd, [chunk], at)
                except OSError as exc:
                    raise IOFailure(f"copying {'into' if to_engine else 'from'} the engine's shared memory failed: "
                                    f"{exc.strerror}", errno=exc.errno) from None
                if done != nbytes and to_engine:
                    raise IOFailure("the engine's shared memory took a short write", block_id=block, written=done)
                if done != nbytes:  # only a segment truncated under us reads short
                    raise SegmentShrunk(f"shared memory ended at offset {at + done} while copying block {block}",
                                        block_id=block, offset=at + done)
        return True
