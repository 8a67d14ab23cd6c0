"""Registering a GPU cache: the engine-side export (kvswap.protocol.cuda_export) with its driver
seam replaced by a table of allocations, the daemon's checks of cuda_ipc registrations
(kvswap.daemon.registration), and a live daemon on this CPU-only machine answering a cuda_ipc
registration with a typed error and carrying on."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvswap.common.cuda_driver import NO_DRIVER, CudaError, CUipcMemHandle, format_uuid
from kvswap.daemon.registration import Registration
from kvswap.protocol import CacheLayout, Client, HostKVCache, InvalidLayout
from kvswap.protocol import messages as m
from kvswap.protocol.cuda_export import (
    Allocation,
    DeviceTensor,
    build_cuda_registration,
    describe_tensor,
    export_cuda_cache,
    region_tensors,
)
from kvswap.protocol.limits import MAX_MESSAGE_BYTES, MAX_REGIONS
from support import cuda_driver_loads
from test_gpu_plans import KINDS, kind_layout

UUID = "GPU-00112233-4455-6677-8899-aabbccddeeff"


no_cuda_here = pytest.mark.skipif(cuda_driver_loads(), reason="this machine has a CUDA driver and device")


class FakeGpuTensor:
    """Anything with a __cuda_array_interface__ (CuPy, numba) looks like this to export."""

    def __init__(self, ptr: int, shape, typestr: str = "|u1", strides=None) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": tuple(shape), "typestr": typestr,
                                         "strides": strides, "version": 3}


class Allocations:
    """Stands in for the driver: which allocation holds an address, and its IPC handle."""

    def __init__(self, *spans: tuple[int, int]) -> None:
        self.spans = list(spans)
        self.asked = 0

    def locate(self, t: DeviceTensor) -> Allocation:
        self.asked += 1
        for i, (base, size) in enumerate(self.spans):
            if base <= t.ptr < base + size:
                return Allocation(base, size, 0, UUID, (i + 1).to_bytes(8, "little") * 8)
        raise CudaError("cuMemGetAddressRange_v2", 1, "CUDA_ERROR_INVALID_VALUE")


def tensors_for(layout: CacheLayout, base: int, gap: int = 0) -> dict[str, DeviceTensor]:
    """One contiguous tensor per region, one after another from ``base``."""
    out, at = {}, base
    for r in layout.regions:
        is_scale = r.name.startswith(("ks.", "vs."))
        itemsize = 4 if is_scale else layout.itemsize
        shape = layout.scale_shape() if is_scale else layout.tensor_shape()
        out[r.name] = DeviceTensor(at, shape, itemsize, True)
        at += layout.num_blocks * r.block_bytes + gap
    return out


# -- the engine side stays light ------------------------------------------------------------


def test_export_module_imports_no_framework_and_no_driver():
    """An engine imports kvswap.protocol.cuda_export with numpy alone: no paddle, torch or CuPy,
    and no CUDA driver until a function is called."""
    probe = ("import sys, kvswap.protocol, kvswap.protocol.cuda_export; "
             "print(sorted(m for m in ('paddle', 'torch', 'cupy', 'kvswap.daemon') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- which tensor is which region --------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_region_tensors_maps_every_region_of_each_kind(kind):
    layout = kind_layout(kind)
    n = layout.total_layers
    names = lambda p: [f"{p}{i}" for i in range(n)]  # noqa: E731
    out = region_tensors(layout, names("K"), names("V") if layout.has_values else None,
                         names("KS") if layout.has_scales else None,
                         names("VS") if layout.has_scales and layout.has_values else None)
    assert list(out) == [r.name for r in layout.regions]
    assert out["k.1"] == "K1"
    if layout.has_scales:
        assert out["ks.0"] == "KS0"


def test_mla_takes_keys_only():
    layout = kind_layout("mla")
    assert list(region_tensors(layout, ["a", "b"], [])) == ["k.0", "k.1"]  # empty values are fine
    with pytest.raises(InvalidLayout, match="no values") as err:
        region_tensors(layout, ["a", "b"], ["x", "y"])
    assert err.value.details["field"] == "values"


@pytest.mark.parametrize("kind, args, field", [
    ("bf16", dict(keys=["a", "b"]), "values"),
    ("bf16", dict(keys=["a"], values=["b"]), "keys"),
    ("extra_layers", dict(keys=["a", "b"], values=["c", "d"]), "keys"),   # 2 model + 2 extra layers
    ("fp8_scales", dict(keys=["a", "b"], values=["c", "d"]), "key_scales"),
    ("bf16", dict(keys=["a", "b"], values=["c", "d"], key_scales=["e", "f"]), "key_scales"),
])
def test_region_tensors_counts_per_layer(kind, args, field):
    with pytest.raises(InvalidLayout) as err:
        region_tensors(kind_layout(kind), **args)
    assert err.value.details["field"] == field


# -- reading tensors ----------------------------------------------------------------------------


def test_describe_tensor_reads_the_cuda_array_interface():
    t = describe_tensor(FakeGpuTensor(0x7F00_0000_1000, (12, 2, 4, 8), "<f2"))
    assert t == DeviceTensor(0x7F00_0000_1000, (12, 2, 4, 8), 2, True, None)
    assert t.nbytes == 12 * 2 * 4 * 8 * 2
    strided = describe_tensor(FakeGpuTensor(0x1000, (4, 2), "<f4", strides=(4, 16)))
    assert strided.contiguous is False
    assert describe_tensor(FakeGpuTensor(0x1000, (4, 2), "<f4", strides=(8, 4))).contiguous is True


def test_describe_tensor_reads_framework_accessors():
    paddle = pytest.importorskip("paddle")
    x = paddle.zeros([3, 4], dtype="bfloat16").cpu()
    t = describe_tensor(x)
    assert (t.ptr, t.shape, t.itemsize, t.contiguous, t.device) == (x.data_ptr(), (3, 4), 2, True, None)


def test_describe_tensor_refuses_what_it_cannot_read():
    with pytest.raises(InvalidLayout, match="ndarray"):
        describe_tensor(np.zeros(4))


# -- building the registration -------------------------------------------------------------------


def test_registration_shares_one_handle_per_allocation():
    layout = kind_layout("fp8_scales")
    tensors = tensors_for(layout, 0x10_0000, gap=256)
    split = tensors["k.1"].ptr  # allocation one: layer 0; allocation two: layer 1
    allocs = Allocations((0x10_0000, split - 0x10_0000), (split, 1 << 20))
    body = build_cuda_registration(layout, tensors, allocs.locate, pid=4242)
    assert body["pid"] == 4242 and body["layout"] == layout.to_wire()
    assert [h["ipc_handle"] for h in body["handles"]] == [(1).to_bytes(8, "little") * 8, (2).to_bytes(8, "little") * 8]
    assert [h["size"] for h in body["handles"]] == [split - 0x10_0000, 1 << 20]
    assert all(h["kind"] == "cuda_ipc" and h["device"] == 0 and h["device_uuid"] == UUID for h in body["handles"])
    assert [r["name"] for r in body["regions"]] == [r.name for r in layout.regions]
    assert [r["handle"] for r in body["regions"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r["stride"] for r in body["regions"]] == [r.block_bytes for r in layout.regions]
    assert [r["offset"] for r in body["regions"]][:5] == [
        0, 12 * 64 + 256, 2 * (12 * 64 + 256), 2 * (12 * 64 + 256) + 12 * 32 + 256, 0]
    # and the body is a valid register request
    request = m.decode_request(m.encode_request(m.Register(id=1, **body)))
    assert request.handles[0]["ipc_handle"] == body["handles"][0]["ipc_handle"]


def test_registration_of_the_largest_layout_fits_one_message():
    layout = CacheLayout("big", num_layers=MAX_REGIONS // 4, num_blocks=100_000, block_size=64, num_kv_heads=8,
                         head_dim=128, dtype="uint8")
    assert len(layout.regions) == MAX_REGIONS
    span = layout.num_blocks * layout.cache_block_bytes
    tensors = tensors_for(layout, 1 << 40)
    # worst case: every tensor its own allocation, so one handle per region
    allocs = Allocations(*[(t.ptr, t.nbytes) for t in tensors.values()])
    body = build_cuda_registration(layout, tensors, allocs.locate, pid=1)
    assert len(body["handles"]) == MAX_REGIONS
    frame = m.encode_request(m.Register(id=1, **body))
    assert len(frame) < MAX_MESSAGE_BYTES // 2
    assert span > 0


@pytest.mark.parametrize("change, match", [
    (dict(contiguous=False), "not contiguous"),
    (dict(itemsize=1), "elements of 1 bytes"),
    (dict(shape=(11, 2, 4, 8)), "does not hold 12 blocks"),
    (dict(shape=(12, 2, 4, 4)), "does not hold 12 blocks"),
    (dict(ptr=0), "null device address"),
])
def test_registration_refuses_a_tensor_that_does_not_match_the_layout(change, match):
    layout = kind_layout("bf16")
    tensors = tensors_for(layout, 0x10_0000)
    t = tensors["v.1"]
    tensors["v.1"] = DeviceTensor(**{**t.__dict__, **change})
    allocs = Allocations((0, 1 << 30))
    with pytest.raises(InvalidLayout, match=match) as err:
        build_cuda_registration(layout, tensors, allocs.locate, pid=1)
    assert err.value.details["region"] == "v.1"


def test_registration_reports_memory_it_cannot_share():
    layout = kind_layout("mla")
    tensors = tensors_for(layout, 0x10_0000)
    allocs = Allocations((0x10_0000, layout.num_blocks * layout.cache_block_bytes))  # holds k.0 only
    with pytest.raises(InvalidLayout, match="cannot be shared") as err:
        build_cuda_registration(layout, tensors, allocs.locate, pid=1)
    assert err.value.details["region"] == "k.1"
    assert err.value.details["cuda_error"] == "CUDA_ERROR_INVALID_VALUE"
    assert allocs.asked == 2


def test_registration_refuses_a_missing_region_and_two_gpus():
    layout = kind_layout("bf16")
    tensors = tensors_for(layout, 0x10_0000)
    del tensors["k.1"]
    with pytest.raises(InvalidLayout, match="no tensor for region k.1"):
        build_cuda_registration(layout, tensors, Allocations((0, 1 << 30)).locate, pid=1)

    def two_gpus(t: DeviceTensor) -> Allocation:
        device = 0 if t.ptr < 0x10_0000 + 1024 else 1
        return Allocation(0x10_0000, 1 << 20, device, UUID, b"\x00" * 64)

    with pytest.raises(InvalidLayout, match="one daemon serves one GPU"):
        build_cuda_registration(layout, tensors_for(layout, 0x10_0000), two_gpus, pid=1)


# -- the driver binding where there is no driver -----------------------------------------------------


def test_ipc_handle_bytes_survive_zero_bytes():
    raw = bytes([0, 7, 0, 0] * 16)
    assert CUipcMemHandle.from_bytes(raw).to_bytes() == raw
    with pytest.raises(ValueError):
        CUipcMemHandle.from_bytes(b"\x00" * 63)


def test_uuid_format():
    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


@no_cuda_here
def test_export_without_a_cuda_driver_is_a_typed_error():
    layout = kind_layout("mla")
    keys = [FakeGpuTensor(0x10_0000 + i * 12 * 512, layout.tensor_shape(), "<u2") for i in range(2)]
    with pytest.raises(CudaError) as err:
        export_cuda_cache(layout, keys)
    assert err.value.cuda_code == NO_DRIVER and err.value.code == "unavailable"
    assert "no CUDA driver" in err.value.message


# -- the daemon's checks ----------------------------------------------------------------------------


def cuda_body(layout_kind: str = "bf16", **handle_changes) -> dict:
    layout = kind_layout(layout_kind)
    tensors = tensors_for(layout, 0x10_0000)
    body = build_cuda_registration(layout, tensors, Allocations((0x10_0000, 1 << 20)).locate, pid=0)
    body["handles"] = [{**body["handles"][0], **handle_changes}]
    return body


def attach(body: dict) -> Registration:
    return Registration.attach(body["layout"], body["handles"], body["regions"], body["pid"])


@pytest.mark.parametrize("changes, field", [
    (dict(ipc_handle=b"short"), "handles[0].ipc_handle"),
    (dict(ipc_handle=None), "handles[0].ipc_handle"),
    (dict(size=-5), "handles[0].size"),
    (dict(device="0"), "handles[0].device"),
    (dict(device_uuid="not-a-gpu"), "handles[0].device_uuid"),
    (dict(kind="nvlink"), "handles[0].kind"),
])
def test_daemon_refuses_malformed_cuda_handles_before_touching_cuda(changes, field):
    with pytest.raises(InvalidLayout) as err:
        attach(cuda_body(**changes))
    assert err.value.details["field"] == field


def test_daemon_refuses_regions_beyond_the_declared_allocation():
    layout = kind_layout("bf16")
    need = layout.num_blocks * layout.record_bytes  # four tensors back to back
    body = cuda_body(size=need - 1)  # the last region's last block is one byte short
    with pytest.raises(InvalidLayout, match="region v.1 needs") as err:
        attach(body)
    assert err.value.details == {"region": "v.1", "need": need, "have": need - 1}


def test_daemon_refuses_mixed_handle_kinds():
    body = cuda_body()
    body["handles"].append({"kind": "shm", "name": "x", "size": 1})
    with pytest.raises(InvalidLayout, match="one kind"):
        attach(body)


@no_cuda_here
def test_daemon_without_cuda_refuses_cuda_ipc_with_a_reason():
    with pytest.raises(InvalidLayout, match="need a CUDA GPU") as err:
        attach(cuda_body())
    assert err.value.details["field"] == "handles[0].kind"
    assert err.value.details["reason"]


@no_cuda_here
def test_live_daemon_answers_cuda_ipc_with_invalid_layout_and_keeps_serving(client: Client, cache: HostKVCache):
    with pytest.raises(InvalidLayout, match="need a CUDA GPU") as err:
        client.register(cuda_body("fp8_scales"))
    assert err.value.details["field"] == "handles[0].kind"
    assert client.stats()["registered"] is False
    # the daemon is up and a CPU engine registers and round-trips as before
    client.register(cache)
    assert client.swap_out([1, 2], ["g1", "g2"]).queued == 2
    before = cache.block_record(1) + cache.block_record(2)
    assert client.swap_in(["g1", "g2"], [20, 21]).loaded == 2
    assert cache.block_record(20) + cache.block_record(21) == before
