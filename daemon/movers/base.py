"""What a mover is: the one interface the swap pipeline calls to move records between an
engine's cache and the daemon's staging slots.

The swapper calls these methods and nothing else, so a new medium (another GPU framework, a
remote memory) is a class with these members; nothing in the daemon asks ``hasattr``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Mover(Protocol):
    """Record-level copies between engine memory and staging slots.

    ``gather_blocks`` and ``scatter_blocks`` check ``live()`` before each block (or batch):
    once it turns false they stop touching engine memory and return False, so a request past
    its deadline, or whose registration is being released, never copies into blocks the
    engine has reused. They raise for a bad block id or slot; the caller answers with it.
    """

    #: A short name for stats and logs ("host", "cuda").
    kind: str
    #: Whether swap_in should hand a whole wave of records to one ``scatter_blocks`` call
    #: (GPU movers: one upload, one kernel) rather than one record per call, on the thread
    #: that read it (the host mover: reads and copies overlap).
    batches_scatter: bool

    def gather_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        """Engine block ``block_ids[i]`` -> the record in ``slots[i]``."""
        ...

    def scatter_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        """The record in ``slots[i]`` -> engine block ``block_ids[i]``."""
        ...

    def pin_host(self, array: np.ndarray) -> bool:
        """Page-lock a staging arena for faster device copies; whether this call pinned it.
        Movers without a device return False."""
        ...

    def describe(self) -> dict[str, Any]:
        """What ``stats`` reports about the mover: ``{"mover": kind, ...}``; may carry a
        ``handles`` list describing the engine memory it maps."""
        ...

    def close(self) -> None:
        """Stop using the engine's memory for good (safe to call twice)."""
        ...
