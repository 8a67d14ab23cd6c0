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
import ctypes
import importlib
import importlib.util
import logging
import os
import signal
import threading
from typing import Any, Callable, Final, Protocol, Sequence

import numpy as np

from kvswap.protocol.cuda_export import CudaDriver, CudaError
from kvswap.protocol.errors import InvalidLayout, KvswapError
from kvswap.protocol.layout import CacheLayout

from .copy_plan import Placement, plan_arrays
from .gpu_cuda import IPC_MAPPINGS, CudaDevice, find_ordinal
from .gpu_plan import (
    AddressSpace,
    RowPlan,
    SlotRun,
    batches,
    check_fits,
    chunk_table,
    last_wins,
    parse_cuda_handles,
    records_per_batch,
    row_plan,
    run_chunk_table,
    slot_runs,
)

log = logging.getLogger(__name__)

#: Device memory a mover stages through. Small on purpose: it comes out of the engine's GPU,
#: and 64 MiB batches already run the PCIe link at full speed.
DEFAULT_DEVICE_STAGING_BYTES: Final = 64 * 1024 * 1024
BACKENDS: Final = ("paddle", "cupy")
PAGE: Final = 4096

#: The copy kernel. One CUDA block per table row (a piece of one chunk); 16-byte copies where
#: source, destination and length allow, else 4-byte, else bytes. The table holds absolute
#: addresses, so one kernel serves gather (engine -> staging) and scatter (back). Sources are
#: read through the read-only cache (__ldg): within one launch no piece writes what another
#: reads (gather reads the engine and writes staging; scatter the reverse).
CHUNK_KERNEL_NAME: Final = "kvswap_copy_pieces"
CHUNK_KERNEL_SOURCE: Final = r"""
extern "C" __global__ void kvswap_copy_pieces(unsigned long long table_address, long long rows)
{
    const unsigned long long* table = reinterpret_cast<const unsigned long long*>(table_address);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const unsigned long long src = table[3 * row];
        const unsigned long long dst = table[3 * row + 1];
        const unsigned long long n = table[3 * row + 2];
        const unsigned long long align = src | dst | n;
        if ((align & 15ull) == 0) {
            const uint4* s = reinterpret_cast<const uint4*>(src);
            uint4* d = reinterpret_cast<uint4*>(dst);
            for (unsigned long long i = threadIdx.x; i < (n >> 4); i += blockDim.x) d[i] = __ldg(s + i);
        } else if ((align & 3ull) == 0) {
            const unsigned int* s = reinterpret_cast<const unsigned int*>(src);
            unsigned int* d = reinterpret_cast<unsigned int*>(dst);
            for (unsigned long long i = threadIdx.x; i < (n >> 2); i += blockDim.x) d[i] = __ldg(s + i);
        } else {
            const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
            unsigned char* d = reinterpret_cast<unsigned char*>(dst);
            for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
        }
    }
}
"""
KERNEL_THREADS: Final = 256
KERNEL_MAX_GRID: Final = 65535


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


def _host_view(address: int, nbytes: int) -> np.ndarray:
    """A numpy view of ``nbytes`` of host memory at ``address`` (CPU twins only)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=np.uint8)


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
        return {"mover": self.kind, "backend": self.kernels.name, "batch_records": self.batch_records, **self.info}

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
        records = _host_view(src, len(slots) * record_bytes)
        for i in self._rows(slots, record_bytes):
            slots[i].reshape(-1).view(np.uint8)[:record_bytes] = records[i * record_bytes:(i + 1) * record_bytes]

    def from_host(self, slots: Sequence[np.ndarray], dst: int, record_bytes: int) -> None:
        records = _host_view(dst, len(slots) * record_bytes)
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
    start = (address + PAGE - 1) // PAGE * PAGE
    end = (address + nbytes) // PAGE * PAGE
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


# -- chunk kernels (CuPy on the GPU, numpy on the CPU) -------------------------------------------


class NumpyChunkRunner:
    """CPU twin of :class:`CupyChunkRunner`: runs chunk tables over host memory, bounds checked."""

    name = "numpy"
    stream = 0

    def __init__(self, handles: Sequence[np.ndarray]) -> None:
        self._handles = list(handles)
        self._buffers: dict[int, np.ndarray] = {}
        self._table = np.empty((0, 3), np.uint64)
        self.tables: list[int] = []  # rows per launch, for tests
        self.uploads = 0

    def alloc(self, nbytes: int) -> int:
        buf = np.zeros(nbytes + 16, dtype=np.uint8)
        start = (-buf.ctypes.data) % 16
        view = buf[start:start + nbytes]
        self._buffers[view.ctypes.data] = view
        return view.ctypes.data

    def free(self, address: int) -> None:
        self._buffers.pop(address, None)

    def upload(self, table: np.ndarray) -> int:
        self.uploads += 1
        self._table = table.copy()
        return self._table.ctypes.data

    def run(self, table_address: int, first: int, rows: int) -> None:
        assert table_address == self._table.ctypes.data
        self.tables.append(rows)
        run_chunk_table(self._table[first:first + rows], AddressSpace(self._handles + list(self._buffers.values())))

    def close(self) -> None:
        self._buffers.clear()


class CupyChunkRunner:
    """Runs chunk tables with a CuPy RawKernel on the mover's stream. Device memory (staging,
    table) comes from the driver directly, not CuPy's pool, so :meth:`free` gives it back."""

    name = "cupy"

    def __init__(self, cupy: Any, device: Any) -> None:
        self.cp = cupy
        self.device = device
        self._cuda_device = cupy.cuda.Device(device.ordinal)
        with self._cuda_device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._kernel = cupy.RawKernel(CHUNK_KERNEL_SOURCE, CHUNK_KERNEL_NAME)
            # Compile (NVRTC) now, so a broken toolchain fails the registration, not a swap.
            compile_now = getattr(self._kernel, "compile", None)
            if compile_now is not None:
                compile_now()
            else:
                self._kernel.attributes  # noqa: B018 - older CuPy compiles on first attribute read
        self.stream = int(self._stream.ptr)
        self._table = 0
        self._table_bytes = 0

    def alloc(self, nbytes: int) -> int:
        return self.device.alloc(nbytes)

    def free(self, address: int) -> None:
        self.device.free(address)

    def upload(self, table: np.ndarray) -> int:
        """Copy the call's whole table to the device (the stream is idle: a call begins here)."""
        table = np.ascontiguousarray(table, dtype=np.uint64)
        if table.nbytes > self._table_bytes:
            self.device.synchronize(self.stream)  # nothing may still read the old table
            if self._table:
                self.device.free(self._table)
                self._table = 0
            self._table_bytes = max(table.nbytes, 2 * self._table_bytes, 4096)
            self._table = self.device.alloc(self._table_bytes)
        if table.nbytes:
            self.device.copy_htod_async(self._table, table.ctypes.data, table.nbytes, self.stream)
        return self._table

    def run(self, table_address: int, first: int, rows: int) -> None:
        if rows == 0:
            return
        with self._cuda_device, self._stream:
            self._kernel((min(rows, KERNEL_MAX_GRID),), (KERNEL_THREADS,),
                         (np.uint64(table_address + 24 * first), np.int64(rows)))

    def close(self) -> None:
        if self._table:
            self.device.free(self._table)
            self._table = 0
            self._table_bytes = 0


class ChunkKernels:
    """Gather/scatter as one chunk-table kernel per batch (:func:`~.gpu_plan.chunk_table`)."""

    def __init__(self, runner: Any, bases: Sequence[int], placements: Sequence[Placement], record_bytes: int,
                 batch_records: int) -> None:
        self.runner = runner
        self.name = runner.name
        self.stream = runner.stream
        self.bases = list(bases)
        self.placements = list(placements)
        self.record_bytes = record_bytes
        self.capacity = batch_records
        self._staging = runner.alloc(batch_records * record_bytes)
        self._table = 0
        self._rows: list[tuple[int, int]] = []
        self._per_batch = batch_records

    def begin(self, block_ids: Sequence[int], batch_records: int, gather: bool) -> None:
        if batch_records > self.capacity:
            raise ValueError(f"batches of {batch_records} records exceed the staging of {self.capacity}")
        tables, self._rows, at = [], [], 0
        for batch in batches(len(block_ids), batch_records):
            plan = plan_arrays(self.placements, block_ids[batch.start:batch.stop], self.record_bytes)
            table = chunk_table(plan, self.bases, self._staging, gather=gather)
            self._rows.append((at, len(table)))
            at += len(table)
            tables.append(table)
        self._per_batch = batch_records
        self._table = self.runner.upload(np.concatenate(tables) if tables else np.empty((0, 3), np.uint64))

    def _run(self, batch: range) -> None:
        first, rows = self._rows[batch.start // self._per_batch]
        self.runner.run(self._table, first, rows)

    def gather(self, batch: range) -> int:
        self._run(batch)
        return self._staging

    def scatter_source(self, batch: range) -> int:
        return self._staging

    def scatter(self, batch: range) -> None:
        self._run(batch)

    def release(self) -> None:
        self._rows = []

    def close(self) -> None:
        if self._staging:
            self.runner.free(self._staging)
            self._staging = 0
        self.runner.close()


# -- paddle kernels ------------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DL_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DL_DELETER)]
_DL_CPU, _DL_CUDA = 1, 2
_DL_INT, _DL_UINT = 0, 1
_CAPSULE_NAME = b"dltensor"  # module-lifetime: the capsule keeps a pointer to it


class DLPackView:
    """A DLPack capsule describing ``rows x cols`` elements at ``address`` that we do not own.

    The capsule has no deleter: the memory belongs to the engine (or a test buffer), and the
    view object (kept with the framework tensor made from it) keeps the descriptor alive.
    """

    def __init__(self, address: int, rows: int, cols: int, unit: int, on_gpu: bool, device_id: int) -> None:
        self._shape = (ctypes.c_int64 * 2)(rows, cols)
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data = address
        t.device = _DLDevice(_DL_CUDA if on_gpu else _DL_CPU, device_id if on_gpu else 0)
        t.ndim = 2
        t.dtype = _DLDataType(_DL_UINT if unit == 1 else _DL_INT, 8 * unit, 1)
        t.shape = self._shape
        t.strides = None
        t.byte_offset = 0
        self._managed.manager_ctx = None
        self._managed.deleter = _DL_DELETER()

    def capsule(self) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._managed), _CAPSULE_NAME, None)


def _paddle_ptr(tensor: Any) -> int:
    return int(tensor.data_ptr()) if hasattr(tensor, "data_ptr") else int(tensor._ptr())


def _raw_stream(stream: Any) -> int:
    for get in (lambda s: s.cuda_stream, lambda s: s.stream_base.cuda_stream, lambda s: s._as_parameter_.value,
                lambda s: s.__cuda_stream__()[1]):
        try:
            value = get(stream)
        except Exception:
            continue
        if value:
            return int(value)
    raise CudaError("paddle stream", -1, "", "cannot read the raw CUDA stream of a paddle stream")


class PaddleKernels:
    """Gather/scatter with paddle ops over row views of the engine's memory (:class:`RowPlan`):
    ``paddle.gather`` of each region's rows then one ``concat`` into records; ``split`` then
    ``index_put_`` per region back. Runs on the GPU (views via DLPack on the IPC mappings, ops on
    a paddle stream of the mover's own) and on CPU paddle, where the tests run it."""

    name = "paddle"

    def __init__(self, paddle: Any, bases: Sequence[int], sizes: Sequence[int], placements: Sequence[Placement],
                 record_bytes: int, upload: Callable[[int, np.ndarray, int], None], on_gpu: bool = False,
                 device_id: int = 0) -> None:
        self.paddle = paddle
        self.on_gpu = on_gpu
        self.plan: RowPlan = row_plan(placements, sizes, bases, record_bytes)
        self._upload = upload
        self._dlviews: list[DLPackView] = []
        self.views: list[Any] = []
        for v in self.plan.views:
            address = bases[v.handle] + v.start
            dl = DLPackView(address, v.rows, v.row_bytes // self.plan.unit, self.plan.unit, on_gpu, device_id)
            tensor = paddle.utils.dlpack.from_dlpack(dl.capsule())
            if _paddle_ptr(tensor) != address:
                raise InvalidLayout(f"this paddle ({paddle.__version__}) copies DLPack tensors instead of sharing "
                                    "them; the paddle mover needs paddle >= 3.0 (or use the cupy backend)",
                                    reason="paddle_dlpack_copies")
            self._dlviews.append(dl)
            self.views.append(tensor)
        if on_gpu:
            self._place = paddle.CUDAPlace(device_id)
            self._pstream = paddle.device.Stream(device=f"gpu:{device_id}")
            # Our copies go on the stream paddle really runs these ops on, whatever it is.
            with self._guard():
                self.stream = _raw_stream(paddle.device.current_stream(f"gpu:{device_id}"))
        else:
            self._place = paddle.CPUPlace()
            self._pstream = None
            self.stream = 0
        self._hold: list[Any] = []
        self._scatter_buffer: Any = None
        self._indices: Any = None
        self._offsets: list[int] = []

    def _guard(self) -> Any:
        if self._pstream is None:
            return contextlib.nullcontext()
        return self.paddle.device.stream_guard(self._pstream)

    def begin(self, block_ids: Sequence[int], batch_records: int, gather: bool) -> None:
        """Upload every region's row indices for the whole call in one copy."""
        host = self.plan.indices(block_ids)
        flat = np.concatenate(host) if host else np.empty(0, np.int64)
        with self._guard():
            device = self.paddle.empty([max(1, len(flat))], dtype="int64")
        self._upload(_paddle_ptr(device), flat, self.stream)
        self._hold.append(device)
        self._indices, at = device, 0
        self._offsets = []
        for idx in host:
            self._offsets.append(at)
            at += len(idx)

    def _batch_indices(self, batch: range) -> list[Any]:
        out = []
        for r, at in zip(self.plan.regions, self._offsets):
            out.append(self._indices[at + batch.start * r.per_block: at + batch.stop * r.per_block])
        return out

    def gather(self, batch: range) -> int:
        n = len(batch)
        with self._guard():
            indices = self._batch_indices(batch)
            parts = [self.paddle.gather(self.views[r.view], idx, axis=0).reshape([n, r.width])
                     for r, idx in zip(self.plan.regions, indices)]
            records = self.paddle.concat(parts, axis=1) if len(parts) > 1 else parts[0]
        self._hold.extend(parts)
        self._hold.extend(indices)
        self._hold.append(records)
        return _paddle_ptr(records)

    def scatter_source(self, batch: range) -> int:
        with self._guard():
            self._scatter_buffer = self.paddle.empty([len(batch), self.plan.record_units], dtype=self.plan.dtype)
        self._hold.append(self._scatter_buffer)
        return _paddle_ptr(self._scatter_buffer)

    def scatter(self, batch: range) -> None:
        records = self._scatter_buffer
        with self._guard():
            indices = self._batch_indices(batch)
            parts = self.paddle.split(records, [r.width for r in self.plan.regions], axis=1)
            for r, idx, part in zip(self.plan.regions, indices, parts):
                view = self.views[r.view]
                rows = part.reshape([len(batch) * r.per_block, view.shape[1]])
                view.index_put_((idx,), rows)
                self._hold.append(rows)
        self._hold.extend(parts)
        self._hold.extend(indices)

    def release(self) -> None:
        self._hold.clear()
        self._scatter_buffer = None
        self._indices = None

    def close(self) -> None:
        self.release()
        self.views.clear()
        self._dlviews.clear()
        if self.on_gpu:
            # Staging came from paddle's caching allocator: give it back to the driver.
            with contextlib.suppress(Exception):
                self.paddle.device.cuda.empty_cache()


def host_upload(address: int, values: np.ndarray, stream: int) -> None:
    """CPU twin of a host-to-device upload: copy ``values`` to host memory at ``address``."""
    if values.nbytes:
        ctypes.memmove(address, values.ctypes.data, values.nbytes)


# -- attaching a cuda_ipc registration -----------------------------------------------------------


def _import(name: str) -> Any:
    return importlib.import_module(name)


#: Signals the daemon handles itself (SIGTERM drains); paddle must not take them over.
_DAEMON_SIGNALS: Final = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


@contextlib.contextmanager
def keep_signal_handlers():
    """Put the process's signal handlers back as they were after the block.

    Paddle installs C++ handlers for SIGTERM and others when it loads (they print a stack and
    abort: "FatalError: `Termination signal` is detected"), which would turn the daemon's
    SIGTERM drain into a crash. ``signal.signal`` cannot undo that from the copy thread this
    runs on, so the C-level actions are saved and restored with ``sigaction`` (process-wide,
    any thread); the buffer is opaque to us and only passed back to libc.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    saved = []
    for name in _DAEMON_SIGNALS:
        number = int(getattr(signal, name))
        action = ctypes.create_string_buffer(512)  # larger than any libc's struct sigaction
        if libc.sigaction(number, None, action) == 0:
            saved.append((number, action))
    try:
        yield
    finally:
        for number, action in saved:
            if libc.sigaction(number, action, None) != 0:
                log.warning("could not restore the handler of signal %d", number)


def import_paddle() -> Any:
    """Import paddle without letting it take the daemon's signals."""
    with keep_signal_handlers():
        paddle = _import("paddle")
        paddle.to_tensor([0])  # the first op finishes paddle's own initialisation
    return paddle


def backend_order(requested: str | None) -> list[str]:
    """Which backends to try: the one asked for (``KVSWAP_GPU_BACKEND`` where none is), or
    paddle then CuPy for ``auto``."""
    choice = (requested or os.environ.get("KVSWAP_GPU_BACKEND") or "auto").lower()
    if choice == "auto":
        return list(BACKENDS)
    if choice not in BACKENDS:
        raise InvalidLayout(f"unknown GPU backend {choice!r}; use one of auto, {', '.join(BACKENDS)}",
                            backend=choice)
    return [choice]


def _make_kernels(name: str, device: Any, bases: list[int], sizes: list[int], placements: Sequence[Placement],
                  record_bytes: int, batch: int) -> Kernels:
    if importlib.util.find_spec(name) is None:
        raise InvalidLayout(f"{name} is not installed")
    if name == "paddle":
        paddle = import_paddle()
        if not paddle.is_compiled_with_cuda():
            raise InvalidLayout("this paddle is a CPU build (install paddlepaddle-gpu)")

        def upload(address: int, values: np.ndarray, stream: int) -> None:
            if values.nbytes:
                device.copy_htod_async(address, values.ctypes.data, values.nbytes, stream)

        # Paddle initialises its GPU runtime on first use: keep our signals through that too.
        with keep_signal_handlers():
            paddle.set_device(f"gpu:{device.ordinal}")
            return PaddleKernels(paddle, bases, sizes, placements, record_bytes, upload, on_gpu=True,
                                 device_id=device.ordinal)
    cupy = _import("cupy")
    return ChunkKernels(CupyChunkRunner(cupy, device), bases, placements, record_bytes, batch)


def attach_cuda_ipc(layout: CacheLayout, placements: Sequence[Placement], handles: Sequence[dict[str, Any]],
                    backend: str | None = None, staging_bytes: int = DEFAULT_DEVICE_STAGING_BYTES) -> DeviceMover:
    """Open the engine's ``cuda_ipc`` handles and build the mover over them.

    Checks, in order: every handle field; that the regions fit the sizes the engine declared;
    that this machine has a CUDA driver, the engine's GPU and a GPU backend (paddle or CuPy);
    that every handle opens; that each mapped allocation is at least its declared size and
    holds its regions. Any failure closes what was opened and raises :class:`InvalidLayout`
    (or :class:`CudaError`, an ``unavailable``, for a device that fails mid-way).
    """
    specs = parse_cuda_handles(handles)
    check_fits(placements, [s.size for s in specs], layout.num_blocks)
    order = backend_order(backend)
    try:
        driver = CudaDriver.load()
    except CudaError as exc:
        raise InvalidLayout(f"cuda_ipc handles need a CUDA GPU, and this daemon has none: {exc.message}",
                            field="handles[0].kind", reason=exc.cuda_error or "no_cuda") from None
    ordinal = find_ordinal(driver, specs[0].device_uuid, specs[0].device)
    device = CudaDevice(driver, ordinal)
    opened: list[bytes] = []

    def close_mappings() -> None:
        device.activate()
        while opened:
            IPC_MAPPINGS.close(device, opened.pop())

    try:
        device.activate()
        bases, sizes = [], []
        for s in specs:
            try:
                ptr = IPC_MAPPINGS.open(device, s.ipc_handle)
            except CudaError as exc:
                raise InvalidLayout(f"handles[{s.index}]: cannot open the CUDA IPC handle ({exc.cuda_error}); is the "
                                    "engine alive, on this machine, and exporting this allocation?",
                                    field=f"handles[{s.index}].ipc_handle", cuda_error=exc.cuda_error) from None
            opened.append(s.ipc_handle)
            base, size = device.address_range(ptr)
            mapped = base + size - ptr
            if mapped < s.size:
                raise InvalidLayout(f"handles[{s.index}] maps {mapped} bytes, less than the declared {s.size}",
                                    field=f"handles[{s.index}].size", mapped=mapped, declared=s.size)
            bases.append(ptr)
            sizes.append(mapped)
        check_fits(placements, sizes, layout.num_blocks)
        batch = records_per_batch(layout.record_bytes, staging_bytes)
        reasons = []
        kernels = None
        for name in order:
            try:
                kernels = _make_kernels(name, device, bases, sizes, placements, layout.record_bytes, batch)
                break
            except Exception as exc:  # noqa: BLE001 - a framework may fail any way; try the next, say why
                log.warning("GPU backend %s unusable: %s", name, exc)
                reasons.append(f"{name}: {getattr(exc, 'message', None) or exc}")
        if kernels is None:
            raise InvalidLayout("no usable GPU backend: " + "; ".join(reasons), field="handles[0].kind",
                                reason="no_gpu_backend")
        copier = CudaCopier(device, kernels.stream)
    except BaseException:
        try:
            close_mappings()
        finally:
            device.release()
        raise
    info = {"device": ordinal, "handles": [{"kind": "cuda_ipc", "size": s, "device": ordinal} for s in sizes]}
    return DeviceMover(kernels, copier, placements, layout.record_bytes, batch,
                       synchronize=lambda: device.synchronize(kernels.stream), activate=device.activate,
                       on_close=[close_mappings, device.release], info=info)
