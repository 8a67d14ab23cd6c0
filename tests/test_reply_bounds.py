"""What a peer's frame can make the daemon build and send back is bounded: shape limits while
decoding, error replies that repeat at most MAX_ECHO_CHARS of the input, and error details
msgpack cannot carry said as text under the same code. Pure codec tests with byte literals."""

from __future__ import annotations

import msgpack
import pytest

from kvswap.protocol import messages as m
from kvswap.protocol.errors import InvalidLayout, TooLarge
from kvswap.protocol.limits import (
    MAX_ECHO_CHARS,
    MAX_FRAME_ITEMS,
    MAX_MAP_ENTRIES,
    MAX_STRING_BYTES,
)


def rejected(frame: bytes) -> m.DecodeError:
    with pytest.raises(m.DecodeError) as err:
        m.decode_request(frame)
    return err.value


def test_an_error_detail_past_64_bits_is_said_as_text() -> None:
    reply = m.Reply(3, False, error=InvalidLayout("too big", need=2**70, region="k.0"))
    assert m.encode_reply(reply) == (
        b"\x84\xa1v\x01\xa2id\x03\xa2ok\xc2\xa5error\x83\xa4code\xaeinvalid_layout\xa7message\xa7too big"
        b"\xa7details\x82\xa4need\xb61180591620717411303424\xa6region\xa3k.0")
    assert m.decode_reply(m.encode_reply(reply)).error.details == {"need": str(2**70), "region": "k.0"}


def test_a_result_msgpack_cannot_carry_still_raises() -> None:
    with pytest.raises(OverflowError):
        m.encode_reply(m.Reply(3, True, {"n": 2**70}))  # a bug of the daemon's: it answers internal


def test_unknown_field_names_are_echoed_shortened() -> None:
    names = {f"{i:02d}" + "x" * 1000: None for i in range(20)}
    exc = rejected(msgpack.packb({"v": 1, "id": 9, "op": "ping", **names}))
    assert exc.request_id == 9 and exc.error.code == "bad_request"
    assert exc.error.details["fields"] == [f"{i:02d}" + "x" * (MAX_ECHO_CHARS - 2) for i in range(16)]
    assert len(m.encode_reply(m.Reply(9, False, error=exc.error))) < 2200


@pytest.mark.parametrize("name,body,limit", [
    ("a long field name", {"v": 1, "id": 9, "op": "ping", "x" * (MAX_STRING_BYTES + 1): None}, "max_str_len"),
    ("a wide map", {"v": 1, "id": 9, "op": "ping", **{f"f{i}": None for i in range(MAX_MAP_ENTRIES)}},
     "max_map_len"),
    ("nested empty maps", {"v": 1, "id": 9, "op": "lookup", "keys": [[{}] * 8000] * 10}, "items"),
])
def test_a_frame_past_a_shape_limit_is_too_large_with_a_null_id(name: str, body: dict, limit: str) -> None:
    frame = msgpack.packb(body)
    exc = rejected(frame)
    assert isinstance(exc.error, TooLarge) and exc.request_id is None
    assert limit in exc.error.message
    reply = m.encode_reply(m.Reply(None, False, error=exc.error))
    assert len(reply) < 400  # nothing of the frame is repeated


def test_the_item_budget_stops_the_decode_early() -> None:
    calls = 0

    class Counting(m._ItemBudget):
        def __call__(self, container):
            nonlocal calls
            calls += 1
            return super().__call__(container)

    original, m._ItemBudget = m._ItemBudget, Counting
    try:
        rejected(msgpack.packb({"v": 1, "id": 9, "op": "lookup", "keys": [[{}] * 8000] * 500}))
    finally:
        m._ItemBudget = original
    # One call per empty map until the budget is spent, not one per map of the 4 million.
    assert calls <= MAX_FRAME_ITEMS + 2


def test_peek_id_builds_nothing_from_a_nested_frame() -> None:
    frame = msgpack.packb({"v": 1, "id": 9, "op": "lookup", "keys": [[{}] * 8000] * 10})
    assert m.peek_id(frame) == 9
    # A map key that is a container ends the search instead of being built.
    assert m.peek_id(b"\x82\x91\xa1k\x01\xa2id\x09") is None


@pytest.mark.parametrize("field,largest", [("num_blocks", 2**31), ("head_dim", 2**20), ("block_size", 2**20),
                                           ("num_kv_heads", 2**20)])
def test_layout_integers_are_bounded(field: str, largest: int) -> None:
    from kvswap.protocol.layout import CacheLayout

    fields = dict(model_id="m", num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8,
                  has_values=False)
    assert CacheLayout(**{**fields, field: largest}).record_bytes > 0
    with pytest.raises(InvalidLayout) as err:
        CacheLayout(**{**fields, field: largest + 1})
    assert err.value.details == {"field": field}
