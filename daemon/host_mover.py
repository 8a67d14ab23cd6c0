"""Executes copy plans between host memory (shared-memory segments) and staging.

numpy slice assignment is a plain memcpy that releases the GIL for large copies, so a gather
on an I/O thread does not stall the receive loop.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .copy_plan import Copy


class HostMover:
    """Moves bytes between engine buffers (one uint8 array per memory handle) and staging."""

    kind = "host"

    def __init__(self, buffers: Sequence[np.ndarray]) -> None:
        self.buffers = [np.asarray(b).reshape(-1).view(np.uint8) for b in buffers]

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

    def close(self) -> None:
        self.buffers = []
