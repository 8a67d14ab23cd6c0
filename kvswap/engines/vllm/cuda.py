"""vLLM's GPU KV cache registered with kvswapd over CUDA IPC (engine side).

How vLLM 0.32 lays the cache out, on a GPU as on a CPU (``allocate_kv_cache`` in
vllm/v1/worker/utils.py, ``create_kv_cache_views`` in vllm/v1/kv_cache_interface.py): one flat
``torch.zeros(size, dtype=int8, device=...)`` backs every KV cache tensor of the model, and
each attention layer gets a view of it of logical shape ``[B, H, N, C]``: blocks, KV heads,
tokens per block, and per head and token the content, K then V (``head_size + head_size_v``
elements; FlashAttention splits it with ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).
MLA has ``H = 1`` and ``C = head_size`` (the latent, ``kv_lora_rank + qk_rope_head_dim``: its
``head_size_v`` is 0). Which axis is outermost in memory is the resolved ``KVCacheLayout``
(vllm/v1/kv_cache_layout.py): ``LBNHC`` (FlashAttention's, the default), ``LBHNC`` (the CPU
backend's), ``BLNHC``, ``BLHNC``, ``BHLNC``, ``LHBNC``. Where the backend's kernels take smaller
blocks than the manager's, ``B`` counts kernel blocks (``num_blocks * ratio`` of
``N = block_size / ratio`` tokens, consecutive kernel blocks making one manager block).
:func:`plan_cache` reads all of that from each view's shape, strides and address, never from
the backend's name.

kvswapd addresses a block of a region as ``block_bytes`` at ``offset + block * stride``: one
manager block of one layer must be one contiguous run. It is in the four layouts that keep
``B`` outside ``H`` and ``N`` (``LB..C`` and ``BL..C``); ``BHLNC`` and ``LHBNC`` put a block's
heads apart and are refused with :class:`InvalidLayout`, as is anything else not described
here. Attention layers become ``kv.<layer>`` regions of a ``packed_kv`` layout (K and V inside
each block, as memory.build_registration describes the CPU cache), MLA layers ``k.<layer>``
regions of a keys-only layout (``has_values=False``).

A ``cuda_ipc`` handle names a CUDA allocation, not a tensor: regions are offsets inside the
allocation that holds them, which the driver names (``cuMemGetAddressRange``, through
:func:`kvswap.protocol.cuda_export.driver_locator`). vLLM's one backing buffer is normally one
allocation, so one handle; a buffer the caching allocator carved from a larger segment is
described as it is.

The byte order inside a block (:attr:`CachePlan.block_order`, e.g. ``NHC`` for LBNHC) goes into
the layout's ``block_order``, so it is part of the namespace: a GPU engine on LBNHC and a CPU
engine (LBHNC) of the same model and shape order a block's bytes differently, and must not
read each other's records.

Importing this module needs neither torch nor CUDA: torch tensors are read through their
attributes (:func:`describe_view`), and the layout logic (:func:`plan_cache`,
:func:`registration_body`) runs on plain :class:`LayerView` descriptions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kvswap.protocol.cuda_export import (
    Allocation,
    CudaDriver,
    CudaError,
    DeviceTensor,
    HandleTable,
    driver_locator,
)
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import CacheLayout

from . import memory
from .memory import CacheFacts

__all__ = ["CachePlan", "CudaKVCache", "LayerView", "RegionSpan", "cuda_registration", "describe_view",
           "plan_cache", "registration_body"]


# -- what the layout logic needs of a view ------------------------------------------------------------


@dataclass(frozen=True)
class LayerView:
    """One layer's cache view: its address, shape, strides (in elements, as torch's
    ``stride()``), element size and dtype (torch's name without ``torch.``)."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    #: The CUDA device ordinal the tensor reports; a hint for which context to ask the driver in.
    device: int | None = None


def describe_view(tensor: Any) -> LayerView:
    """A torch tensor's :class:`LayerView` (read through its attributes; torch is not imported)."""
    device = getattr(tensor, "device", None)
    if getattr(device, "type", "cuda") != "cuda":
        raise InvalidLayout(f"the KV cache is on {device}, not a CUDA device")
    index = getattr(device, "index", None)
    return LayerView(int(tensor.data_ptr()), tuple(int(d) for d in tensor.shape),
                     tuple(int(s) for s in tensor.stride()), int(tensor.element_size()),
                     str(tensor.dtype).removeprefix("torch."), index if isinstance(index, int) else None)


# -- views -> regions (pure) --------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionSpan:
    """Where one region's blocks are: block ``b`` is ``block_bytes`` at ``ptr + b * stride``."""

    name: str
    layer: str
    ptr: int
    stride: int
    block_bytes: int

    def end(self, num_blocks: int) -> int:
        """One past the last byte of the last block."""
        return self.ptr + (num_blocks - 1) * self.stride + self.block_bytes


@dataclass(frozen=True)
class CachePlan:
    """The cache as kvswap describes it: the layout and, per region, where its blocks are."""

    layout: CacheLayout
    regions: tuple[RegionSpan, ...]
    #: The axes of one block in memory order, outermost first: ``H`` heads, ``N`` tokens, ``C``
    #: content (K then V, or MLA's latent); ``R`` kernel blocks where they do not simply
    #: continue ``N``. Axes of one element are left out (MLA: ``NC``).
    block_order: str
    device: int | None = None


@dataclass(frozen=True)
class _LayerBlock:
    keys_only: bool
    stride: int
    block_bytes: int
    order: str


def plan_cache(views: Mapping[str, LayerView], facts: CacheFacts) -> CachePlan:
    """The kvswap layout and regions of vLLM's per-layer views (see the module doc).

    Worked example: 2 layers on LBNHC, 4 blocks of 16 tokens, 2 KV heads of 64, bf16: a
    view is ``[4, 2, 16, 128]`` with strides ``(4096, 128, 256, 1)``, so a block is 8192
    contiguous bytes (``N`` outermost, then ``H``, then ``C``); layer 1 starts 32768 bytes
    after layer 0 (its four blocks later)::

        regions = (RegionSpan("kv.0", "layer.0", base,         stride=8192, block_bytes=8192),
                   RegionSpan("kv.1", "layer.1", base + 32768, stride=8192, block_bytes=8192))
        block_order = "NHC"

    On BLNHC the same cache has both layers' pages inside each block: ``kv.1`` starts at
    ``base + 8192`` and both strides are 16384. Layers that share one cache (the same address
    and strides: vLLM's cross-layer sharing, cache groups overlaid on one buffer) are
    registered once.
    """
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    spans: list[tuple[str, LayerView, _LayerBlock]] = []
    dtype_name: str | None = None
    first: tuple[str, _LayerBlock] | None = None
    for name, view in views.items():
        identity = (view.ptr, view.shape, view.strides)
        if identity in seen:
            continue
        seen.add(identity)
        block = _layer_block(name, view, facts)
        dtype_name = memory._dtype_name(view, dtype_name)
        if first is None:
            first = (name, block)
        elif (block.keys_only, block.order) != (first[1].keys_only, first[1].order):
            raise InvalidLayout(f"layers {first[0]} and {name} differ in kind or in-block order "
                                f"({_kind(first[1])}, {first[1].order} vs {_kind(block)}, {block.order}); a "
                                "kvswap layout describes one", layer=name)
        spans.append((name, view, block))
    if first is None or dtype_name is None:
        raise InvalidLayout("vLLM registered no KV cache layers")
    keys_only = first[1].keys_only
    layout = CacheLayout(facts.model_id, num_layers=len(spans), num_blocks=facts.num_blocks,
                         block_size=facts.block_size, num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
                         dtype=memory.TORCH_DTYPES[dtype_name], tp_rank=facts.tp_rank, tp_size=facts.tp_size,
                         has_values=not keys_only, packed_kv=not keys_only, block_order=first[1].order)
    regions = []
    for region, (name, view, block) in zip(layout.regions, spans):
        # Follows from the shape checks; kept as the one statement the daemon relies on.
        assert block.block_bytes == region.block_bytes, (name, block, region)
        regions.append(RegionSpan(region.name, name, view.ptr, block.stride, block.block_bytes))
    return CachePlan(layout, tuple(regions), first[1].order, next(iter(views.values())).device)


def _kind(block: _LayerBlock) -> str:
    return "MLA" if block.keys_only else "K and V"


def _layer_block(name: str, view: LayerView, facts: CacheFacts) -> _LayerBlock:
    """One manager block of one layer: what it holds, where the next one is, and that it is
    one contiguous run."""
    if len(view.shape) != 4 or len(view.strides) != 4:
        raise InvalidLayout(f"layer {name}: shape {list(view.shape)} is not vLLM's per-layer [blocks, heads, "
                            "tokens, content] view (a cache without layer views, such as Mamba state, or "
                            "another vLLM version)", layer=name, shape=list(view.shape))
    blocks, heads, tokens, content = view.shape
    if blocks == 0 or blocks % facts.num_blocks:
        raise InvalidLayout(f"layer {name}: {blocks} blocks in the view, not a multiple of the {facts.num_blocks} "
                            "blocks vLLM manages", layer=name)
    ratio = blocks // facts.num_blocks  # kernel blocks per manager block
    if tokens * ratio != facts.block_size:
        raise InvalidLayout(f"layer {name}: {ratio} kernel block(s) of {tokens} tokens per block; vLLM's blocks "
                            f"are {facts.block_size} tokens", layer=name)
    if heads != facts.num_kv_heads:
        raise InvalidLayout(f"layer {name}: {heads} heads in the view, the model has {facts.num_kv_heads} KV "
                            "heads per rank", layer=name)
    if content == 2 * facts.head_dim:
        keys_only = False
    elif content == facts.head_dim and heads == 1:
        keys_only = True  # MLA: one latent per token
    else:
        raise InvalidLayout(f"layer {name}: {content} elements per head and token; K and V of head_dim "
                            f"{facts.head_dim} make {2 * facts.head_dim} (MLA: {facts.head_dim} with one head; "
                            "K and V of different sizes are not supported)", layer=name)
    s_block, s_head, s_token, s_content = view.strides
    order = _dense_order([("R", ratio, s_block), ("H", heads, s_head), ("N", tokens, s_token),
                          ("C", content, s_content)])
    if order is None:
        raise InvalidLayout(f"layer {name}: one block is not contiguous (shape {list(view.shape)}, strides "
                            f"{list(view.strides)}): its heads or tokens lie apart, which kvswapd cannot "
                            "describe; set VLLM_KV_CACHE_LAYOUT to a layout with blocks outside heads and "
                            "tokens (LBNHC, LBHNC, BLNHC, BLHNC)", layer=name)
    block_bytes = ratio * heads * tokens * content * view.itemsize
    stride = ratio * s_block * view.itemsize
    if facts.num_blocks == 1:
        stride = max(stride, block_bytes)  # never used; kvswapd wants it at least a block
    if stride < block_bytes:
        raise InvalidLayout(f"layer {name}: blocks {stride} bytes apart overlap ({block_bytes} bytes each)",
                            layer=name)
    return _LayerBlock(keys_only, stride, block_bytes, order)


def _dense_order(axes: Sequence[tuple[str, int, int]]) -> str | None:
    """The axes' memory order, outermost first, if together they cover one contiguous run of
    elements (each axis's stride is the product of the sizes inside it); None if not.

    ``[("R", 1, 4096), ("H", 2, 128), ("N", 16, 256), ("C", 128, 1)]`` is ``"NHC"``. Kernel
    blocks directly outside tokens continue them (``RN`` is ``N``).
    """
    live = sorted((a for a in axes if a[1] > 1), key=lambda a: a[2])
    step = 1
    for _, size, stride in live:
        if stride != step:
            return None
        step *= size
    return "".join(letter for letter, _, _ in reversed(live)).replace("RN", "N")


# -- regions -> the register body ------------------------------------------------------------------


def registration_body(plan: CachePlan, locate: Callable[[DeviceTensor], Allocation], pid: int) -> dict[str, Any]:
    """The ``register`` body for ``plan``, with ``locate`` telling which CUDA allocation holds
    an address (:func:`~kvswap.protocol.cuda_export.driver_locator`, or a table in tests).

    One handle per allocation; a region's ``offset`` is its block 0 inside it. Worked example:
    the plan of :func:`plan_cache`'s example in one allocation that starts 1 MiB before
    ``base``::

        handles = [{"kind": "cuda_ipc", "ipc_handle": <64 bytes>, "size": <allocation>, ...}]
        regions = [{"name": "kv.0", "handle": 0, "offset": 1048576, "stride": 8192},
                   {"name": "kv.1", "handle": 0, "offset": 1081344, "stride": 8192}]
    """
    num_blocks = plan.layout.num_blocks
    table = HandleTable(locate)
    for span in plan.regions:
        memory = DeviceTensor(span.ptr, (span.end(num_blocks) - span.ptr,), 1, True, plan.device)
        table.add(span.name, f"layer {span.layer}", memory, span.stride)
    return table.body(plan.layout, pid)


# -- the connector's entry point -----------------------------------------------------------------------


class CudaKVCache:
    """What the connector keeps while the cache is registered: the plan, and the cache
    tensors, so the memory kvswapd has mapped stays the engine's while it does."""

    def __init__(self, plan: CachePlan, tensors: Mapping[str, Any]) -> None:
        self.plan = plan
        self.tensors = dict(tensors)

    @property
    def block_order(self) -> str:
        return self.plan.block_order


def cuda_registration(kv_caches: dict[str, Any], facts: CacheFacts) -> tuple[dict[str, Any], CudaKVCache]:
    """The ``register`` body for vLLM's per-layer GPU cache views (``register_kv_caches``'s
    argument), and the object to keep alive while registered.

    Raises :class:`InvalidLayout` for a cache kvswap cannot describe or share (the connector
    then runs without offload): see the module doc for what is described, and
    :func:`~kvswap.protocol.cuda_export.driver_locator` for memory CUDA IPC cannot share
    (torch's ``expandable_segments``, vLLM's sleep-mode allocator)."""
    views = {name: describe_view(t) for name, t in kv_caches.items()}
    plan = plan_cache(views, facts)
    try:
        driver = CudaDriver.load()
    except CudaError as exc:
        raise InvalidLayout(f"no usable CUDA driver in the engine process: {exc.message}") from None
    body = registration_body(plan, driver_locator(driver), os.getpid())
    return body, CudaKVCache(plan, kv_caches)
