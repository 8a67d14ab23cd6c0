"""The CUDA driver API through ``ctypes``: the one binding the engine-side export
(:mod:`kvswap.protocol.cuda_export`) and the daemon's GPU movers (``kvswap.daemon.movers``)
both call.

The driver library (``libcuda.so.1``) is the one piece every CUDA machine has, whatever the
frameworks, so nothing here imports paddle, torch or CuPy; the library is loaded only when
:meth:`CudaDriver.load` is called, so importing this module (and ``kvswap.protocol``) needs
nothing beyond the standard library.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Any, Final, Iterator, Sequence

from .errors import Unavailable

#: Size of a ``CUipcMemHandle`` (``CU_IPC_HANDLE_SIZE``).
IPC_HANDLE_BYTES: Final = 64

# CUDA driver API constants (cuda.h; stable since CUDA 10.2).
CU_POINTER_ATTRIBUTE_MEMORY_TYPE: Final = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: Final = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: Final = 10
CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: Final = 11
CU_POINTER_ATTRIBUTE_RANGE_SIZE: Final = 12
CU_MEMORYTYPE_HOST: Final = 1
CU_MEMORYTYPE_DEVICE: Final = 2
#: ``code`` of a :class:`CudaError` raised because no driver library could be loaded.
NO_DRIVER: Final = -1


class CudaError(Unavailable):
    """A CUDA driver call failed, or there is no CUDA driver on this machine.

    It is an :class:`Unavailable` on the wire (``details``: ``call``, ``cuda_error``,
    ``cuda_code``), so a failure deep in a copy still reaches the engine as a typed error.
    """

    def __init__(self, call: str, cuda_code: int, cuda_error: str = "", message: str = "") -> None:
        super().__init__(message or f"{call} failed: {cuda_error or cuda_code}", call=call,
                         cuda_error=cuda_error, cuda_code=cuda_code)
        self.call = call
        self.cuda_code = cuda_code
        self.cuda_error = cuda_error


class CUipcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value. (Unsigned bytes, not ``c_char``:
    a ``c_char`` array reads back only up to its first zero byte.)"""

    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]

    @classmethod
    def from_bytes(cls, raw: bytes) -> "CUipcMemHandle":
        if len(raw) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUipcMemHandle is {IPC_HANDLE_BYTES} bytes, not {len(raw)}")
        handle = cls()
        ctypes.memmove(ctypes.addressof(handle), raw, IPC_HANDLE_BYTES)
        return handle

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), IPC_HANDLE_BYTES)


class CudaDriver:
    """The CUDA driver API through ctypes: the few calls export and the daemon's movers need.

    The driver library is the one piece every CUDA machine has, whatever the frameworks:
    paddle and CuPy may ship different runtimes, but they share the driver and the device's
    primary context, so pointers and streams pass freely between them and these calls.
    """

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._fns: dict[str, Any] = {}

    @classmethod
    def load(cls) -> "CudaDriver":
        """Load ``libcuda.so.1`` and initialise it. Raises :class:`CudaError` (``NO_DRIVER``)
        when there is no driver, or the driver's own error when ``cuInit`` fails (no device)."""
        reasons = []
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
            except OSError as exc:
                reasons.append(str(exc))
                continue
            driver = cls(lib)
            driver.call("cuInit", [ctypes.c_uint], 0)
            return driver
        raise CudaError("dlopen(libcuda.so.1)", NO_DRIVER, "CUDA_DRIVER_NOT_FOUND",
                        f"no CUDA driver on this machine: {reasons[0] if reasons else 'libcuda.so.1 not found'}")

    # -- calling -------------------------------------------------------------------------------

    def fn(self, name: str, argtypes: Sequence[Any], *fallbacks: str) -> Any:
        """The driver function ``name`` (or the first of ``fallbacks`` the library exports)."""
        f = self._fns.get(name)
        if f is None:
            for symbol in (name, *fallbacks):
                f = getattr(self._lib, symbol, None)
                if f is not None:
                    break
            if f is None:
                raise CudaError(name, NO_DRIVER, "CUDA_ERROR_NOT_FOUND",
                                f"the CUDA driver has no {name}; it is too old")
            f.argtypes = list(argtypes)
            f.restype = ctypes.c_int
            self._fns[name] = f
        return f

    def call(self, name: str, argtypes: Sequence[Any], *args: Any, fallbacks: Sequence[str] = ()) -> None:
        self.check(name, self.fn(name, argtypes, *fallbacks)(*args))

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise CudaError(call, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        try:
            f = self.fn("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        except CudaError:
            return str(code)
        if f(code, ctypes.byref(text)) != 0 or not text.value:
            return str(code)
        return text.value.decode(errors="replace")

    # -- devices and contexts ------------------------------------------------------------------

    def device_count(self) -> int:
        n = ctypes.c_int()
        self.call("cuDeviceGetCount", [ctypes.POINTER(ctypes.c_int)], ctypes.byref(n))
        return n.value

    def device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int], ctypes.byref(dev), ordinal)
        return dev.value

    def device_uuid(self, ordinal: int) -> str:
        """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi prints it. Unlike an
        ordinal it names the same GPU in every process, whatever CUDA_VISIBLE_DEVICES says."""
        raw = (ctypes.c_ubyte * 16)()
        self.call("cuDeviceGetUuid", [ctypes.c_void_p, ctypes.c_int], ctypes.byref(raw), self.device(ordinal),
                  fallbacks=("cuDeviceGetUuid_v2",))
        return format_uuid(bytes(raw))

    def retain_primary_context(self, ordinal: int) -> int:
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int], ctypes.byref(ctx),
                  self.device(ordinal))
        return ctx.value or 0

    def release_primary_context(self, ordinal: int) -> None:
        self.call("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int], self.device(ordinal),
                  fallbacks=("cuDevicePrimaryCtxRelease",))

    def set_current(self, ctx: int) -> None:
        self.call("cuCtxSetCurrent", [ctypes.c_void_p], ctx)

    @contextmanager
    def on_device(self, ordinal: int) -> Iterator[None]:
        """The device's primary context (the one paddle, torch and CuPy use) current on this
        thread for the block, and the caller's context back afterwards."""
        ctx = self.retain_primary_context(ordinal)
        try:
            self.call("cuCtxPushCurrent_v2", [ctypes.c_void_p], ctx, fallbacks=("cuCtxPushCurrent",))
            try:
                yield
            finally:
                popped = ctypes.c_void_p()
                self.call("cuCtxPopCurrent_v2", [ctypes.POINTER(ctypes.c_void_p)], ctypes.byref(popped),
                          fallbacks=("cuCtxPopCurrent",))
        finally:
            self.release_primary_context(ordinal)

    # -- memory ---------------------------------------------------------------------------------

    def pointer_attribute(self, ptr: int, attribute: int) -> int:
        value = ctypes.c_int()
        self.call("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64], ctypes.byref(value),
                  attribute, ptr)
        return value.value

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding device address ``ptr`` (an IPC mapping too)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        try:
            self.call("cuMemGetAddressRange_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                  ctypes.c_uint64], ctypes.byref(base), ctypes.byref(size), ptr)
        except CudaError as first:
            # The same facts as pointer attributes (CUDA >= 10.2), should a driver not answer
            # the range query for some kind of mapping.
            try:
                start = self.pointer_attribute_u64(ptr, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
                length = self.pointer_attribute_u64(ptr, CU_POINTER_ATTRIBUTE_RANGE_SIZE)
            except CudaError:
                raise first from None
            return start, length
        return base.value, size.value

    def pointer_attribute_u64(self, ptr: int, attribute: int) -> int:
        value = ctypes.c_uint64()
        self.call("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64], ctypes.byref(value),
                  attribute, ptr)
        return value.value

    def ipc_get_handle(self, base: int) -> bytes:
        handle = CUipcMemHandle()
        self.call("cuIpcGetMemHandle", [ctypes.POINTER(CUipcMemHandle), ctypes.c_uint64], ctypes.byref(handle), base)
        return handle.to_bytes()

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the current context's device."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
                  ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


def format_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
