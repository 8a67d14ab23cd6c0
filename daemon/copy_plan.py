"""Which bytes move where between the engine's cache and a staging buffer.

This is the one place that decides layout conversion. The host mover executes a plan with
memory copies; GPU movers execute the same plan with device copies, so the CPU tests of the
plan cover them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


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
