"""Export an engine's GPU KV cache to kvswapd over CUDA IPC (engine side).

The engine keeps its paged cache on the GPU, one tensor per region (``k.<layer>``,
``v.<layer>``, and ``ks.<layer>``/``vs.<layer>`` scale tensors for fp8). This module turns
those tensors into the body of a ``register`` request whose memory handles are of kind
``cuda_ipc``::

    {"kind": "cuda_ipc", "ipc_handle": <64 bytes>, "size": <allocation bytes>,
     "device": <the engine's device ordinal>, "device_uuid": "GPU-...."}

One handle names one CUDA *allocation* (what ``cudaMalloc`` returned), not one tensor: a
caching allocator (paddle's, torch's) carves many tensors out of one allocation, and a
process can open a given allocation's handle only once. A region's ``offset`` is therefore
the tensor's byte offset inside its allocation, and its ``stride`` the bytes per block.

The handle is the raw ``CUipcMemHandle`` of the CUDA driver API, so the format does not
depend on the framework: paddle, torch and CuPy tensors all export the same way. No
framework is imported here; the driver is reached through ``ctypes`` (``libcuda.so.1``),
only when a function is called, so ``kvswap.protocol`` still imports with numpy alone.

Keep the returned :class:`CudaCacheExport` (or the tensors) alive while the daemon uses the
cache: the daemon maps the engine's memory, and memory the engine frees is not the daemon's
to read. When the engine process exits, the daemon notices and closes its mappings, so the
GPU memory goes back to the driver.
"""

from __future__ import annotations

import ctypes
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Final, Iterator, Mapping, Sequence

from .errors import InvalidLayout, Unavailable
from .layout import DTYPE_SIZES, CacheLayout

#: Size of a ``CUipcMemHandle`` (``CU_IPC_HANDLE_SIZE``).
IPC_HANDLE_BYTES: Final = 64
HANDLE_KIND: Final = "cuda_ipc"

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


# -- what export needs of a tensor ----------------------------------------------------------------


@dataclass(frozen=True)
class DeviceTensor:
    """One cache tensor as export sees it: where it is and how its bytes are laid out."""

    ptr: int
    shape: tuple[int, ...]
    itemsize: int
    contiguous: bool
    #: The device ordinal the framework reports, if it does; only a hint for which context
    #: to ask the driver in (the driver's own answer decides).
    device: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def describe_tensor(tensor: Any) -> DeviceTensor:
    """Read a paddle, torch or CuPy (or any ``__cuda_array_interface__``) GPU tensor's address,
    shape, element size and contiguity without importing its framework."""
    if isinstance(tensor, DeviceTensor):
        return tensor
    if hasattr(tensor, "data_ptr") and hasattr(tensor, "element_size"):
        # paddle >= 3 and torch. (torch's __cuda_array_interface__ refuses bfloat16, so the
        # framework's own accessors come first.)
        shape = tuple(int(d) for d in tensor.shape)
        contiguous = tensor.is_contiguous() if hasattr(tensor, "is_contiguous") else True
        return DeviceTensor(int(tensor.data_ptr()), shape, int(tensor.element_size()), bool(contiguous),
                            _device_hint(tensor))
    cai = getattr(tensor, "__cuda_array_interface__", None)
    if cai is not None:  # CuPy, numba
        shape = tuple(int(d) for d in cai["shape"])
        itemsize = int(cai["typestr"][2:])
        strides = cai.get("strides")
        contiguous = strides is None or tuple(strides) == _c_strides(shape, itemsize)
        return DeviceTensor(int(cai["data"][0]), shape, itemsize, contiguous, _device_hint(tensor))
    raise InvalidLayout(f"cannot read the device address of a {type(tensor).__name__}; pass paddle, torch or "
                        "CuPy GPU tensors")


def _device_hint(tensor: Any) -> int | None:
    place = getattr(tensor, "place", None)  # paddle
    if place is not None and hasattr(place, "is_gpu_place"):
        return int(place.gpu_device_id()) if place.is_gpu_place() else None
    device = getattr(tensor, "device", None)
    for attr in ("index", "id"):  # torch.device.index, cupy.cuda.Device.id
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    return None


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


# -- building the registration ------------------------------------------------------------------


@dataclass(frozen=True)
class Allocation:
    """The CUDA allocation holding a tensor: what a ``cuda_ipc`` handle describes."""

    base: int
    size: int
    device: int
    device_uuid: str
    ipc_handle: bytes


def region_tensors(layout: CacheLayout, keys: Sequence[Any], values: Sequence[Any] | None = None,
                   key_scales: Sequence[Any] | None = None,
                   value_scales: Sequence[Any] | None = None) -> dict[str, Any]:
    """Map each of the layout's region names to its tensor, checking the counts.

    MLA layouts (``has_values=False``) take keys only: an empty or missing ``values`` is the
    normal case there, not an error, and values given to an MLA layout are refused."""
    n = layout.total_layers
    groups: list[tuple[str, str, Sequence[Any] | None, bool]] = [
        ("k", "keys", keys, True),
        ("v", "values", values, layout.has_values),
        ("ks", "key_scales", key_scales, layout.has_scales),
        ("vs", "value_scales", value_scales, layout.has_scales and layout.has_values),
    ]
    out: dict[str, Any] = {}
    for prefix, what, tensors, wanted in groups:
        tensors = list(tensors or [])
        if not wanted:
            if tensors:
                raise InvalidLayout(f"this layout has no {what} (dtype={layout.dtype}, "
                                    f"has_values={layout.has_values}), "
                                    f"but {len(tensors)} were given", field=what)
            continue
        if len(tensors) != n:
            raise InvalidLayout(f"{what}: expected one tensor per cache layer ({n}: {layout.num_layers} model + "
                                f"{layout.num_extra_layers} extra), got {len(tensors)}", field=what,
                                expected=n, got=len(tensors))
        for layer, tensor in enumerate(tensors):
            out[f"{prefix}.{layer}"] = tensor
    return {r.name: out[r.name] for r in layout.regions}


def build_cuda_registration(layout: CacheLayout, tensors: Mapping[str, DeviceTensor],
                            locate: Callable[[DeviceTensor], Allocation], pid: int) -> dict[str, Any]:
    """The ``register`` body for ``tensors`` (region name -> tensor), with ``locate`` telling
    which allocation holds a device address.

    Worked example: regions k.0 and v.0 of 1024 bytes per block and 4 blocks, both carved
    from one allocation at 0x7f0000000000 (k.0 at +0, v.0 at +4096)::

        handles = [{"kind": "cuda_ipc", "ipc_handle": <64 bytes>, "size": <allocation>, ...}]
        regions = [{"name": "k.0", "handle": 0, "offset": 0,    "stride": 1024},
                   {"name": "v.0", "handle": 0, "offset": 4096, "stride": 1024}]
    """
    handles: list[dict[str, Any]] = []
    by_base: dict[int, int] = {}
    regions = []
    device: tuple[int, str] | None = None
    for region in layout.regions:
        if region.name not in tensors:
            raise InvalidLayout(f"no tensor for region {region.name}", region=region.name)
        t = tensors[region.name]
        _check_tensor(layout, region.name, region.block_bytes, t)
        try:
            alloc = locate(t)
        except (CudaError, InvalidLayout) as exc:
            raise InvalidLayout(f"region {region.name}: its memory cannot be shared over CUDA IPC: {exc.message}",
                                **{**exc.details, "region": region.name}) from None
        if not (alloc.base <= t.ptr and t.ptr + t.nbytes <= alloc.base + alloc.size):
            raise InvalidLayout(f"region {region.name} is not inside the allocation that holds it",
                                region=region.name)
        if device is None:
            device = (alloc.device, alloc.device_uuid)
        elif device != (alloc.device, alloc.device_uuid):
            raise InvalidLayout(f"region {region.name} is on device {alloc.device}, the others on {device[0]}; "
                                "one daemon serves one GPU", region=region.name)
        index = by_base.get(alloc.base)
        if index is None:
            index = by_base[alloc.base] = len(handles)
            handles.append({"kind": HANDLE_KIND, "ipc_handle": alloc.ipc_handle, "size": alloc.size,
                            "device": alloc.device, "device_uuid": alloc.device_uuid})
        regions.append({"name": region.name, "handle": index, "offset": t.ptr - alloc.base,
                        "stride": region.block_bytes})
    return {"layout": layout.to_wire(), "handles": handles, "regions": regions, "pid": pid}


def _check_tensor(layout: CacheLayout, name: str, block_bytes: int, t: DeviceTensor) -> None:
    is_scale = name.startswith(("ks.", "vs."))
    itemsize = DTYPE_SIZES[layout.scale_dtype] if is_scale else layout.itemsize
    expected = layout.scale_shape() if is_scale else layout.tensor_shape()
    if not t.contiguous:
        raise InvalidLayout(f"region {name}: the tensor is not contiguous", region=name)
    if t.itemsize != itemsize:
        raise InvalidLayout(f"region {name}: elements of {t.itemsize} bytes, the layout says {itemsize}",
                            region=name, itemsize=t.itemsize, expected=itemsize)
    # Blocks must be the leading dimension; how a block's own bytes are ordered inside is
    # the engine's business (FastDeploy: [blocks, heads, tokens, dim]) as long as it is
    # block_bytes long.
    if not t.shape or t.shape[0] != layout.num_blocks or t.nbytes != layout.num_blocks * block_bytes:
        raise InvalidLayout(f"region {name}: shape {list(t.shape)} does not hold {layout.num_blocks} blocks of "
                            f"{block_bytes} bytes (expected {list(expected)})", region=name,
                            shape=list(t.shape), expected=list(expected))
    if t.ptr <= 0:
        raise InvalidLayout(f"region {name}: null device address", region=name)


def driver_locator(driver: CudaDriver) -> Callable[[DeviceTensor], Allocation]:
    """``locate`` backed by the CUDA driver: the allocation, device and IPC handle of a tensor."""

    def locate(t: DeviceTensor) -> Allocation:
        hint = t.device if t.device is not None else 0
        with driver.on_device(hint):
            try:
                memory_type = driver.pointer_attribute(t.ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
                ordinal = driver.pointer_attribute(t.ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
            except CudaError as exc:
                raise InvalidLayout(f"the address is not CUDA memory (a CPU tensor?): {exc.message}",
                                    **exc.details) from None
        if memory_type != CU_MEMORYTYPE_DEVICE:
            raise InvalidLayout("the tensor is not in GPU device memory", memory_type=memory_type)
        with driver.on_device(ordinal):
            try:
                capable = driver.pointer_attribute(t.ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
            except CudaError:
                capable = 1  # a driver too old to say; cuIpcGetMemHandle will tell
            if not capable:
                raise InvalidLayout(
                    "the allocation comes from a stream-ordered or virtual-memory pool, which legacy CUDA IPC "
                    "cannot share (torch: unset PYTORCH_CUDA_ALLOC_CONF expandable_segments; paddle: keep "
                    "FLAGS_use_cuda_malloc_async_allocator and FLAGS_use_virtual_memory_auto_growth off)")
            base, size = driver.address_range(t.ptr)
            handle = driver.ipc_get_handle(base)
            uuid = driver.device_uuid(ordinal)
        return Allocation(base, size, ordinal, uuid, handle)

    return locate


# -- the engine's entry point ----------------------------------------------------------------


class CudaCacheExport:
    """A GPU cache exported for kvswapd: pass it to ``Client.register``.

    It holds the tensors, so they live as long as the export does.
    """

    def __init__(self, layout: CacheLayout, body: dict[str, Any], tensors: Mapping[str, Any]) -> None:
        self.layout = layout
        self._body = body
        self.tensors = dict(tensors)

    @property
    def handles(self) -> list[dict[str, Any]]:
        return self._body["handles"]

    @property
    def device(self) -> int:
        return int(self._body["handles"][0]["device"])

    def registration(self) -> dict[str, Any]:
        """The body of a ``register`` request for this cache."""
        return dict(self._body)


def export_cuda_cache(layout: CacheLayout, keys: Sequence[Any], values: Sequence[Any] | None = None,
                      key_scales: Sequence[Any] | None = None, value_scales: Sequence[Any] | None = None,
                      *, pid: int | None = None, driver: CudaDriver | None = None) -> CudaCacheExport:
    """Export the engine's GPU cache tensors (paddle, torch or CuPy), one per layer and kind.

    ``keys[l]``/``values[l]`` are ``[num_blocks, num_kv_heads, block_size, head_dim]``
    tensors of the layout's dtype (uint8 for fp8); fp8 adds ``key_scales[l]``/
    ``value_scales[l]`` ``[num_blocks, num_kv_heads, block_size]``; MLA passes keys only.
    Layers count the extra (speculative) layers after the model's own.

    Raises :class:`InvalidLayout` for a tensor that does not match the layout or cannot be
    shared, and :class:`CudaError` when there is no usable CUDA driver.
    """
    tensors = region_tensors(layout, keys, values, key_scales, value_scales)
    described = {name: describe_tensor(t) for name, t in tensors.items()}
    driver = driver or CudaDriver.load()
    body = build_cuda_registration(layout, described, driver_locator(driver), os.getpid() if pid is None else pid)
    return CudaCacheExport(layout, body, tensors)
