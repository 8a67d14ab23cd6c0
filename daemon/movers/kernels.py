"""Kernels: move bytes between the engine's memory and the device staging area.

:class:`PaddleKernels` (paddle's gather and index_put over row views; runs on CPU paddle too)
and :class:`ChunkKernels` (one copy kernel over :func:`~.gpu_plan.chunk_table`, run by
:class:`CupyChunkRunner` on the GPU or :class:`NumpyChunkRunner` on the CPU)."""

import contextlib
import ctypes
import logging
from typing import Any, Callable, Final, Sequence

import numpy as np

from kvswap.common.cuda_driver import CudaError
from kvswap.protocol.errors import InvalidLayout

from .copy_plan import Placement, plan_arrays
from .gpu_plan import (
    AddressSpace,
    RowPlan,
    batches,
    chunk_table,
    row_plan,
    run_chunk_table,
)

log = logging.getLogger(__name__)

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
                                    "them; the paddle mover needs paddle >= 3.0 (or use the cupy framework)",
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
