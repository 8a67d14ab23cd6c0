"""The daemon's side of the CUDA driver: one device, its IPC mappings, device memory, streams,
2D copies and pinned host memory.

Only the driver (``libcuda.so.1``) is used, through the same ctypes binding the engine side
exports with (:class:`kvswap.common.cuda_driver.CudaDriver`). Paddle and CuPy run the
kernels; the driver does what neither exposes the same way: opening IPC handles, checking
allocation sizes, host registration and pitched copies. All of it happens in the device's
primary context, which paddle and CuPy use too, so addresses and streams are shared.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field

from kvswap.common.cuda_driver import (
    CU_MEMORYTYPE_DEVICE,
    CU_MEMORYTYPE_HOST,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    CudaDriver,
    CudaError,
    CUipcMemHandle,
)
from kvswap.protocol.errors import InvalidLayout

log = logging.getLogger(__name__)

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
CU_STREAM_NON_BLOCKING = 0x1
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class CUDA_MEMCPY2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` of cuda.h (the ``_v2`` layout: size_t fields, 128 bytes)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


def find_ordinal(driver: CudaDriver, uuid: str | None, index: int) -> int:
    """This process's ordinal of the engine's GPU: by UUID where the engine sent one (ordinals
    differ between processes with different CUDA_VISIBLE_DEVICES), else by index."""
    count = driver.device_count()
    if uuid is not None:
        for ordinal in range(count):
            if driver.device_uuid(ordinal) == uuid:
                return ordinal
        raise InvalidLayout(f"the engine's GPU {uuid} is not visible to this daemon (check CUDA_VISIBLE_DEVICES)",
                            field="handles[0].device_uuid", visible=count)
    if index >= count:
        raise InvalidLayout(f"the engine's device {index} does not exist here ({count} visible)",
                            field="handles[0].device", visible=count)
    return index


class CudaDevice:
    """One GPU as a mover uses it: its primary context (retained until :meth:`release`), made
    current on whichever thread calls :meth:`activate`."""

    def __init__(self, driver: CudaDriver, ordinal: int) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self.context = driver.retain_primary_context(ordinal)
        self._released = False

    def activate(self) -> None:
        self.driver.set_current(self.context)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.driver.release_primary_context(self.ordinal)

    # -- IPC ----------------------------------------------------------------------------------

    def ipc_open(self, handle: bytes) -> int:
        h = CUipcMemHandle.from_bytes(handle)
        ptr = ctypes.c_uint64()
        self.driver.call("cuIpcOpenMemHandle_v2", [ctypes.POINTER(ctypes.c_uint64), CUipcMemHandle, ctypes.c_uint],
                         ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, fallbacks=("cuIpcOpenMemHandle",))
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.driver.call("cuIpcCloseMemHandle", [ctypes.c_uint64], ptr)

    def address_range(self, ptr: int) -> tuple[int, int]:
        return self.driver.address_range(ptr)

    # -- device memory and streams -----------------------------------------------------------

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self.driver.call("cuMemAlloc_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t], ctypes.byref(ptr),
                         max(1, nbytes))
        return ptr.value

    def free(self, ptr: int) -> None:
        self.driver.call("cuMemFree_v2", [ctypes.c_uint64], ptr)

    def create_stream(self) -> int:
        stream = ctypes.c_void_p()
        self.driver.call("cuStreamCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint], ctypes.byref(stream),
                         CU_STREAM_NON_BLOCKING)
        return stream.value or 0

    def destroy_stream(self, stream: int) -> None:
        self.driver.call("cuStreamDestroy_v2", [ctypes.c_void_p], stream, fallbacks=("cuStreamDestroy",))

    def synchronize(self, stream: int) -> None:
        self.driver.call("cuStreamSynchronize", [ctypes.c_void_p], stream)

    def mem_info(self) -> tuple[int, int]:
        return self.driver.mem_get_info()

    # -- copies --------------------------------------------------------------------------------

    def copy_2d(self, dst: int, dst_pitch: int, dst_host: bool, src: int, src_pitch: int, src_host: bool,
                width: int, height: int, stream: int) -> None:
        """``height`` rows of ``width`` bytes, ``src_pitch``/``dst_pitch`` apart, on ``stream``."""
        p = CUDA_MEMCPY2D()
        p.srcMemoryType = CU_MEMORYTYPE_HOST if src_host else CU_MEMORYTYPE_DEVICE
        p.dstMemoryType = CU_MEMORYTYPE_HOST if dst_host else CU_MEMORYTYPE_DEVICE
        if src_host:
            p.srcHost = src
        else:
            p.srcDevice = src
        if dst_host:
            p.dstHost = dst
        else:
            p.dstDevice = dst
        p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height = src_pitch, dst_pitch, width, height
        self.driver.call("cuMemcpy2DAsync_v2", [ctypes.POINTER(CUDA_MEMCPY2D), ctypes.c_void_p], ctypes.byref(p),
                         stream, fallbacks=("cuMemcpy2DAsync",))

    def copy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """From pageable host memory this returns once the driver has read ``src``, so the
        caller may drop it; the device write is still ordered on ``stream``."""
        self.driver.call("cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
                         dst, src, nbytes, stream)

    def copy_dtoh(self, dst: int, src: int, nbytes: int) -> None:
        self.driver.call("cuMemcpyDtoH_v2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t], dst, src, nbytes)

    def copy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.driver.call("cuMemcpyDtoHAsync_v2", [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
                         dst, src, nbytes, stream)

    # -- pinned host memory --------------------------------------------------------------------

    def host_register(self, ptr: int, nbytes: int) -> bool:
        """Pin ``nbytes`` at ``ptr``. False if another registration already covers them."""
        try:
            self.driver.call("cuMemHostRegister_v2", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ptr, nbytes,
                             CU_MEMHOSTREGISTER_PORTABLE, fallbacks=("cuMemHostRegister",))
        except CudaError as exc:
            if exc.cuda_code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                return False
            raise
        return True

    def host_unregister(self, ptr: int) -> None:
        self.driver.call("cuMemHostUnregister", [ctypes.c_void_p], ptr)

    def is_pinned(self, ptr: int) -> bool:
        try:
            return self.driver.pointer_attribute(ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE) == CU_MEMORYTYPE_HOST
        except CudaError:
            return False  # pageable memory is unknown to the driver


@dataclass
class _Mapping:
    ptr: int
    ordinal: int
    users: int = field(default=1)


class IpcMappings:
    """The IPC handles this process has open, shared and counted.

    The driver maps an allocation at most once per process (a second cuIpcOpenMemHandle of the
    same handle fails or aliases, by driver version), and the swapper attaches a new
    registration before it releases the one it replaces, which may name the same memory. So
    mappings are process state by nature: this table is the one place that knows them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bytes, _Mapping] = {}

    def open(self, device: CudaDevice, handle: bytes) -> int:
        with self._lock:
            m = self._open.get(handle)
            if m is not None and m.ordinal == device.ordinal:
                m.users += 1
                return m.ptr
            ptr = device.ipc_open(handle)
            self._open[handle] = _Mapping(ptr, device.ordinal)
            return ptr

    def close(self, device: CudaDevice, handle: bytes) -> bool:
        """Drop one user; unmap with the last. True when this call unmapped it."""
        with self._lock:
            m = self._open.get(handle)
            if m is None:
                return False
            m.users -= 1
            if m.users > 0:
                return False
            del self._open[handle]
        device.ipc_close(m.ptr)
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


#: See :class:`IpcMappings`: the driver's mappings are per process, so their table is too.
IPC_MAPPINGS = IpcMappings()
