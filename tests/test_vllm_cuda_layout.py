"""vLLM's GPU KV cache described for kvswapd (kvswap.engines.vllm.cuda), checked against the bytes
on a CPU: a numpy buffer stands in for vLLM's one backing CUDA allocation, viewed per layer
exactly as vLLM 0.32 views it (a twin of its placement code, cross-checked against vLLM's own
functions where the vLLM test environment exists), and the regions the plan produces must
address exactly each block's K and V bytes, through the daemon's own placement checks and
its GPU movers' CPU twins."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.common.cuda_driver import CudaError
from kvswap.daemon.movers.copy_plan import plan_arrays
from kvswap.daemon.movers.gpu_plan import (
    AddressSpace,
    chunk_table,
    check_fits,
    gather_rows,
    parse_cuda_handles,
    row_plan,
    run_chunk_table,
    scatter_rows,
)
from kvswap.daemon.registration import Registration
from kvswap.engines.vllm import memory
from kvswap.engines.vllm.cuda import (
    CachePlan,
    LayerView,
    cuda_registration,
    describe_view,
    plan_cache,
    registration_body,
)
from kvswap.engines.vllm.memory import CacheFacts
from kvswap.protocol.cuda_export import Allocation, DeviceTensor
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import CACHE_DTYPES, DTYPE_SIZES, CacheLayout
from support import cuda_driver_loads

UUID = "GPU-00112233-4455-6677-8899-aabbccddeeff"

#: vllm/v1/kv_cache_layout.py KVCacheLayout: the physical order of the logical [L, B, H, N, C].
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
COMPACT = ["LBNHC", "LBHNC", "BLNHC", "BLHNC"]  # a block's heads and tokens together
#: Dtypes the connector takes and the layout accepts, with their sizes (more as either grows).
DTYPES = {name: DTYPE_SIZES[kv] for name, kv in memory.TORCH_DTYPES.items() if kv in CACHE_DTYPES}
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


no_cuda_here = pytest.mark.skipif(cuda_driver_loads(), reason="this machine has a CUDA driver")


# -- a twin of vLLM 0.32's placement -----------------------------------------------------------------


def layout_strides(order: tuple[int, ...], shape: tuple[int, ...], fixed: tuple[int | None, ...]) -> list[int]:
    """vllm/v1/kv_cache_interface.py compute_layout_strides (no page padding): byte strides
    of the logical [L, B, H, N, C-bytes] in physical order ``order``, innermost first."""
    strides, current = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


@dataclass
class VllmCache:
    """What vLLM hands a connector, on host memory: the backing buffer and per-layer views."""

    raw: np.ndarray                 # uint8, the stand-in for the CUDA allocation
    views: dict[str, np.ndarray]    # layer -> [blocks * ratio, H, N / ratio, C], typed (unsigned bits)
    described: dict[str, LayerView]
    facts: CacheFacts
    ratio: int


def vllm_cache(layout: str, layers: int = 2, num_blocks: int = 4, block_size: int = 16, heads: int = 2,
               head_dim: int = 8, dtype: str = "bfloat16", ratio: int = 1, mla: bool = False, lead: int = 256,
               seed: int = 0) -> VllmCache:
    """vLLM's placement of one cache group of uniform layers: kv_cache_utils
    get_kv_cache_config_from_groups (layer and block strides; block-outermost layouts put every
    layer's page inside each block), then kv_cache_interface create_kv_cache_views (kernel
    blocks: ``ratio`` per manager block), as ``as_strided`` views of one buffer ``lead``
    bytes into the allocation."""
    itemsize = DTYPES[dtype]
    content = head_dim if mla else 2 * head_dim
    page = heads * block_size * content * itemsize
    order = LAYOUTS[layout]
    shape = (layers, num_blocks, heads, block_size, content * itemsize)
    fixed_block = layers * page if order[0] == 1 else None
    layer_stride, block_stride, *_ = layout_strides(order, shape, (None, fixed_block, None, None, None))
    if ratio > 1:
        assert block_stride == page, "vLLM splits only dense pages into kernel blocks"
        block_stride //= ratio
    view_shape = (layers, num_blocks * ratio, heads, block_size // ratio, content * itemsize)
    strides = layout_strides(order, view_shape, (layer_stride, block_stride, None, None, None))
    raw = np.random.default_rng(seed).integers(0, 256, lead + layers * num_blocks * page + 64, dtype=np.uint8)
    views, described = {}, {}
    for layer in range(layers):
        name = f"model.layers.{layer}.self_attn.attn"
        start = lead + layer * layer_stride
        u8 = np.lib.stride_tricks.as_strided(raw[start:], view_shape[1:], tuple(strides[1:]))
        typed = u8.view(UNSIGNED[itemsize])
        views[name] = typed
        described[name] = LayerView(raw.ctypes.data + start, typed.shape,
                                    tuple(s // itemsize for s in typed.strides), itemsize, dtype)
    facts = CacheFacts("org/model", num_blocks=num_blocks, block_size=block_size, num_kv_heads=heads,
                       head_dim=head_dim)
    return VllmCache(raw, views, described, facts, ratio)


def one_allocation(cache: VllmCache):
    base, size = cache.raw.ctypes.data, cache.raw.nbytes

    def locate(t: DeviceTensor) -> Allocation:
        assert base <= t.ptr < base + size, "asked about memory outside the allocation"
        return Allocation(base, size, 0, UUID, b"\x07" * 64)

    return locate


# -- the checks against the bytes --------------------------------------------------------------------


def element_bytes(view: np.ndarray, base: int) -> np.ndarray:
    """The byte offsets (from ``base``) every element of ``view`` occupies, sorted."""
    offsets = np.zeros(view.shape, dtype=np.int64) + (view.ctypes.data - base)
    for axis, (size, stride) in enumerate(zip(view.shape, view.strides)):
        index = np.arange(size, dtype=np.int64).reshape([-1 if a == axis else 1 for a in range(view.ndim)])
        offsets = offsets + index * stride
    return np.sort((offsets.reshape(-1, 1) + np.arange(view.itemsize)).reshape(-1))


def canonical(block: np.ndarray) -> np.ndarray:
    """A manager block's logical view ``[ratio, H, N / ratio, C]`` as ``[H, block_size, C]``."""
    r, h, n, c = block.shape
    return block.transpose(1, 0, 2, 3).reshape(h, r * n, c)


def decode(chunk: np.ndarray, order: str, cache: VllmCache) -> np.ndarray:
    """A record's chunk of one layer read back through ``order`` as ``[H, block_size, C]``."""
    view = next(iter(cache.views.values()))
    _, heads, tokens, content = view.shape
    sizes = {"R": cache.ratio, "H": heads, "N": tokens if "R" in order else tokens * cache.ratio, "C": content}
    axes = "RHNC" if "R" in order else "HNC"
    arr = chunk.view(view.dtype).reshape([sizes[a] for a in order])
    for a in axes:  # the axes of one element the order leaves out
        if a not in order:
            arr, order = arr[..., None], order + a
    arr = arr.transpose([order.index(a) for a in axes])
    return canonical(arr) if "R" in axes else arr


def check_plan_against_bytes(cache: VllmCache, plan: CachePlan) -> None:
    base = cache.raw.ctypes.data
    layer_views = list(cache.views.values())
    assert len(plan.regions) == len(layer_views)
    head_dim = cache.facts.head_dim
    for span, view in zip(plan.regions, layer_views):
        for b in range(cache.facts.num_blocks):
            block = view[b * cache.ratio:(b + 1) * cache.ratio]
            start = span.ptr - base + b * span.stride
            # The region's span for block b is exactly the bytes of that block's K and V elements.
            np.testing.assert_array_equal(element_bytes(block, base), np.arange(start, start + span.block_bytes))
            chunk = cache.raw[start:start + span.block_bytes]
            got, want = decode(chunk, plan.block_order, cache), canonical(block)
            np.testing.assert_array_equal(got[..., :head_dim], want[..., :head_dim])  # K (MLA: the latent)
            np.testing.assert_array_equal(got[..., head_dim:], want[..., head_dim:])  # V


def daemon_placements(body: dict):
    """What kvswapd does with the body before it opens anything (Registration.attach's checks,
    which need no GPU): the layout, region list, handle fields and fits."""
    layout = CacheLayout.from_wire(body["layout"])
    placements = Registration._placements(layout, body["handles"], body["regions"])
    specs = parse_cuda_handles(body["handles"])
    check_fits(placements, [s.size for s in specs], layout.num_blocks)
    return layout, placements


def check_daemon_moves_the_blocks(cache: VllmCache, plan: CachePlan, body: dict, blocks: list[int]) -> None:
    """The GPU movers' CPU twins (the CuPy chunk table and paddle's row gather/scatter) on the
    registration: records are each block's chunks in region order, and scattering them back
    into scrambled blocks restores every byte."""
    layout, placements = daemon_placements(body)
    base = cache.raw.ctypes.data
    want = np.stack([np.concatenate([cache.raw[s.ptr - base + b * s.stride:][:s.block_bytes] for s in plan.regions])
                     for b in blocks])
    staging = np.zeros((len(blocks), layout.record_bytes), dtype=np.uint8)
    table = chunk_table(plan_arrays(placements, blocks, layout.record_bytes), [base], staging.ctypes.data,
                        gather=True)
    run_chunk_table(table, AddressSpace([cache.raw, staging]))
    np.testing.assert_array_equal(staging, want)
    rows = row_plan(placements, [cache.raw.nbytes], [base], layout.record_bytes)
    np.testing.assert_array_equal(gather_rows(rows, [cache.raw], blocks), want)
    before = cache.raw.copy()
    for s in plan.regions:  # scramble the blocks, then load them back
        for b in blocks:
            cache.raw[s.ptr - base + b * s.stride:][:s.block_bytes] ^= 0x5A
    assert not np.array_equal(cache.raw, before)
    scatter_rows(rows, [cache.raw], blocks, staging)
    np.testing.assert_array_equal(cache.raw, before)


# -- each vLLM layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, order, ratio", [
    ("LBNHC", "NHC", 1), ("LBHNC", "HNC", 1), ("BLNHC", "NHC", 1), ("BLHNC", "HNC", 1),
    ("LBNHC", "NHC", 4), ("LBHNC", "RHNC", 4),
])
def test_attention_layouts_address_each_blocks_k_and_v(layout: str, order: str, ratio: int) -> None:
    cache = vllm_cache(layout, layers=3, ratio=ratio)
    plan = plan_cache(cache.described, cache.facts)
    assert plan.block_order == order
    assert plan.layout.packed_kv and plan.layout.has_values
    assert [r.name for r in plan.regions] == ["kv.0", "kv.1", "kv.2"]
    page = 2 * 16 * 2 * 8 * 2
    assert [r.block_bytes for r in plan.regions] == [page] * 3
    block_outer = layout.startswith("B")
    assert [r.stride for r in plan.regions] == [3 * page if block_outer else page] * 3
    step = page if block_outer else 4 * page
    assert [r.ptr - cache.raw.ctypes.data for r in plan.regions] == [256, 256 + step, 256 + 2 * step]
    check_plan_against_bytes(cache, plan)
    body = registration_body(plan, one_allocation(cache), pid=123)
    assert [(r["name"], r["handle"], r["offset"], r["stride"]) for r in body["regions"]] == \
        [(s.name, 0, s.ptr - cache.raw.ctypes.data, s.stride) for s in plan.regions]
    check_daemon_moves_the_blocks(cache, plan, body, [3, 0, 2])


def test_the_worked_example() -> None:
    cache = vllm_cache("LBNHC", layers=2, num_blocks=4, block_size=16, heads=2, head_dim=64, lead=0)
    view = cache.described["model.layers.0.self_attn.attn"]
    assert view.shape == (4, 2, 16, 128) and view.strides == (4096, 128, 256, 1)
    plan = plan_cache(cache.described, cache.facts)
    base = cache.raw.ctypes.data
    assert [(r.name, r.ptr - base, r.stride, r.block_bytes) for r in plan.regions] == \
        [("kv.0", 0, 8192, 8192), ("kv.1", 32768, 8192, 8192)]
    outer = plan_cache(vllm_cache("BLNHC", layers=2, num_blocks=4, block_size=16, heads=2, head_dim=64,
                                  lead=0).described, cache.facts)
    assert [(r.ptr - min(s.ptr for s in outer.regions), r.stride) for r in outer.regions] == \
        [(0, 16384), (8192, 16384)]


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_mla_is_a_keys_only_layout(layout: str) -> None:
    cache = vllm_cache(layout, layers=2, heads=1, head_dim=24, mla=True)
    plan = plan_cache(cache.described, cache.facts)
    assert not plan.layout.has_values and not plan.layout.packed_kv
    assert [r.name for r in plan.regions] == ["k.0", "k.1"]
    assert plan.block_order == "NC"
    assert plan.layout.record_bytes == 2 * 16 * 24 * 2
    check_plan_against_bytes(cache, plan)
    check_daemon_moves_the_blocks(cache, plan, registration_body(plan, one_allocation(cache), 0), [1, 3])


def test_layers_sharing_one_cache_are_registered_once() -> None:
    cache = vllm_cache("LBNHC", layers=2)
    names = list(cache.described)
    shared = {**cache.described, "model.layers.2.self_attn.attn": cache.described[names[0]]}
    plan = plan_cache(shared, cache.facts)
    assert [r.layer for r in plan.regions] == names
    assert plan.layout.num_layers == 2


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_supported_dtype_names_the_layout(dtype: str) -> None:
    cache = vllm_cache("LBHNC", dtype=dtype)
    plan = plan_cache(cache.described, cache.facts)
    assert plan.layout.dtype == memory.TORCH_DTYPES[dtype]
    assert plan.regions[0].block_bytes == 2 * 16 * 2 * 8 * DTYPES[dtype]
    check_plan_against_bytes(cache, plan)


# -- property tests over shapes ----------------------------------------------------------------------


@st.composite
def shapes(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    mla = draw(st.booleans())
    return dict(
        layout=draw(st.sampled_from(sorted(LAYOUTS))), layers=draw(st.integers(1, 4)),
        num_blocks=draw(st.integers(1, 6)), block_size=block_size, heads=1 if mla else draw(st.integers(1, 4)),
        head_dim=draw(st.integers(1, 8)), dtype=draw(st.sampled_from(sorted(DTYPES))), mla=mla,
        ratio=draw(st.sampled_from([r for r in (1, 2, 4) if block_size % r == 0])), lead=draw(st.integers(0, 64)),
    )


def blocks_are_runs(cache: VllmCache) -> bool:
    """The oracle: every manager block of every layer is one contiguous run, the same distance
    (at least a block) from the one before."""
    base = cache.raw.ctypes.data
    for view in cache.views.values():
        starts = []
        for b in range(cache.facts.num_blocks):
            offsets = element_bytes(view[b * cache.ratio:(b + 1) * cache.ratio], base)
            if not np.array_equal(offsets, np.arange(offsets[0], offsets[0] + offsets.size)):
                return False
            starts.append(int(offsets[0]))
        if len(set(np.diff(starts).tolist())) > 1 or any(d < offsets.size for d in np.diff(starts).tolist()):
            return False
    return True


@settings(max_examples=120, deadline=None)
@given(shapes())
def test_plans_match_the_bytes_for_any_shape(shape) -> None:
    if shape["ratio"] > 1 and shape["layout"] not in ("LBNHC", "LBHNC", "LHBNC"):
        shape["ratio"] = 1  # vLLM splits only dense pages: layer-outermost layouts
    if shape["ratio"] > 1 and shape["layout"] == "LHBNC" and shape["heads"] > 1:
        shape["ratio"] = 1
    cache = vllm_cache(**shape)
    if not blocks_are_runs(cache):
        with pytest.raises(InvalidLayout, match="not contiguous"):
            plan_cache(cache.described, cache.facts)
        return
    plan = plan_cache(cache.described, cache.facts)
    assert plan.layout.num_layers == shape["layers"]
    assert plan.layout.has_values is not shape["mla"]
    check_plan_against_bytes(cache, plan)
    body = registration_body(plan, one_allocation(cache), 0)
    layout, placements = daemon_placements(body)
    assert layout == plan.layout
    assert [p.offset + cache.raw.ctypes.data for p in placements] == [s.ptr for s in plan.regions]


def test_blocks_outside_heads_are_refused() -> None:
    for layout in ("BHLNC", "LHBNC"):
        cache = vllm_cache(layout, heads=2)
        with pytest.raises(InvalidLayout, match="not contiguous.*VLLM_KV_CACHE_LAYOUT") as err:
            plan_cache(cache.described, cache.facts)
        assert err.value.details["layer"] == "model.layers.0.self_attn.attn"


# -- refusals ----------------------------------------------------------------------------------------


def _changed(view: LayerView, **changes) -> LayerView:
    return LayerView(**{**view.__dict__, **changes})


def test_refusals_name_what_is_wrong() -> None:
    cache = vllm_cache("LBNHC", layers=2)
    first, second = list(cache.described)
    good = cache.described[first]

    def refused(views, match: str, facts: CacheFacts = cache.facts) -> None:
        with pytest.raises(InvalidLayout, match=match):
            plan_cache(views, facts)

    refused({first: good, second: _changed(cache.described[second], dtype="float16" if good.dtype != "float16"
                                           else "bfloat16")}, "mix KV cache dtypes")
    refused({first: _changed(good, dtype="int8", itemsize=1)}, "dtype int8 is not supported")
    # A non-contiguous block: the heads' stride doubled leaves gaps.
    refused({first: _changed(good, strides=(good.strides[0] * 2, good.strides[1] * 2) + good.strides[2:])},
            "not contiguous")
    # Blocks that overlap: the next block starts inside this one.
    refused({first: _changed(good, strides=(good.strides[0] // 2,) + good.strides[1:])}, "not contiguous|overlap")
    # vLLM's Mamba state and other caches without layer views: the raw int8 buffer.
    refused({first: LayerView(good.ptr, (1 << 20,), (1,), 1, "int8")}, "not vLLM's per-layer")
    # The 5-D layouts of older vLLMs ([2, blocks, tokens, heads, dim]) are not 0.32's.
    refused({first: LayerView(good.ptr, (2, 4, 16, 2, 8), (1024, 256, 16, 8, 1), 2, "bfloat16")},
            "not vLLM's per-layer")
    refused({first: good}, "3 heads in the view|2 heads in the view",
            CacheFacts("m", num_blocks=4, block_size=16, num_kv_heads=3, head_dim=8))
    refused({first: good}, "K and V of head_dim 6 make 12",
            CacheFacts("m", num_blocks=4, block_size=16, num_kv_heads=2, head_dim=6))
    refused({first: good}, "not a multiple of the 3 blocks",
            CacheFacts("m", num_blocks=3, block_size=16, num_kv_heads=2, head_dim=8))
    refused({first: good}, "tokens per block; vLLM's blocks are 32 tokens",
            CacheFacts("m", num_blocks=4, block_size=32, num_kv_heads=2, head_dim=8))
    refused({}, "no KV cache layers")


def test_layers_of_different_orders_are_refused() -> None:
    nhc = vllm_cache("LBNHC", layers=1).described
    hnc = vllm_cache("LBHNC", layers=1, seed=1).described
    views = {"a": next(iter(nhc.values())), "b": next(iter(hnc.values()))}
    with pytest.raises(InvalidLayout, match="NHC vs K and V, HNC"):
        plan_cache(views, vllm_cache("LBNHC").facts)


# -- the register body: handles and allocations ------------------------------------------------------


def test_one_handle_per_allocation_and_offsets_inside_it() -> None:
    cache = vllm_cache("LBNHC", layers=4)
    plan = plan_cache(cache.described, cache.facts)
    base = cache.raw.ctypes.data
    half = plan.regions[2].ptr  # layers 2 and 3 in a second allocation starting there
    asked = []

    def locate(t: DeviceTensor) -> Allocation:
        asked.append((t.ptr, t.nbytes))
        if t.ptr < half:
            return Allocation(base, half - base, 0, UUID, b"\x01" * 64)
        return Allocation(half, base + cache.raw.nbytes - half, 0, UUID, b"\x02" * 64)

    body = registration_body(plan, locate, pid=7)
    assert [h["ipc_handle"] for h in body["handles"]] == [b"\x01" * 64, b"\x02" * 64]
    assert [h["size"] for h in body["handles"]] == [half - base, base + cache.raw.nbytes - half]
    step = 4 * plan.regions[0].block_bytes
    assert [(r["handle"], r["offset"]) for r in body["regions"]] == [(0, 256), (0, 256 + step), (1, 0), (1, step)]
    # Each region is asked about with its whole span, block 0 to the end of the last block.
    assert asked == [(s.ptr, s.end(4) - s.ptr) for s in plan.regions]
    assert body["pid"] == 7 and body["layout"] == plan.layout.to_wire()
    daemon_placements(body)


def test_body_refusals() -> None:
    cache = vllm_cache("BLHNC", layers=2)
    plan = plan_cache(cache.described, cache.facts)
    base = cache.raw.ctypes.data

    def short(t: DeviceTensor) -> Allocation:  # ends one byte before layer 1's last block does
        return Allocation(base, plan.regions[1].end(4) - base - 1, 0, UUID, b"\x01" * 64)

    with pytest.raises(InvalidLayout, match="run past the CUDA allocation"):
        registration_body(plan, short, 0)

    def two_gpus(t: DeviceTensor) -> Allocation:
        device = 0 if t.ptr == plan.regions[0].ptr else 1
        return Allocation(base, cache.raw.nbytes, device, UUID[:-1] + str(device), b"\x01" * 64)

    with pytest.raises(InvalidLayout, match="one daemon serves one GPU"):
        registration_body(plan, two_gpus, 0)

    def not_ipc(t: DeviceTensor) -> Allocation:
        raise CudaError("cuIpcGetMemHandle", 1, "CUDA_ERROR_INVALID_VALUE")

    with pytest.raises(InvalidLayout, match="cannot be shared over CUDA IPC") as err:
        registration_body(plan, not_ipc, 0)
    assert err.value.details["region"] == "kv.0"


@no_cuda_here
def test_the_daemon_accepts_the_body_up_to_opening_the_handle() -> None:
    """Registration.attach runs every check of the body, then needs a GPU to open the handle."""
    cache = vllm_cache("LBNHC", layers=2)
    body = registration_body(plan_cache(cache.described, cache.facts), one_allocation(cache), 0)
    with pytest.raises(InvalidLayout, match="need a CUDA GPU"):
        Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])
    body["regions"][1]["offset"] = cache.raw.nbytes  # and the same checks refuse a region outside it
    with pytest.raises(InvalidLayout, match="region kv.1 needs"):
        Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])


# -- the entry point, without CUDA ---------------------------------------------------------------------


class FakeTorchTensor:
    """What describe_view reads of a torch tensor."""

    def __init__(self, view: LayerView, device_type: str = "cuda") -> None:
        self._view = view
        self.shape = view.shape
        self.dtype = f"torch.{view.dtype}"
        self.device = SimpleNamespace(type=device_type, index=0 if device_type == "cuda" else None)

    def data_ptr(self) -> int:
        return self._view.ptr

    def stride(self) -> tuple[int, ...]:
        return self._view.strides

    def element_size(self) -> int:
        return self._view.itemsize


def test_describe_view_reads_torchs_accessors_and_refuses_cpu_tensors() -> None:
    view = next(iter(vllm_cache("LBNHC").described.values()))
    assert describe_view(FakeTorchTensor(view)) == LayerView(**{**view.__dict__, "device": 0})
    with pytest.raises(InvalidLayout, match="not a CUDA device"):
        describe_view(FakeTorchTensor(view, "cpu"))


@no_cuda_here
def test_cuda_registration_without_a_driver_is_invalid_layout() -> None:
    cache = vllm_cache("LBNHC")
    tensors = {name: FakeTorchTensor(v) for name, v in cache.described.items()}
    with pytest.raises(InvalidLayout, match="no usable CUDA driver"):
        cuda_registration(tensors, cache.facts)


# -- the twin against vLLM's own code ----------------------------------------------------------------

VLLM_PYTHON = Path(os.environ.get("KVSWAP_VLLM_PYTHON")
                   or Path(os.environ.get("KVSWAP_TEST_VLLM_ENV", Path.home() / ".cache" / "kvswap-test-vllm"))
                   / "bin" / "python")
CASES = [(layout, 1, False) for layout in LAYOUTS] + [("LBNHC", 4, False), ("LBHNC", 2, False),
                                                       ("LBNHC", 1, True), ("BLHNC", 1, True)]
VLLM_VIEWS = """
import json, sys, torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
    compute_layout_strides, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
out = []
for name, ratio, mla in json.loads(sys.argv[1]):
    layout = KVCacheLayout[name]
    spec = (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16) if mla else
            FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16))
    layers, blocks = 3, 4
    # kv_cache_utils.get_kv_cache_config_from_groups, one group
    fixed = layers * spec.page_size_bytes if layout.is_block_outermost else None
    ls, bs, *_ = compute_layout_strides(spec, blocks, layers, layout, fixed_strides=(None, fixed, None, None, None))
    tensor = KVCacheTensor(size=layers * blocks * spec.page_size_bytes, layers=["a", "b", "c"],
                           layer_stride=ls, block_stride=bs)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, blocks, layout, tensor, kernel_block_size=16 // ratio)
    out.append([[v.data_ptr() - raw.data_ptr(), list(v.shape), list(v.stride()), v.element_size()] for v in views])
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} "
                    "(tests/test_vllm_connector.py builds it)")
def test_the_twin_places_views_as_vllm_does() -> None:
    """vLLM 0.32's own allocate path (create_kv_cache_views over one int8 buffer, strides from
    compute_layout_strides) gives the views this file's twin gives, for every layout."""
    run = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_VIEWS, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for (layout, ratio, mla), views in zip(CASES, got, strict=True):
        cache = vllm_cache(layout, layers=3, num_blocks=4, block_size=16, heads=1 if mla else 2, head_dim=8,
                           ratio=ratio, mla=mla)
        base = cache.raw.ctypes.data + 256
        twin = [[v.ptr - base, list(v.shape), list(v.strides), v.itemsize] for v in cache.described.values()]
        assert views == twin, (layout, ratio, mla)
