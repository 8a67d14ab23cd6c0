"""The reference mover for tests: copy plans and record-level copies between host memory the
test process addresses directly (numpy arrays) and staging.

It is no part of the daemon, which moves an engine's shared-memory segment with
:class:`~kvswap.daemon.movers.segment.SegmentMover` (fault-guarded native copy, or ``preadv``)
and GPU memory with :class:`~kvswap.daemon.movers.device.DeviceMover`. Tests use it as the
plain, obviously correct twin those movers are compared against: the plan-level
``gather``/``scatter`` execute any :func:`~kvswap.daemon.movers.copy_plan.copy_plan` with numpy
slicing (numpy checks every bound), and the record-level calls implement
:class:`~kvswap.daemon.movers.base.Mover` with one ``ctypes.memmove`` per region chunk on
addresses bounds-checked once. It moved here from ``kvswap.daemon.movers.host`` (issue 23: the
package shipped it, but nothing in the daemon used it).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Sequence

import numpy as np

from kvswap.daemon.movers.copy_plan import Copy, Placement


class HostMover:
    """Moves bytes between engine buffers (one uint8 array per memory handle) and staging."""

    kind = "host"
    #: Records are scattered one by one, on the thread that read them (reads and copies overlap).
    batches_scatter = False

    def __init__(self, buffers: Sequence[np.ndarray], placements: Sequence[Placement] = (),
                 record_bytes: int = 0) -> None:
        self.buffers = [np.asarray(b).reshape(-1).view(np.uint8) for b in buffers]
        self.placements = list(placements)
        self.record_bytes = record_bytes
        # (engine address of block 0, stride, bytes, offset in the record) per region.
        self._chunks = [(self.buffers[p.handle].ctypes.data + p.offset, p.stride, p.block_bytes, p.record_offset)
                        for p in self.placements]
        # The largest block id every region can hold inside its buffer.
        self._max_block = min(((self.buffers[p.handle].nbytes - p.offset - p.block_bytes) // p.stride
                               for p in self.placements), default=-1)

    # -- plan level ------------------------------------------------------------------------------

    def gather(self, plan: Sequence[Copy], staging: np.ndarray) -> None:
        """Engine -> staging."""
        for c in plan:
            staging[c.staging_offset : c.staging_offset + c.nbytes] = self.buffers[c.handle][
                c.engine_offset : c.engine_offset + c.nbytes
            ]

    def scatter(self, plan: Sequence[Copy], staging: np.ndarray) -> None:
        """Staging -> engine."""
        for c in plan:
            self.buffers[c.handle][c.engine_offset : c.engine_offset + c.nbytes] = staging[
                c.staging_offset : c.staging_offset + c.nbytes
            ]

    # -- record level (the interface every mover implements) -------------------------------------

    def gather_blocks(self, block_ids: Sequence[int], slots: Sequence[np.ndarray],
                      live: Callable[[], bool]) -> bool:
        """Block ``block_ids[i]`` -> record in ``slots[i]``. False if ``live()`` turned false."""
        return self._move(block_ids, slots, live, to_engine=False)

    def scatter_blocks(self, block_ids: Sequence[int], slots: Sequence[np.ndarray],
                       live: Callable[[], bool]) -> bool:
        return self._move(block_ids, slots, live, to_engine=True)

    def _move(self, block_ids: Sequence[int], slots: Sequence[np.ndarray], live: Callable[[], bool],
              to_engine: bool) -> bool:
        memmove = ctypes.memmove
        for block, slot in zip(block_ids, slots):
            if not live():
                return False
            if not 0 <= block <= self._max_block:
                raise IndexError(f"block {block} is outside the mapped cache")
            if slot.nbytes < self.record_bytes or not slot.flags.c_contiguous:
                raise ValueError("a staging slot must be a contiguous buffer of one record")
            record = slot.ctypes.data
            if to_engine:
                for base, stride, nbytes, offset in self._chunks:
                    memmove(base + block * stride, record + offset, nbytes)
            else:
                for base, stride, nbytes, offset in self._chunks:
                    memmove(record + offset, base + block * stride, nbytes)
        return True

    def pin_host(self, array: np.ndarray) -> bool:
        """Host memory needs no pinning: nothing to do."""
        return False

    def describe(self) -> dict[str, Any]:
        return {"mover": self.kind}

    def close(self) -> None:
        self.buffers = []
