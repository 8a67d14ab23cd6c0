"""Movers for an engine cache on the GPU, behind the record-level mover interface.

A :class:`DeviceMover` moves whole batches: for swap_out it gathers the requested blocks'
chunks on the device into a device staging area in record order, then copies that area to
the host slots with one 2D copy per run of evenly spaced slots; for swap_in it copies the
slots to device staging, then scatters on the device. Everything runs on one stream of the
daemon's own, in order, and the call returns only after the stream is idle, so no copy
touches engine memory after its request has its answer.

Three pieces, each with a CPU twin so the whole mover runs in the CPU tests:

- *kernels* move bytes between the engine's memory and the device staging:
  :class:`PaddleKernels` (paddle's gather and index_put over row views; runs on CPU paddle
  too) and :class:`ChunkKernels` (one copy kernel over :func:`~.gpu_plan.chunk_table`, run
  by :class:`CupyChunkRunner` on the GPU or :class:`NumpyChunkRunner` on the CPU);
- a *copier* moves records between device staging and host slots: :class:`CudaCopier`
  (pinned, pitched driver copies) or :class:`HostCopier` (the twin);
- the mover itself: batching, duplicates, deadlines, ordering, lifecycle.

Concurrency: the swapper gathers on its copy thread and scatters from its read threads.
Calls take the mover's lock, so staging and stream are never shared by two calls at once
(FastDeploy's swap ops shared global device buffers between concurrent calls).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Final, Protocol, Sequence

import numpy as np

from kvswap.protocol.errors import KvswapError

from .copy_plan import Placement
from .gpu_plan import (
    batches,
    last_wins,
)

log = logging.getLogger(__name__)

#: Device memory a mover stages through. Small on purpose: it comes out of the engine's GPU,
#: and 64 MiB batches already run the PCIe link at full speed.
DEFAULT_DEVICE_STAGING_BYTES: Final = 64 * 1024 * 1024


# -- the pieces' interfaces -------------------------------------------------------------------


class Kernels(Protocol):
    """Moves records between engine memory and a device staging area, on ``stream``.

    A call plans all its batches in :meth:`begin`, which uploads every index the call needs
    in one copy while the stream is idle: an upload from pageable memory synchronises the
    stream first, so one per batch would stall the pipeline between batches."""

    name: str
    stream: int

    def begin(self, block_ids: Sequence[int], batch_records: int, gather: bool) -> None: ...

    def gather(self, batch: range) -> int:
        """Enqueue the gather of the call's blocks ``batch`` into consecutive records in
        staging; the records' device address."""

    def scatter_source(self, batch: range) -> int:
        """Where the records of the call's blocks ``batch`` must be put before :meth:`scatter`."""

    def scatter(self, batch: range) -> None:
        """Enqueue the scatter of those records into their blocks."""

    def release(self) -> None:
        """Drop per-call temporaries; called after the stream is idle."""

    def close(self) -> None: ...


class Copier(Protocol):
    def to_host(self, src: int, slots: Sequence[np.ndarray], record_bytes: int) -> None: ...

    def from_host(self, slots: Sequence[np.ndarray], dst: int, record_bytes: int) -> None: ...

    def pin(self, array: np.ndarray) -> bool: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


def _slot_array(slot: Any) -> np.ndarray:
    return slot if isinstance(slot, np.ndarray) else np.frombuffer(slot, dtype=np.uint8)


# -- the mover ---------------------------------------------------------------------------------


class DeviceMover:
    """The record-level mover over device kernels and a host copier (see the module doc)."""

    kind = "cuda"
    #: swap_in hands it a whole wave of records in one scatter call (one upload, one kernel).
    batches_scatter = True

    def __init__(self, kernels: Kernels, copier: Copier, placements: Sequence[Placement], record_bytes: int,
                 batch_records: int, synchronize: Callable[[], None] = lambda: None,
                 activate: Callable[[], None] = lambda: None, on_close: Sequence[Callable[[], None]] = (),
                 info: dict[str, Any] | None = None) -> None:
        self.kernels = kernels
        self.copier = copier
        self.placements = list(placements)
        self.record_bytes = record_bytes
        self.batch_records = max(1, batch_records)
        self._synchronize = synchronize
        self._activate = activate
        self._on_close = list(on_close)
        self._lock = threading.Lock()
        self._closed = False
        self.info = dict(info or {})

    # -- the mover interface -------------------------------------------------------------------

    def gather_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        """Block ``block_ids[i]`` -> record in ``slots[i]``. False if ``live()`` turned false
        (checked before each batch); the slots of earlier batches are filled then."""
        ids = [int(b) for b in block_ids]
        arrays = [_slot_array(s) for s in slots]
        self._check(ids, arrays)
        with self._running():
            if ids:
                self.kernels.begin(ids, self.batch_records, gather=True)
            for batch in batches(len(ids), self.batch_records):
                if not live():
                    return False
                records = self.kernels.gather(batch)
                self.copier.to_host(records, arrays[batch.start:batch.stop], self.record_bytes)
        return True

    def scatter_blocks(self, block_ids: Sequence[int], slots: Sequence[Any], live: Callable[[], bool]) -> bool:
        """Record in ``slots[i]`` -> block ``block_ids[i]`` (the last record wins where a block
        repeats). False if ``live()`` turned false before a batch; earlier batches are written."""
        ids = [int(b) for b in block_ids]
        arrays = [_slot_array(s) for s in slots]
        self._check(ids, arrays)
        ids, arrays = last_wins(ids, arrays)
        with self._running():
            if ids:
                self.kernels.begin(ids, self.batch_records, gather=False)
            for batch in batches(len(ids), self.batch_records):
                if not live():
                    return False
                target = self.kernels.scatter_source(batch)
                self.copier.from_host(arrays[batch.start:batch.stop], target, self.record_bytes)
                self.kernels.scatter(batch)
        return True

    def pin_host(self, array: np.ndarray) -> bool:
        """Pin a staging arena up front (the swapper calls this when it makes staging), so the
        first swap does not pay for it. Returns whether this call pinned it."""
        with self._lock:
            if self._closed:
                return False
            self._activate()
            return self.copier.pin(array)

    def close(self) -> None:
        """Wait for the stream, free device staging, unpin host memory, close every IPC
        mapping and let go of the device. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            steps: list[Callable[[], None]] = [self._activate, self._synchronize, self.kernels.release,
                                               self.kernels.close, self.copier.release, self.copier.close,
                                               *self._on_close]
            for step in steps:
                try:
                    step()
                except Exception:  # keep going: the mappings must be closed whatever failed before
                    log.exception("closing the GPU mover: %s failed", getattr(step, "__qualname__", step))

    def describe(self) -> dict[str, Any]:
        return {"mover": self.kind, "framework": self.kernels.name, "batch_records": self.batch_records, **self.info}

    # -- internals -------------------------------------------------------------------------------

    def _check(self, ids: list[int], arrays: list[np.ndarray]) -> None:
        if len(ids) != len(arrays):
            raise ValueError(f"{len(ids)} block ids but {len(arrays)} slots")
        for a in arrays:
            if a.nbytes < self.record_bytes or not a.flags.c_contiguous:
                raise ValueError(f"a slot must be a contiguous buffer of at least {self.record_bytes} bytes")

    @contextlib.contextmanager
    def _running(self):
        with self._lock:
            if self._closed:
                raise KvswapError("the GPU mover is closed")
            self._activate()
            failed = False
            try:
                yield
            except BaseException:
                failed = True
                raise
            finally:
                try:
                    self._synchronize()
                except Exception:
                    if not failed:
                        raise
                    log.exception("stream synchronize after a failed copy")
                finally:
                    self.kernels.release()
                    self.copier.release()
