"""The layout descriptor (kvswap.protocol.layout): regions, record offsets, the namespace
fingerprint and the wire form. Pure units."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import msgpack
import pytest

from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import RECORD_FORMAT, CacheLayout, Region

BASE: dict[str, Any] = dict(model_id="Qwen/Qwen2-7B", num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2,
                            head_dim=8)


def make(**overrides: Any) -> CacheLayout:
    return CacheLayout(**{**BASE, **overrides})


def table(layout: CacheLayout) -> list[tuple[str, int, int]]:
    return [(r.name, r.block_bytes, r.record_offset) for r in layout.regions]


# -- regions and record offsets -----------------------------------------------------------


def test_bf16_regions_are_layer_major_k_then_v() -> None:
    layout = make()
    # one block of one tensor: 2 heads * 4 tokens * 8 dims * 2 bytes = 128
    assert layout.cache_block_bytes == 128
    assert table(layout) == [("k.0", 128, 0), ("v.0", 128, 128), ("k.1", 128, 256), ("v.1", 128, 384)]
    assert layout.record_bytes == 512
    assert layout.has_scales is False


def test_float16_has_the_same_regions_as_bf16() -> None:
    assert table(make(dtype="float16")) == table(make())


def test_fp8_regions_carry_key_and_value_scales_per_layer() -> None:
    layout = make(dtype="uint8")
    # cache: 2*4*8*1 = 64 bytes; scales [heads, block_size] float32: 2*4*4 = 32 bytes
    assert (layout.cache_block_bytes, layout.scale_block_bytes) == (64, 32)
    assert table(layout) == [
        ("k.0", 64, 0), ("v.0", 64, 64), ("ks.0", 32, 128), ("vs.0", 32, 160),
        ("k.1", 64, 192), ("v.1", 64, 256), ("ks.1", 32, 320), ("vs.1", 32, 352),
    ]
    assert layout.record_bytes == 384
    assert layout.has_scales is True


def test_fp8_scale_dtype_sets_scale_bytes() -> None:
    layout = make(dtype="uint8", scale_dtype="bfloat16")
    assert layout.scale_block_bytes == 16
    assert [r.block_bytes for r in layout.regions[:4]] == [64, 64, 16, 16]
    assert layout.record_bytes == 2 * (64 + 64 + 16 + 16)


def test_mla_has_keys_only() -> None:
    layout = make(num_kv_heads=1, head_dim=576, has_values=False)
    # 1 head * 4 tokens * 576 dims * 2 bytes = 4608
    assert table(layout) == [("k.0", 4608, 0), ("k.1", 4608, 4608)]
    assert layout.record_bytes == 9216


def test_mla_fp8_has_key_scales_only() -> None:
    layout = make(num_kv_heads=1, head_dim=576, has_values=False, dtype="uint8")
    # cache 1*4*576*1 = 2304; key scale 1*4*4 = 16
    assert table(layout) == [("k.0", 2304, 0), ("ks.0", 16, 2304), ("k.1", 2304, 2320), ("ks.1", 16, 4624)]
    assert layout.record_bytes == 4640


def test_extra_layers_follow_the_model_layers() -> None:
    layout = make(num_extra_layers=1)
    assert layout.total_layers == 3
    assert [r.name for r in layout.regions] == ["k.0", "v.0", "k.1", "v.1", "k.2", "v.2"]
    assert [r.record_offset for r in layout.regions] == [0, 128, 256, 384, 512, 640]
    assert layout.record_bytes == 768


@pytest.mark.parametrize("overrides", [{}, {"dtype": "uint8"}, {"has_values": False}, {"has_values": False, "dtype": "uint8"},
                                       {"num_extra_layers": 2, "dtype": "uint8", "scale_dtype": "float16"}])
def test_record_offsets_are_contiguous_and_sum_to_record_bytes(overrides: dict[str, Any]) -> None:
    layout = make(**overrides)
    offset = 0
    for region in layout.regions:
        assert region.record_offset == offset
        offset += region.block_bytes
    assert layout.record_bytes == offset == sum(r.block_bytes for r in layout.regions)
    assert len({r.name for r in layout.regions}) == len(layout.regions)


def test_region_counts() -> None:
    assert len(make(num_layers=5).regions) == 10
    assert len(make(num_layers=5, dtype="uint8").regions) == 20
    assert len(make(num_layers=5, has_values=False).regions) == 5
    assert len(make(num_layers=5, has_values=False, dtype="uint8").regions) == 10
    assert len(make(num_layers=5, num_extra_layers=1).regions) == 12


def test_shapes() -> None:
    layout = make()
    assert layout.tensor_shape() == (8, 2, 4, 8)
    assert layout.scale_shape() == (8, 2, 4)
    assert layout.itemsize == 2
    assert make(dtype="uint8").itemsize == 1


def test_regions_are_derived_not_compared() -> None:
    assert make() == make()
    assert make().regions == make().regions
    assert make().regions[0] == Region("k.0", 128, 0)
    assert "regions" not in repr(make())


# -- fingerprint --------------------------------------------------------------------------

#: Records on disk are filed under this value. A change here orphans every stored block, so
#: it must only ever change on purpose (and then RECORD_FORMAT goes up with it).
PINNED_FINGERPRINT = "e782e5ec64f406b250cb5bc2a2d8a28e"


def test_fingerprint_is_32_hex_digits_and_pinned() -> None:
    fp = make().fingerprint()
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    assert fp == PINNED_FINGERPRINT
    assert RECORD_FORMAT == 1


def test_fingerprint_is_stable() -> None:
    a, b = make(), CacheLayout(**dict(BASE))
    assert a is not b
    assert a.fingerprint() == b.fingerprint() == a.fingerprint()
    assert CacheLayout.from_wire(a.to_wire()).fingerprint() == a.fingerprint()


def test_fingerprint_ignores_num_blocks() -> None:
    assert make(num_blocks=1).fingerprint() == make(num_blocks=100_000).fingerprint() == make().fingerprint()


def test_fingerprint_ignores_scale_dtype_without_scales() -> None:
    assert make(scale_dtype="float16").fingerprint() == make().fingerprint()
    assert make(dtype="uint8", scale_dtype="float16").fingerprint() != make(dtype="uint8").fingerprint()


FINGERPRINT_BASE: dict[str, Any] = dict(BASE, tp_size=4, tp_rank=1)
FINGERPRINT_CHANGES: list[tuple[str, Any]] = [
    ("model_id", "Qwen/Qwen2-7B-Instruct"),
    ("dtype", "float16"),
    ("dtype", "uint8"),
    ("block_size", 8),
    ("num_kv_heads", 4),
    ("head_dim", 16),
    ("num_layers", 3),
    ("tp_rank", 0),
    ("tp_rank", 3),
    ("tp_size", 8),
    ("has_values", False),
    ("num_extra_layers", 1),
]


@pytest.mark.parametrize("name,value", FINGERPRINT_CHANGES, ids=[f"{n}={v}" for n, v in FINGERPRINT_CHANGES])
def test_fingerprint_changes_with(name: str, value: Any) -> None:
    base = CacheLayout(**FINGERPRINT_BASE)
    assert getattr(base, name) != value
    assert CacheLayout(**{**FINGERPRINT_BASE, name: value}).fingerprint() != base.fingerprint()


def test_all_fingerprint_variants_are_distinct() -> None:
    variants = [CacheLayout(**FINGERPRINT_BASE)] + [CacheLayout(**{**FINGERPRINT_BASE, n: v}) for n, v in FINGERPRINT_CHANGES]
    assert len({v.fingerprint() for v in variants}) == len(FINGERPRINT_CHANGES) + 1


def test_extra_layers_are_counted_apart_from_model_layers() -> None:
    # Same regions, different meaning: a draft layer is not a model layer.
    a, b = make(num_layers=3), make(num_layers=2, num_extra_layers=1)
    assert table(a) == table(b)
    assert a.fingerprint() != b.fingerprint()


# -- wire form ----------------------------------------------------------------------------


def test_to_wire_lists_every_field_but_regions() -> None:
    assert make(dtype="uint8", tp_rank=1, tp_size=2).to_wire() == {
        "model_id": "Qwen/Qwen2-7B", "num_layers": 2, "num_blocks": 8, "block_size": 4, "num_kv_heads": 2,
        "head_dim": 8, "dtype": "uint8", "tp_rank": 1, "tp_size": 2, "has_values": True,
        "scale_dtype": "float32", "num_extra_layers": 0,
    }


@pytest.mark.parametrize("overrides", [{}, {"dtype": "uint8", "scale_dtype": "float16"},
                                       {"has_values": False, "num_extra_layers": 1, "tp_rank": 3, "tp_size": 4}])
def test_wire_round_trip_through_msgpack(overrides: dict[str, Any]) -> None:
    layout = make(**overrides)
    data = msgpack.packb(layout.to_wire(), use_bin_type=True)
    back = CacheLayout.from_wire(msgpack.unpackb(data, raw=False))
    assert back == layout
    assert back.regions == layout.regions
    assert back.fingerprint() == layout.fingerprint()


def test_from_wire_defaults_optional_fields() -> None:
    assert CacheLayout.from_wire(dict(BASE)) == make()


# -- invalid layouts ----------------------------------------------------------------------

INVALID: list[tuple[str, dict[str, Any]]] = [
    ("tp_rank equals tp_size", {"tp_rank": 1, "tp_size": 1}),
    ("tp_rank above tp_size", {"tp_rank": 5, "tp_size": 4}),
    ("negative tp_rank", {"tp_rank": -1}),
    ("zero tp_size", {"tp_size": 0}),
    ("zero layers", {"num_layers": 0}),
    ("zero blocks", {"num_blocks": 0}),
    ("zero block size", {"block_size": 0}),
    ("zero heads", {"num_kv_heads": 0}),
    ("negative head dim", {"head_dim": -8}),
    ("negative extra layers", {"num_extra_layers": -1}),
    ("bool layers", {"num_layers": True}),
    ("string block size", {"block_size": "4"}),
    ("float head dim", {"head_dim": 8.0}),
    ("unknown dtype", {"dtype": "int4"}),
    ("float64 is not a cache dtype", {"dtype": "float64"}),
    ("dtype case", {"dtype": "BF16"}),
    ("unknown scale dtype", {"scale_dtype": "fp4"}),
    ("empty model id", {"model_id": ""}),
    ("long model id", {"model_id": "m" * 257}),
    ("integer model id", {"model_id": 7}),
    ("integer has_values", {"has_values": 1}),
]


@pytest.mark.parametrize("name,overrides", INVALID, ids=[n for n, _ in INVALID])
def test_invalid_layout_is_refused(name: str, overrides: dict[str, Any]) -> None:
    with pytest.raises(InvalidLayout):
        make(**overrides)
    with pytest.raises(InvalidLayout):
        CacheLayout.from_wire({**BASE, **overrides})


def test_invalid_field_is_named() -> None:
    with pytest.raises(InvalidLayout) as info:
        make(tp_rank=2, tp_size=2)
    assert info.value.details == {"field": "tp_rank"}
    with pytest.raises(InvalidLayout) as info:
        make(num_layers=0)
    assert info.value.details == {"field": "num_layers"}
    with pytest.raises(InvalidLayout) as info:
        make(dtype="int4")
    assert info.value.details == {"field": "dtype"}


def test_from_wire_refuses_unknown_fields() -> None:
    with pytest.raises(InvalidLayout) as info:
        CacheLayout.from_wire({**BASE, "num_layer": 2, "regions": []})
    assert info.value.details == {"fields": ["num_layer", "regions"]}


def test_from_wire_refuses_binary_field_names() -> None:
    with pytest.raises(InvalidLayout):
        CacheLayout.from_wire({**BASE, b"dtype": "uint8"})


@pytest.mark.parametrize("missing", ["model_id", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"])
def test_from_wire_refuses_incomplete_layouts(missing: str) -> None:
    payload = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(InvalidLayout):
        CacheLayout.from_wire(payload)


@pytest.mark.parametrize("payload", [None, [], "layout", 3])
def test_from_wire_refuses_non_maps(payload: object) -> None:
    with pytest.raises(InvalidLayout):
        CacheLayout.from_wire(payload)


def test_from_wire_refuses_unhashable_dtype() -> None:
    with pytest.raises(InvalidLayout):
        CacheLayout.from_wire({**BASE, "dtype": ["uint8"]})


def test_layout_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().num_blocks = 9  # type: ignore[misc]


def test_block_order_separates_namespaces_only_when_set() -> None:
    base = make()
    assert make(block_order="").fingerprint() == base.fingerprint()  # layouts from before keep theirs
    assert "block_order" not in base.to_wire()
    nhc, hnc = make(block_order="NHC"), make(block_order="HNC")
    assert len({base.fingerprint(), nhc.fingerprint(), hnc.fingerprint()}) == 3
    assert CacheLayout.from_wire(nhc.to_wire()) == nhc
    for bad in ("N-H", "x" * 17, 3, "NHÇ"):
        with pytest.raises(InvalidLayout):
            make(block_order=bad)
