"""The packed K/V layout kind (vLLM's CPU cache) in the layout descriptor, and a real
kvswapd moving blocks of a vLLM-shaped cache byte for byte, in both of vLLM's placements."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvswap.common.shm import SharedSegment
from kvswap.protocol import CacheLayout, Client, InvalidLayout


def _packed(**over) -> CacheLayout:
    fields = {"model_id": "m", "num_layers": 3, "num_blocks": 16, "block_size": 32, "num_kv_heads": 2,
              "head_dim": 64, "dtype": "bfloat16", "packed_kv": True}
    fields.update(over)
    return CacheLayout(**fields)


def test_packed_layout_has_one_region_per_layer_holding_k_and_v() -> None:
    layout = _packed()
    assert [r.name for r in layout.regions] == ["kv.0", "kv.1", "kv.2"]
    assert [r.block_bytes for r in layout.regions] == [2 * 2 * 32 * 64 * 2] * 3
    assert [r.record_offset for r in layout.regions] == [0, 16384, 32768]
    unpacked = _packed(packed_kv=False)
    assert layout.record_bytes == unpacked.record_bytes  # same bytes, another arrangement
    assert layout.fingerprint() != unpacked.fingerprint()


def test_packed_flag_travels_only_when_set() -> None:
    assert "packed_kv" not in _packed(packed_kv=False).to_wire()  # older daemons still accept it
    wire = _packed().to_wire()
    assert wire["packed_kv"] is True
    assert CacheLayout.from_wire(wire) == _packed()


@pytest.mark.parametrize("bad", [{"has_values": False}, {"dtype": "uint8"}, {"packed_kv": 1}])
def test_packed_layout_rejects_what_it_cannot_describe(bad) -> None:
    with pytest.raises(InvalidLayout) as err:
        _packed(**bad)
    assert err.value.details.get("field") == "packed_kv"


@pytest.mark.parametrize("placement", ["layer_outermost", "block_outermost"])
def test_daemon_moves_packed_blocks_byte_for_byte(daemon, placement: str) -> None:
    layout = _packed()
    page = layout.regions[0].block_bytes
    layers, blocks = layout.num_layers, layout.num_blocks
    segment = SharedSegment.create(layers * blocks * page)
    try:
        raw = np.frombuffer(segment.buffer, dtype=np.uint8)
        raw[:] = np.random.default_rng(7).integers(0, 256, raw.size, dtype=np.uint8)
        if placement == "layer_outermost":  # vLLM's LBHNC: each layer's blocks together
            offsets, stride = [l * blocks * page for l in range(layers)], page
        else:  # block-outermost: each block of all layers together
            offsets, stride = [l * page for l in range(layers)], layers * page

        def block(l: int, b: int) -> bytes:
            start = offsets[l] + b * stride
            return raw[start:start + page].tobytes()

        registration = {"layout": layout.to_wire(),
                        "handles": [{"kind": "shm", "name": segment.name, "size": segment.size}],
                        "regions": [{"name": r.name, "handle": 0, "offset": o, "stride": stride}
                                    for r, o in zip(layout.regions, offsets)],
                        "pid": os.getpid()}
        with Client(daemon.endpoint, timeout=10) as c:
            assert c.register(registration)["record_bytes"] == layers * page
            before = {(l, b): block(l, b) for l in range(layers) for b in (1, 2, 9, 10, 11)}
            assert c.swap_out([1, 2], ["a", "b"], wait="persisted").stored == 2
            assert c.swap_in(["a", "b"], [9, 10]).loaded == 2
            for l in range(layers):
                assert block(l, 9) == before[(l, 1)] and block(l, 10) == before[(l, 2)]
                assert block(l, 11) == before[(l, 11)]  # nothing beyond the targets moved
            c.unregister()
    finally:
        segment.close()
        segment.unlink()
