"""Copies between an engine's POSIX shared-memory segments and staging, through the segments'
file descriptors rather than a mapping.

Why not map the segment: the engine owns it and may truncate it at any time (a bug, or any
process that can write it). A copy through a mapping then touches pages past the file's end and
the daemon dies of SIGBUS, which no Python code can catch. ``preadv`` on the descriptor
returns a short count instead, which this mover turns into a typed error. The cost is one
system call per region chunk instead of one ``memmove`` (see the report in docs/security.md).

Before each call (a batch of blocks) it re-checks every segment's size with ``fstat``, under
its lock: a segment shrunk below what the registration needs is refused with
:class:`SegmentShrunk` before a byte moves. A truncate that lands after that check, during the
batch, gives a short read (typed error, as above) on gather; on scatter ``pwritev`` grows the
file back to the offset written, which harms only the engine that truncated its own cache.

The lock also orders :meth:`close` after every copy in progress, so a descriptor is never used
after it is closed (and never reused for another file by number).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.protocol.errors import InvalidLayout, IOFailure, NotRegistered
from kvswap.protocol.shm import SharedSegment

from .copy_plan import Placement


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
                 num_blocks: int) -> None:
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

    # -- the Mover interface ----------------------------------------------------------------------

    def gather_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        """Block ``block_ids[i]`` -> record in ``slots[i]``. False if ``live()`` turned false."""
        return self._move(block_ids, slots, live, to_engine=False)

    def scatter_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        return self._move(block_ids, slots, live, to_engine=True)

    def pin_host(self, array: np.ndarray) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"mover": self.kind, "copy": "preadv/pwritev"}

    def close(self) -> None:
        """Wait for the copies in progress, then close every descriptor. Safe to call twice."""
        with self._lock:
            self._closed = True
            while self._active:
                self._lock.wait()
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

    def _copy(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool],
              to_engine: bool) -> bool:
        for block, slot in zip(block_ids, slots):
            if not live():
                return False
            if not 0 <= block < self.num_blocks:
                raise IndexError(f"block {block} is outside the registered cache")
            record = memoryview(slot).cast("B")
            if record.nbytes < self.record_bytes:
                raise ValueError("a staging slot must be a contiguous buffer of one record")
            for fd, base, stride, nbytes, offset in self._chunks:
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
