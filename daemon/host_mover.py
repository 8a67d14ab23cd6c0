"""Executes copy plans between host memory (shared-memory segments) and staging.

numpy slice assignment is a plain memcpy that releases the GIL for large copies, so a gather
on an I/O thread does not stall the receive loop.

Every mover offers the same two record-level calls the swap pipeline uses:
``gather_blocks(block_ids, slots, live)`` (engine -> one staging slot per block) and
``scatter_blocks(block_ids, slots, live)`` (back). ``live()`` is checked before each block so a
request past its deadline stops touching engine memory. GPU movers implement the same calls
with device copies from the same :func:`copy_plan`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .copy_plan import Copy, Placement, copy_plan


class HostMover:
    """Moves bytes between engine buffers (one uint8 array per memory handle) and staging."""

    kind = "host"

    def __init__(self, buffers: Sequence[np.ndarray], placements: Sequence[Placement] = (),
                 record_bytes: int = 0) -> None:
        self.buffers = [np.asarray(b).reshape(-1).view(np.uint8) for b in buffers]
        self.placements = list(placements)
        self.record_bytes = record_bytes

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
        for block, slot in zip(block_ids, slots):
            if not live():
                return False
            self.gather(copy_plan(self.placements, [block], self.record_bytes), slot)
        return True

    def scatter_blocks(self, block_ids: Sequence[int], slots: Sequence[np.ndarray],
                       live: Callable[[], bool]) -> bool:
        for block, slot in zip(block_ids, slots):
            if not live():
                return False
            self.scatter(copy_plan(self.placements, [block], self.record_bytes), slot)
        return True

    def close(self) -> None:
        self.buffers = []
