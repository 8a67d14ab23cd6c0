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
framework is imported here; the driver is reached through ``ctypes`` (``libcuda.so.1``, the
binding in :mod:`kvswap.common.cuda_driver` that the daemon's movers use too), only when a
function is called, so ``kvswap.protocol`` still imports with numpy alone. ``CudaDriver`` and
``CudaError`` are re-exported here: :func:`export_cuda_cache` takes the one and raises the other.

Keep the returned :class:`CudaCacheExport` (or the tensors) alive while the daemon uses the
cache: the daemon maps the engine's memory, and memory the engine frees is not the daemon's
to read. When the engine process exits, the daemon notices and closes its mappings, so the
GPU memory goes back to the driver.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Final, Mapping, Sequence

from kvswap.common.cuda_driver import (
    CU_MEMORYTYPE_DEVICE,
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    IPC_HANDLE_BYTES,
    CudaDriver,
    CudaError,
)

from .errors import InvalidLayout
from .layout import DTYPE_SIZES, CacheLayout

__all__ = [
    "HANDLE_KIND",
    "HandleTable",
    "IPC_HANDLE_BYTES",
    "Allocation",
    "CudaCacheExport",
    "CudaDriver",
    "CudaError",
    "DeviceTensor",
    "build_cuda_registration",
    "describe_tensor",
    "driver_locator",
    "export_cuda_cache",
    "region_tensors",
]

#: The ``kind`` of a CUDA IPC memory handle in a ``register`` request.
HANDLE_KIND: Final = "cuda_ipc"


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
    table = HandleTable(locate)
    for region in layout.regions:
        if region.name not in tensors:
            raise InvalidLayout(f"no tensor for region {region.name}", region=region.name)
        t = tensors[region.name]
        _check_tensor(layout, region.name, region.block_bytes, t)
        table.add(region.name, f"region {region.name}", t, region.block_bytes)
    return table.body(layout, pid)


class HandleTable:
    """The ``cuda_ipc`` handles of one registration, one per CUDA allocation, and the regions
    placed in them: ``add`` each region's memory (block 0 to the end of its last block), then
    take the ``body``. Every region must be on the one device the daemon serves."""

    def __init__(self, locate: Callable[[DeviceTensor], Allocation]) -> None:
        self.locate = locate
        self.handles: list[dict[str, Any]] = []
        self.regions: list[dict[str, Any]] = []
        self._by_base: dict[int, int] = {}
        self._device: tuple[int, str] | None = None

    def add(self, region: str, what: str, memory: DeviceTensor, stride: int) -> None:
        """Place ``region`` (``what`` names it in errors: "region k.0", "layer ...") whose
        blocks span ``memory``, ``stride`` bytes apart."""
        try:
            alloc = self.locate(memory)
        except (CudaError, InvalidLayout) as exc:
            raise InvalidLayout(f"{what}: its memory cannot be shared over CUDA IPC: {exc.message}",
                                **{**exc.details, "region": region}) from None
        if not (alloc.base <= memory.ptr and memory.ptr + memory.nbytes <= alloc.base + alloc.size):
            raise InvalidLayout(f"{what}: its blocks run past the CUDA allocation that holds block 0", region=region)
        if self._device is None:
            self._device = (alloc.device, alloc.device_uuid)
        elif self._device != (alloc.device, alloc.device_uuid):
            raise InvalidLayout(f"{what} is on device {alloc.device}, the others on {self._device[0]}; one daemon "
                                "serves one GPU", region=region)
        index = self._by_base.get(alloc.base)
        if index is None:
            index = self._by_base[alloc.base] = len(self.handles)
            self.handles.append({"kind": HANDLE_KIND, "ipc_handle": alloc.ipc_handle, "size": alloc.size,
                                 "device": alloc.device, "device_uuid": alloc.device_uuid})
        self.regions.append({"name": region, "handle": index, "offset": memory.ptr - alloc.base, "stride": stride})

    def body(self, layout: CacheLayout, pid: int) -> dict[str, Any]:
        return {"layout": layout.to_wire(), "handles": self.handles, "regions": self.regions, "pid": pid}


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
