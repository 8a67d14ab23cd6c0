"""A CPU engine's KV cache in POSIX shared memory (kvswap.protocol.host_cache and .shm).

These create real segments under /dev/shm; every test closes (and so unlinks) what it made.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvswap.common.shm import SharedSegment, check_name
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.host_cache import HostKVCache
from kvswap.protocol.layout import CacheLayout
from kvswap.protocol.messages import Register, decode_request, encode_request

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")

BASE: dict[str, Any] = dict(model_id="m", num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
LAYOUTS = {
    "bf16": {},
    "fp8": {"dtype": "uint8"},
    "mla": {"num_kv_heads": 1, "head_dim": 64, "has_values": False},
    "mla-fp8": {"num_kv_heads": 1, "head_dim": 64, "has_values": False, "dtype": "uint8"},
    "extra-fp16": {"dtype": "float16", "num_extra_layers": 1},
}


def seg_path(cache: HostKVCache) -> Path:
    return SHM / cache.segment.name


@pytest.fixture(params=sorted(LAYOUTS))
def cache(request: pytest.FixtureRequest) -> Iterator[HostKVCache]:
    c = HostKVCache.create(CacheLayout(**{**BASE, **LAYOUTS[request.param]}))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def bf16() -> Iterator[HostKVCache]:
    c = HostKVCache.create(CacheLayout(**BASE))
    try:
        yield c
    finally:
        c.close()


# -- the segment --------------------------------------------------------------------------


def test_segment_is_mode_0600_and_ours(cache: HostKVCache) -> None:
    st = os.stat(seg_path(cache))
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    assert st.st_size == cache.segment.size == HostKVCache.segment_bytes(cache.layout)


def test_segment_is_0600_even_with_an_open_umask() -> None:
    old = os.umask(0)
    try:
        c = HostKVCache.create(CacheLayout(**BASE))
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(seg_path(c)).st_mode) == 0o600
    finally:
        c.close()


def test_segment_bytes_page_aligns_each_tensor() -> None:
    layout = CacheLayout(**BASE)
    # 4 tensors of 6 blocks * 128 bytes = 768 bytes, each rounded up to a 4096-byte page
    assert HostKVCache.segment_bytes(layout) == 4 * 4096
    big = CacheLayout(**{**BASE, "num_blocks": 64})  # 64 * 128 = 8192 bytes: exactly two pages
    assert HostKVCache.segment_bytes(big) == 4 * 8192


def test_segment_names_are_unique() -> None:
    a, b = SharedSegment.create(4096), SharedSegment.create(4096)
    try:
        assert a.name != b.name
        assert a.name.startswith(f"kvswap-{os.getpid()}-")
        assert check_name(a.name) == a.name
    finally:
        for s in (a, b):
            s.close()
            s.unlink()


def test_zero_size_segment_is_refused() -> None:
    with pytest.raises(ValueError):
        SharedSegment.create(0)


# -- arrays -------------------------------------------------------------------------------


def test_arrays_are_shaped_like_the_engine_cache(cache: HostKVCache) -> None:
    layout = cache.layout
    shape = (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim)
    n = layout.total_layers
    assert len(cache.keys) == n
    assert len(cache.values) == (n if layout.has_values else 0)
    assert len(cache.key_scales) == (n if layout.has_scales else 0)
    assert len(cache.value_scales) == (n if layout.has_scales and layout.has_values else 0)
    for arr in cache.keys + cache.values:
        assert arr.shape == shape
        assert arr.dtype.itemsize == layout.itemsize
        assert arr.flags.c_contiguous and arr.flags.writeable
    for arr in cache.key_scales + cache.value_scales:
        assert arr.shape == shape[:3]
        assert arr.dtype == np.float32
    assert sorted(cache.arrays) == sorted(r.name for r in layout.regions)


def test_array_dtypes() -> None:
    layout = CacheLayout(**BASE)
    for dtype, expected in (("bfloat16", np.uint16), ("float16", np.float16), ("uint8", np.uint8)):
        with HostKVCache.create(CacheLayout(**{**BASE, "dtype": dtype})) as c:
            assert c.keys[0].dtype == expected
    assert layout.dtype == "bfloat16"


def test_fresh_cache_is_zero(bf16: HostKVCache) -> None:
    assert bf16.block_record(0) == bytes(bf16.layout.record_bytes)


# -- records ------------------------------------------------------------------------------


def test_block_record_is_each_regions_block_bytes_in_order(cache: HostKVCache) -> None:
    cache.fill_random(seed=3)
    raw = bytes(cache.segment.buffer)
    regions = {r["name"]: r for r in cache.registration()["regions"]}
    for b in range(cache.layout.num_blocks):
        # Read each chunk straight out of the segment, the way the daemon does.
        expected = b""
        for region in cache.layout.regions:
            start = regions[region.name]["offset"] + b * regions[region.name]["stride"]
            expected += raw[start:start + region.block_bytes]
        record = cache.block_record(b)
        assert len(record) == cache.layout.record_bytes
        assert record == expected
        assert record == b"".join(cache.arrays[r.name][b].tobytes() for r in cache.layout.regions)


def test_block_record_layer_major_order(bf16: HostKVCache) -> None:
    bf16.fill_random(seed=1)
    chunk = bf16.layout.cache_block_bytes
    record = bf16.block_record(4)
    assert record[0 * chunk:1 * chunk] == bf16.keys[0][4].tobytes()
    assert record[1 * chunk:2 * chunk] == bf16.values[0][4].tobytes()
    assert record[2 * chunk:3 * chunk] == bf16.keys[1][4].tobytes()
    assert record[3 * chunk:4 * chunk] == bf16.values[1][4].tobytes()


def test_fill_random_is_seeded(bf16: HostKVCache) -> None:
    bf16.fill_random(seed=7)
    first = [bf16.block_record(b) for b in range(bf16.layout.num_blocks)]
    assert len(set(first)) == bf16.layout.num_blocks  # blocks differ
    assert all(any(r) for r in first)  # and are not zero
    bf16.fill_random(seed=8)
    assert bf16.block_record(0) != first[0]
    bf16.fill_random(seed=7)
    assert [bf16.block_record(b) for b in range(bf16.layout.num_blocks)] == first


def test_zero_blocks_clears_only_those_blocks(bf16: HostKVCache) -> None:
    bf16.fill_random(seed=2)
    before = [bf16.block_record(b) for b in range(6)]
    bf16.zero_blocks([1, 4])
    zero = bytes(bf16.layout.record_bytes)
    assert [bf16.block_record(b) for b in range(6)] == [before[0], zero, before[2], before[3], zero, before[5]]


def test_writes_are_visible_through_another_mapping(bf16: HostKVCache) -> None:
    bf16.fill_random(seed=5)
    other = SharedSegment.attach(bf16.segment.name)
    try:
        assert other.owner is False
        assert other.size == bf16.segment.size
        region = bf16.registration()["regions"][2]  # k.1
        start = region["offset"] + 3 * region["stride"]
        assert bytes(other.buffer[start:start + region["stride"]]) == bf16.keys[1][3].tobytes()
        bf16.keys[1][3] = 0x1234
        assert bytes(other.buffer[start:start + 2]) == b"\x34\x12"
    finally:
        other.close()
    assert seg_path(bf16).exists()  # closing an attached segment never unlinks it


# -- registration -------------------------------------------------------------------------


def test_registration_describes_the_segment(cache: HostKVCache) -> None:
    reg = cache.registration()
    size = cache.segment.size
    assert reg["handles"] == [{"kind": "shm", "name": cache.segment.name, "size": size}]
    assert reg["layout"] == cache.layout.to_wire()
    assert reg["pid"] == os.getpid()
    assert [r["name"] for r in reg["regions"]] == [r.name for r in cache.layout.regions]
    spans = []
    for entry, region in zip(reg["regions"], cache.layout.regions):
        assert entry["handle"] == 0
        assert entry["stride"] == region.block_bytes
        assert entry["offset"] % 4096 == 0
        end = entry["offset"] + cache.layout.num_blocks * entry["stride"]
        assert end <= size
        spans.append((entry["offset"], end))
    # Tensors do not overlap.
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_registration_offsets_for_bf16(bf16: HostKVCache) -> None:
    assert [(r["name"], r["offset"], r["stride"]) for r in bf16.registration()["regions"]] == [
        ("k.0", 0, 128), ("v.0", 4096, 128), ("k.1", 8192, 128), ("v.1", 12288, 128)]


def test_registration_is_a_valid_register_request(cache: HostKVCache) -> None:
    reg = cache.registration()
    request = Register(id=1, layout=reg["layout"], handles=tuple(reg["handles"]), regions=tuple(reg["regions"]),
                       pid=reg["pid"])
    assert decode_request(encode_request(request)) == request
    assert CacheLayout.from_wire(decode_request(encode_request(request)).layout) == cache.layout


# -- lifetime -----------------------------------------------------------------------------


def test_close_unlinks_the_segment() -> None:
    c = HostKVCache.create(CacheLayout(**BASE))
    path = seg_path(c)
    assert path.exists()
    c.close()
    assert not path.exists()
    assert c.segment.closed
    assert c.arrays == {} and c.keys == [] and c.values == []
    with pytest.raises(InvalidLayout):
        SharedSegment.attach(c.segment.name)


def test_context_manager_unlinks() -> None:
    with HostKVCache.create(CacheLayout(**BASE)) as c:
        path = seg_path(c)
        assert path.exists()
    assert not path.exists()


def test_close_without_unlink_keeps_the_segment() -> None:
    c = HostKVCache.create(CacheLayout(**BASE))
    path = seg_path(c)
    try:
        c.close(unlink=False)
        assert path.exists()
    finally:
        c.segment.unlink()
    assert not path.exists()


def test_unlink_twice_is_harmless() -> None:
    s = SharedSegment.create(4096)
    s.close()
    s.unlink()
    s.unlink()
    assert not (SHM / s.name).exists()


def test_closed_segment_has_no_buffer() -> None:
    s = SharedSegment.create(4096)
    s.close()
    s.unlink()
    with pytest.raises(ValueError):
        s.buffer


# -- attaching ----------------------------------------------------------------------------


def test_attach_missing_segment_is_invalid_layout() -> None:
    with pytest.raises(InvalidLayout) as info:
        SharedSegment.attach("kvswap-no-such-segment-0")
    assert info.value.details == {"name": "kvswap-no-such-segment-0"}


@pytest.mark.parametrize("name", ["", ".hidden", "../etc/passwd", "a/b", "a b", "x" * 201, 7, None])
def test_attach_refuses_bad_names(name: object) -> None:
    with pytest.raises(InvalidLayout):
        SharedSegment.attach(name)  # type: ignore[arg-type]
