"""Copiers: move records between the device staging area and the host slots (pinned,
pitched driver copies on a GPU; :class:`HostCopier` is the CPU twin)."""

import ctypes
import logging
from typing import Any, Sequence

import numpy as np

from kvswap.common.cuda_driver import CudaError
from kvswap.common.units import PAGE_BYTES

from .gpu_plan import (
    SlotRun,
    slot_runs,
)

log = logging.getLogger(__name__)



def host_view(address: int, nbytes: int) -> np.ndarray:
    """A numpy view of ``nbytes`` of host memory at ``address`` (CPU twins only)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


# -- copiers -----------------------------------------------------------------------------------


class HostCopier:
    """CPU twin of :class:`CudaCopier`: the same runs and pitches, executed with numpy on host
    memory. It checks that every row a 2D copy would write is exactly its slot."""

    def __init__(self) -> None:
        self.runs: list[int] = []  # run lengths of the last calls, for tests

    def _rows(self, slots: Sequence[np.ndarray], record_bytes: int):
        addresses = [s.ctypes.data for s in slots]
        for run in slot_runs(addresses, record_bytes):
            self.runs.append(run.count)
            for j in range(run.count):
                if addresses[run.first] + j * run.pitch != addresses[run.first + j]:
                    raise RuntimeError("a 2D copy row would miss its slot")
                yield run.first + j

    def to_host(self, src: int, slots: Sequence[np.ndarray], record_bytes: int) -> None:
        records = host_view(src, len(slots) * record_bytes)
        for i in self._rows(slots, record_bytes):
            slots[i].reshape(-1).view(np.uint8)[:record_bytes] = records[i * record_bytes:(i + 1) * record_bytes]

    def from_host(self, slots: Sequence[np.ndarray], dst: int, record_bytes: int) -> None:
        records = host_view(dst, len(slots) * record_bytes)
        for i in self._rows(slots, record_bytes):
            records[i * record_bytes:(i + 1) * record_bytes] = slots[i].reshape(-1).view(np.uint8)[:record_bytes]

    def pin(self, array: np.ndarray) -> bool:
        return False

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


def _owner(array: np.ndarray) -> np.ndarray:
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def _inner_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: (start, length)."""
    start = (address + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES
    end = (address + nbytes) // PAGE_BYTES * PAGE_BYTES
    return start, max(0, end - start)


class CudaCopier:
    """Device staging <-> host slots with pitched driver copies on the mover's stream.

    Host memory is pinned (cuMemHostRegister) the first time a slot of its buffer is seen, or
    up front through :meth:`pin`; only whole pages inside the buffer are registered, so no
    other allocation's memory is touched, and the buffer is kept alive until :meth:`close`
    unpins it. A slot straddling the edge of a pinned range (never a staging slot: arenas are
    page aligned) is copied through a pageable bounce buffer, since the driver refuses copies
    over partly registered memory.
    """

    def __init__(self, device: Any, stream: int, two_d: bool = True) -> None:
        self.device = device
        self.stream = stream
        self.two_d = two_d
        self._pinned: dict[int, tuple[int, int, np.ndarray]] = {}  # id(owner) -> (start, length, owner)
        self._seen: set[int] = set()
        self._bounces: list[tuple[np.ndarray, np.ndarray]] = []    # (bounce, slot) to copy after sync
        self._hold: list[np.ndarray] = []

    def pin(self, array: np.ndarray) -> bool:
        owner = _owner(array)
        key = id(owner)
        if key in self._pinned or key in self._seen:
            return False
        self._seen.add(key)
        start, length = _inner_pages(owner.ctypes.data, owner.nbytes)
        if length == 0 or self.device.is_pinned(start):
            return False
        if not self.device.host_register(start, length):
            return False
        self._pinned[key] = (start, length, owner)
        return True

    def _range(self, slot: np.ndarray, record_bytes: int) -> int | None:
        """The start of the pinned range holding the slot, -1 for pageable memory, or None
        when the slot straddles a pinned range's edge."""
        a, b = slot.ctypes.data, slot.ctypes.data + record_bytes
        for start, length, _ in self._pinned.values():
            if start <= a and b <= start + length:
                return start
            if a < start + length and start < b:
                return None
        return -1

    def _plan(self, slots: Sequence[np.ndarray], record_bytes: int) -> tuple[list[list[int]], list[int]]:
        """Groups of consecutive slot indices in the same memory (one pinned range, or pageable
        memory), copied directly; and the indices that need a bounce buffer."""
        for s in slots:
            self.pin(s)
        groups: list[list[int]] = []
        bounce: list[int] = []
        last: int | None = None  # None: the next direct slot starts a group
        for i, s in enumerate(slots):
            where = self._range(s, record_bytes)
            if where is None:
                bounce.append(i)
            elif where != last:
                groups.append([i])
            else:
                groups[-1].append(i)
            # A group is consecutive slots: its records are consecutive in device staging.
            last = where
        return groups, bounce

    def _runs(self, slots: Sequence[np.ndarray], groups: list[list[int]], record_bytes: int):
        """(first slot index, its address, run): the copies to issue. A run never mixes pinned
        and pageable memory, which the driver refuses in one copy."""
        for indices in groups:
            addresses = [slots[i].ctypes.data for i in indices]
            if self.two_d:
                runs = slot_runs(addresses, record_bytes)
            else:  # one copy per slot, for comparison in benchmarks/gpu_check.py
                runs = [SlotRun(i, 1, record_bytes) for i in range(len(addresses))]
            for run in runs:
                yield indices[run.first], addresses[run.first], run

    def to_host(self, src: int, slots: Sequence[np.ndarray], record_bytes: int) -> None:
        direct, bounce = self._plan(slots, record_bytes)
        for index, address, run in self._runs(slots, direct, record_bytes):
            self.device.copy_2d(address, run.pitch, True, src + index * record_bytes, record_bytes, False,
                                record_bytes, run.count, self.stream)
        for i in bounce:
            tmp = np.empty(record_bytes, dtype=np.uint8)
            self.device.copy_2d(tmp.ctypes.data, record_bytes, True, src + i * record_bytes, record_bytes, False,
                                record_bytes, 1, self.stream)
            self._bounces.append((tmp, slots[i]))

    def from_host(self, slots: Sequence[np.ndarray], dst: int, record_bytes: int) -> None:
        direct, bounce = self._plan(slots, record_bytes)
        for index, address, run in self._runs(slots, direct, record_bytes):
            self.device.copy_2d(dst + index * record_bytes, record_bytes, False, address, run.pitch, True,
                                record_bytes, run.count, self.stream)
        for i in bounce:
            tmp = slots[i].reshape(-1).view(np.uint8)[:record_bytes].copy()
            self._hold.append(tmp)
            self.device.copy_2d(dst + i * record_bytes, record_bytes, False, tmp.ctypes.data, record_bytes, True,
                                record_bytes, 1, self.stream)

    def release(self) -> None:
        """After the stream is idle: land bounced records in their slots."""
        for tmp, slot in self._bounces:
            slot.reshape(-1).view(np.uint8)[:len(tmp)] = tmp
        self._bounces.clear()
        self._hold.clear()

    def close(self) -> None:
        for start, _, _ in self._pinned.values():
            try:
                self.device.host_unregister(start)
            except CudaError as exc:
                log.warning("unpinning staging memory failed: %s", exc.message)
        self._pinned.clear()
        self._seen.clear()
