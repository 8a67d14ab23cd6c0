"""Which bytes move where between the engine's cache and a staging buffer.

This is the one place that decides layout conversion. The shared-memory mover
(:mod:`.segment`) copies each region chunk at the offsets a plan names; GPU movers execute the
same plan with device copies, so the CPU tests of the plan (run by the tests' reference mover,
``kvswap/testing/reference_mover.py``) cover them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Where one region (tensor) lives in the engine's memory.

    ``handle`` indexes the registration's memory handles; block ``b`` of this region is
    ``block_bytes`` bytes at ``offset + b * stride`` in that handle. ``record_offset`` is where
    the region's chunk sits in a record.
    """

    name: str
    handle: int
    offset: int
    stride: int
    block_bytes: int
    record_offset: int

    def end(self, num_blocks: int) -> int:
        """One past the last byte this region touches in its handle."""
        return self.offset + (num_blocks - 1) * self.stride + self.block_bytes


@dataclass(frozen=True)
class Copy:
    handle: int
    engine_offset: int
    staging_offset: int
    nbytes: int


def copy_plan(placements: Sequence[Placement], block_ids: Sequence[int], record_bytes: int) -> list[Copy]:
    """The copies that turn engine blocks ``block_ids`` into consecutive records in staging
    (gather), or back (scatter): record ``i`` holds block ``block_ids[i]``.

    Worked example: two regions k.0 and v.0 of 4 bytes per block, k.0 at offset 0 and v.0 at
    offset 100 of handle 0, both with stride 4 (so a record is 8 bytes: k then v). For
    ``block_ids = [2, 0]``::

        Copy(handle=0, engine_offset=8,   staging_offset=0,  nbytes=4)   # k.0 of block 2
        Copy(handle=0, engine_offset=108, staging_offset=4,  nbytes=4)   # v.0 of block 2
        Copy(handle=0, engine_offset=0,   staging_offset=8,  nbytes=4)   # k.0 of block 0
        Copy(handle=0, engine_offset=100, staging_offset=12, nbytes=4)   # v.0 of block 0

    Copies are ordered record by record, so a consumer can start writing record ``i`` as soon
    as its copies are done.
    """
    return [
        Copy(p.handle, p.offset + block * p.stride, i * record_bytes + p.record_offset, p.block_bytes)
        for i, block in enumerate(block_ids)
        for p in placements
    ]


@dataclass(frozen=True)
class PlanArrays:
    """:func:`copy_plan` as parallel int64 arrays, one entry per copy, for device movers that
    hand a whole plan to one kernel (or build index arrays from it) instead of looping."""

    handle: np.ndarray
    engine_offset: np.ndarray
    staging_offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    def copies(self) -> list[Copy]:
        return [Copy(int(h), int(e), int(s), int(n))
                for h, e, s, n in zip(self.handle, self.engine_offset, self.staging_offset, self.nbytes)]


def plan_arrays(placements: Sequence[Placement], block_ids: Sequence[int], record_bytes: int) -> PlanArrays:
    """The same copies as :func:`copy_plan`, in the same order, vectorised.

    With the worked example of :func:`copy_plan` (k.0 at 0 and v.0 at 100 of handle 0, 4
    bytes per block, ``block_ids = [2, 0]``)::

        handle         = [0,   0,   0,   0]
        engine_offset  = [8, 108,   0, 100]
        staging_offset = [0,   4,   8,  12]
        nbytes         = [4,   4,   4,   4]
    """
    blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)          # [n, 1]
    handle = np.array([p.handle for p in placements], dtype=np.int64)      # [R]
    offset = np.array([p.offset for p in placements], dtype=np.int64)
    stride = np.array([p.stride for p in placements], dtype=np.int64)
    size = np.array([p.block_bytes for p in placements], dtype=np.int64)
    record_offset = np.array([p.record_offset for p in placements], dtype=np.int64)
    records = np.arange(len(blocks), dtype=np.int64).reshape(-1, 1)
    shape = (len(blocks), len(placements))
    return PlanArrays(
        handle=np.broadcast_to(handle, shape).reshape(-1).copy(),
        engine_offset=(offset + blocks * stride).reshape(-1),
        staging_offset=(records * record_bytes + record_offset).reshape(-1),
        nbytes=np.broadcast_to(size, shape).reshape(-1).copy(),
    )
