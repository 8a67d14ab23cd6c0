"""Wire messages and limits (kvswap.protocol.messages, kvswap.protocol.limits): pure functions
over bytes, tested with byte literals, a table of malformed frames and property tests."""

from __future__ import annotations

import re
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvswap.protocol.errors import (
    ERRORS_BY_CODE,
    BadRequest,
    Busy,
    Internal,
    InvalidKey,
    KvswapError,
    TooLarge,
    UnknownOp,
    UnsupportedVersion,
)
from kvswap.protocol.limits import (
    MAX_BLOCK_ID,
    MAX_KEY_LENGTH,
    MAX_KEYS_PER_REQUEST,
    MAX_MESSAGE_BYTES,
    MAX_TIMEOUT_MS,
    check_count,
    check_key,
    check_keys,
)
from kvswap.protocol.messages import (
    MAX_REQUEST_ID,
    REQUEST_TYPES,
    WAIT_MODES,
    Clear,
    DecodeError,
    Delete,
    Flush,
    Hello,
    Lookup,
    PeerExport,
    PeerRelease,
    Ping,
    Register,
    Reply,
    Request,
    Stats,
    SwapIn,
    SwapOut,
    Unregister,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    peek_id,
)

#: Property tests stay fast and leave no example database in the repository.
FAST = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def frame(**fields: Any) -> bytes:
    """A request frame with a valid envelope; ``None`` removes an envelope field."""
    msg: dict[str, Any] = {"v": 1, "id": 5, "op": "ping"}
    msg.update(fields)
    return pack({k: v for k, v in msg.items() if v is not None})


def rejected(data: bytes) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode_request(data)
    return info.value


# -- byte literals ------------------------------------------------------------------------

PING_7 = b"\x83\xa1v\x01\xa2id\x07\xa2op\xa4ping"
SWAP_OUT_42 = (
    b"\x87"
    b"\xa1v\x01"
    b"\xa2id\x2a"
    b"\xa2op\xa8swap_out"
    b"\xaatimeout_ms\xcd\x03\xe8"
    b"\xa9block_ids\x92\x03\x04"
    b"\xa4keys\x92\xa2a1\xa2b2"
    b"\xa4wait\xa9persisted"
)


def test_encode_ping_literal() -> None:
    assert encode_request(Ping(id=7)) == PING_7


def test_decode_ping_literal() -> None:
    assert decode_request(PING_7) == Ping(id=7)


def test_hand_written_swap_out_frame_decodes_to_the_dataclass() -> None:
    got = decode_request(SWAP_OUT_42)
    assert type(got) is SwapOut
    assert got == SwapOut(id=42, timeout_ms=1000, block_ids=(3, 4), keys=("a1", "b2"), wait="persisted")
    assert got.block_ids == (3, 4) and got.keys == ("a1", "b2")


def test_encode_swap_out_literal() -> None:
    request = SwapOut(id=42, timeout_ms=1000, block_ids=(3, 4), keys=("a1", "b2"), wait="persisted")
    assert encode_request(request) == SWAP_OUT_42


def test_field_order_in_the_frame_does_not_matter() -> None:
    reordered = (
        b"\x86"
        b"\xa4keys\x92\xa2a1\xa2b2"
        b"\xa2op\xa7swap_in"
        b"\xa9block_ids\x92\x03\x04"
        b"\xa2id\x09"
        b"\xa1v\x01"
        b"\xaatimeout_ms\x05"
    )
    assert decode_request(reordered) == SwapIn(id=9, timeout_ms=5, keys=("a1", "b2"), block_ids=(3, 4))


def test_swap_out_wait_defaults_to_copied() -> None:
    data = b"\x85\xa1v\x01\xa2id\x01\xa2op\xa8swap_out\xa9block_ids\x91\x00\xa4keys\x91\xa1k"
    got = decode_request(data)
    assert got == SwapOut(id=1, block_ids=(0,), keys=("k",))
    assert got.wait == "copied"
    assert got.timeout_ms is None


def test_encode_lookup_literal() -> None:
    assert encode_request(Lookup(id=1, keys=("h:00ff",))) == (
        b"\x84\xa1v\x01\xa2id\x01\xa2op\xa6lookup\xa4keys\x91\xa6h:00ff"
    )


def test_largest_request_id_round_trips() -> None:
    data = encode_request(Ping(id=MAX_REQUEST_ID))
    assert data == b"\x83\xa1v\x01\xa2id\xcf" + b"\xff" * 8 + b"\xa2op\xa4ping"
    assert decode_request(data).id == 2**64 - 1


def test_every_op_round_trips() -> None:
    requests = [
        Hello(id=1, client="fastdeploy/2.1"),
        Ping(id=2),
        Register(id=3, layout={"model_id": "m"}, handles=({"kind": "shm", "name": "s", "size": 4096},),
                 regions=({"name": "k.0", "handle": 0, "offset": 0, "stride": 64},), pid=1234),
        Unregister(id=4),
        SwapOut(id=5, block_ids=(1,), keys=("a",)),
        SwapIn(id=6, keys=("a",), block_ids=(1,)),
        Lookup(id=7, keys=("a", "b")),
        Delete(id=8, keys=("a",), timeout_ms=MAX_TIMEOUT_MS),
        Clear(id=9),
        Flush(id=10, timeout_ms=0),
        Stats(id=11),
        Lookup(id=12, keys=("a",), peer="tcp://10.0.0.5:55500", wait_ms=250),
        PeerExport(id=13, keys=("a",), namespace="0" * 32, wait_ms=5, transport="mooncake"),
        PeerRelease(id=14, lease="l" * 32),
    ]
    assert sorted({type(r).op for r in requests}) == sorted(REQUEST_TYPES)
    for request in requests:
        data = encode_request(request)
        assert decode_request(data) == request
        assert msgpack.unpackb(data)["op"] == type(request).op


# -- replies ------------------------------------------------------------------------------


def test_encode_ok_reply_literal() -> None:
    data = encode_reply(Reply(7, True, {"n": 2}))
    assert data == b"\x84\xa1v\x01\xa2id\x07\xa2ok\xc3\xa6result\x81\xa1n\x02"
    assert decode_reply(data) == Reply(7, True, {"n": 2})


def test_encode_error_reply_literal() -> None:
    data = encode_reply(Reply(None, False, error=Busy("full", queued=3)))
    assert data == (
        b"\x84\xa1v\x01\xa2id\xc0\xa2ok\xc2"
        b"\xa5error\x83\xa4code\xa4busy\xa7message\xa4full\xa7details\x81\xa6queued\x03"
    )
    got = decode_reply(data)
    assert got.id is None and got.ok is False
    assert type(got.error) is Busy
    assert (got.error.message, got.error.details) == ("full", {"queued": 3})


def test_ok_reply_round_trip() -> None:
    result = {"stored": 3, "status": ["hit", "miss"], "bytes": b"\x00\x01", "nested": {"a": None}}
    got = decode_reply(encode_reply(Reply(123, True, result)))
    assert got == Reply(123, True, result)
    assert got.error is None


@pytest.mark.parametrize("code", sorted(ERRORS_BY_CODE))
def test_error_reply_round_trip_for_each_code(code: str) -> None:
    cls = ERRORS_BY_CODE[code]
    data = encode_reply(Reply(99, False, error=cls(f"{code}!", field="keys", limit=8192, index=[1, 2])))
    got = decode_reply(data)
    assert got.id == 99 and got.ok is False and got.result == {}
    assert type(got.error) is cls
    assert got.error.code == code
    assert got.error.message == f"{code}!"
    assert got.error.details == {"field": "keys", "limit": 8192, "index": [1, 2]}


def test_error_reply_with_unknown_code_keeps_its_code() -> None:
    data = pack({"v": 1, "id": 4, "ok": False,
                 "error": {"code": "rate_limited", "message": "slow down", "details": {"after_ms": 50}}})
    got = decode_reply(data)
    assert type(got.error) is KvswapError
    assert got.error.code == "rate_limited"
    assert (got.error.message, got.error.details) == ("slow down", {"after_ms": 50})


def test_error_reply_without_error_map_is_internal() -> None:
    got = decode_reply(pack({"v": 1, "id": 4, "ok": False}))
    assert got.ok is False
    assert type(got.error) is Internal


def test_ok_reply_with_non_map_result_is_wrapped() -> None:
    assert decode_reply(pack({"v": 1, "id": 4, "ok": True, "result": 3})).result == {"value": 3}
    assert decode_reply(pack({"v": 1, "id": 4, "ok": True})).result == {}


@pytest.mark.parametrize("data", [pack([1, 2]), pack({"v": 1, "id": 4}), pack("ok"), b"\xc1", b"\x84\xa1v"])
def test_decode_reply_rejects_non_replies(data: bytes) -> None:
    with pytest.raises(BadRequest):
        decode_reply(data)


def test_decode_reply_rejects_oversized_frame() -> None:
    with pytest.raises(TooLarge):
        decode_reply(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_decode_reply_never_raises_type_error_on_odd_details() -> None:
    data = pack({"v": 1, "id": 4, "ok": False, "error": {"code": "busy", "message": "m", "details": {b"k": 1}}})
    assert type(decode_reply(data).error) is Busy


# -- malformed requests -------------------------------------------------------------------

SWAP_OUT_OK = {"op": "swap_out", "block_ids": [1, 2], "keys": ["a", "b"]}
SWAP_IN_OK = {"op": "swap_in", "keys": ["a", "b"], "block_ids": [1, 2]}
REGISTER_OK = {"op": "register", "layout": {}, "handles": [], "regions": []}

# (case name, frame, error class, request_id the answer must carry)
REJECTIONS: list[tuple[str, bytes, type[KvswapError], int | None]] = [
    # not msgpack at all
    ("empty frame", b"", BadRequest, None),
    ("reserved byte", b"\xc1", BadRequest, None),
    ("random bytes", b"\xde\xad\xbe\xef\x00garbage", BadRequest, None),
    ("trailing bytes", PING_7 + b"\x00", BadRequest, None),
    ("truncated", SWAP_OUT_42[:-4], BadRequest, None),
    ("truncated header", SWAP_OUT_42[:1], BadRequest, None),
    ("invalid utf-8 string", b"\x81\xa1v\xa2\xff\xfe", BadRequest, None),
    ("integer map key", b"\x81\x01\x01", BadRequest, None),
    # not a map
    ("array", pack([1, 5, "ping"]), BadRequest, None),
    ("string", pack("ping"), BadRequest, None),
    ("integer", pack(5), BadRequest, None),
    ("nil", pack(None), BadRequest, None),
    # the id
    ("missing id", frame(id=None), BadRequest, None),
    ("nil id", pack({"v": 1, "id": None, "op": "ping"}), BadRequest, None),
    ("bool id", frame(id=True), BadRequest, None),
    ("negative id", frame(id=-1), BadRequest, None),
    ("float id", frame(id=5.0), BadRequest, None),
    ("string id", frame(id="5"), BadRequest, None),
    ("bad id and bad version", frame(id=-1, v=2), BadRequest, None),
    # the version
    ("version 2", frame(v=2), UnsupportedVersion, 5),
    ("version 0", frame(v=0), UnsupportedVersion, 5),
    ("missing version", frame(v=None), UnsupportedVersion, 5),
    ("string version", frame(v="1"), UnsupportedVersion, 5),
    # the op
    ("unknown op", frame(op="swap_all"), UnknownOp, 5),
    ("missing op", frame(op=None), UnknownOp, 5),
    ("integer op", frame(op=1), UnknownOp, 5),
    ("binary op", frame(op=b"ping"), UnknownOp, 5),
    ("op case", frame(op="PING"), UnknownOp, 5),
    # fields
    ("unknown field on ping", frame(keys=["a"]), BadRequest, 5),
    ("unknown field on swap_out", frame(**SWAP_OUT_OK, extra=1), BadRequest, 5),
    ("binary field name", pack({"v": 1, "id": 5, "op": "ping", b"keys": []}), BadRequest, 5),
    ("swap_out without keys", frame(op="swap_out", block_ids=[1]), BadRequest, 5),
    ("swap_out without block_ids", frame(op="swap_out", keys=["a"]), BadRequest, 5),
    ("swap_in without block_ids", frame(op="swap_in", keys=["a"]), BadRequest, 5),
    ("lookup without keys", frame(op="lookup"), BadRequest, 5),
    ("delete without keys", frame(op="delete"), BadRequest, 5),
    ("register without handles", frame(op="register", layout={}, regions=[]), BadRequest, 5),
    ("keys is a string", frame(op="lookup", keys="abc"), BadRequest, 5),
    ("keys is a map", frame(op="lookup", keys={"a": 1}), BadRequest, 5),
    ("keys is nil", pack({"v": 1, "id": 5, "op": "lookup", "keys": None}), BadRequest, 5),
    ("block_ids is an integer", frame(**{**SWAP_IN_OK, "block_ids": 1}), BadRequest, 5),
    ("string block id", frame(**{**SWAP_IN_OK, "block_ids": [1, "2"]}), BadRequest, 5),
    ("bool block id", frame(**{**SWAP_IN_OK, "block_ids": [1, True]}), BadRequest, 5),
    ("float block id", frame(**{**SWAP_IN_OK, "block_ids": [1, 2.0]}), BadRequest, 5),
    ("negative block id", frame(**{**SWAP_IN_OK, "block_ids": [1, -1]}), BadRequest, 5),
    ("block id above limit", frame(**{**SWAP_OUT_OK, "block_ids": [1, MAX_BLOCK_ID + 1]}), BadRequest, 5),
    ("unknown wait mode", frame(**SWAP_OUT_OK, wait="now"), BadRequest, 5),
    ("integer wait mode", frame(**SWAP_OUT_OK, wait=1), BadRequest, 5),
    ("negative timeout", frame(timeout_ms=-1), BadRequest, 5),
    ("timeout above limit", frame(timeout_ms=MAX_TIMEOUT_MS + 1), BadRequest, 5),
    ("string timeout", frame(timeout_ms="5"), BadRequest, 5),
    ("bool timeout", frame(timeout_ms=True), BadRequest, 5),
    ("long hello client", frame(op="hello", client="c" * 257), BadRequest, 5),
    ("integer hello client", frame(op="hello", client=3), BadRequest, 5),
    ("register layout is a list", frame(**{**REGISTER_OK, "layout": []}), BadRequest, 5),
    ("register handle not a map", frame(**{**REGISTER_OK, "handles": [1]}), BadRequest, 5),
    ("register negative pid", frame(**REGISTER_OK, pid=-1), BadRequest, 5),
    # pairing and counts
    ("more keys than block ids", frame(op="swap_out", block_ids=[1], keys=["a", "b"]), BadRequest, 5),
    ("more block ids than keys", frame(op="swap_in", keys=["a"], block_ids=[1, 2]), BadRequest, 5),
    ("too many lookup keys", frame(op="lookup", keys=["k"] * (MAX_KEYS_PER_REQUEST + 1)), TooLarge, 5),
    ("too many delete keys", frame(op="delete", keys=["k"] * (MAX_KEYS_PER_REQUEST + 1)), TooLarge, 5),
    ("too many swap_in block ids",
     frame(op="swap_in", keys=["k"], block_ids=[0] * (MAX_KEYS_PER_REQUEST + 1)), TooLarge, 5),
    ("frame over the byte limit", b"\x00" * (MAX_MESSAGE_BYTES + 1), TooLarge, None),
    ("valid request over the byte limit",
     frame(op="hello", client="c", pad="x" * MAX_MESSAGE_BYTES), TooLarge, None),
    # keys
    ("empty key", frame(op="lookup", keys=["a", ""]), InvalidKey, 5),
    ("key too long", frame(op="lookup", keys=["a" * (MAX_KEY_LENGTH + 1)]), InvalidKey, 5),
    ("key with slash", frame(op="lookup", keys=["a/b"]), InvalidKey, 5),
    ("key is ..", frame(op="lookup", keys=[".."]), InvalidKey, 5),
    ("key is ../etc/passwd", frame(op="swap_in", keys=["../etc/passwd"], block_ids=[0]), InvalidKey, 5),
    ("leading dot", frame(op="lookup", keys=[".hidden"]), InvalidKey, 5),
    ("leading colon", frame(op="lookup", keys=[":x"]), InvalidKey, 5),
    ("leading dash", frame(op="lookup", keys=["-x"]), InvalidKey, 5),
    ("backslash", frame(op="lookup", keys=["a\\b"]), InvalidKey, 5),
    ("space", frame(op="lookup", keys=["a b"]), InvalidKey, 5),
    ("trailing newline", frame(op="lookup", keys=["abc\n"]), InvalidKey, 5),
    ("nul byte", frame(op="lookup", keys=["a\x00b"]), InvalidKey, 5),
    ("non-ascii letters", frame(op="lookup", keys=["ключ"]), InvalidKey, 5),
    ("integer key", frame(op="swap_out", block_ids=[1], keys=[7]), InvalidKey, 5),
    ("binary key", frame(op="lookup", keys=[b"abc"]), InvalidKey, 5),
    ("nil key", frame(op="lookup", keys=[None]), InvalidKey, 5),
]


@pytest.mark.parametrize("name,data,error,request_id", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_decode_request_rejects(name: str, data: bytes, error: type[KvswapError], request_id: int | None) -> None:
    exc = rejected(data)
    assert type(exc.error) is error
    assert exc.request_id == request_id
    assert str(exc) == exc.error.message
    # The daemon answers every rejection: the error must survive the reply encoding.
    got = decode_reply(encode_reply(Reply(exc.request_id, False, error=exc.error)))
    assert got.id == request_id
    assert type(got.error) is error
    assert got.error.message == exc.error.message


def test_unknown_fields_are_named() -> None:
    exc = rejected(frame(op="lookup", keys=["a"], zeta=1, alpha=2))
    assert exc.error.details == {"fields": ["alpha", "zeta"]}


def test_missing_fields_are_named() -> None:
    exc = rejected(frame(op="register", layout={}))
    assert exc.error.details == {"fields": ["handles", "regions"]}


def test_unknown_op_lists_the_known_ones() -> None:
    exc = rejected(frame(op="swap_all"))
    assert exc.error.details == {"known": sorted(REQUEST_TYPES)}
    assert len(exc.error.details["known"]) == 13  # the 11 engine ops and the two between daemons (peer_export, peer_release)


def test_version_error_reports_what_was_sent() -> None:
    assert rejected(frame(v=2)).error.details == {"got": "2"}


def test_length_mismatch_reports_both_counts() -> None:
    exc = rejected(frame(op="swap_out", block_ids=[1, 2, 3], keys=["a"]))
    assert exc.error.details == {"keys": 1, "block_ids": 3}


def test_too_many_keys_reports_count_and_limit() -> None:
    exc = rejected(frame(op="lookup", keys=["k"] * (MAX_KEYS_PER_REQUEST + 1)))
    assert exc.error.details == {"field": "keys", "count": 8193, "limit": 8192}


def test_oversized_frame_reports_size_and_limit() -> None:
    exc = rejected(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert exc.error.details == {"size": 4 * 1024 * 1024 + 1, "limit": 4 * 1024 * 1024}


def test_bad_key_reports_its_index() -> None:
    assert rejected(frame(op="lookup", keys=["a", "b", "c/d"])).error.details["index"] == 2
    assert rejected(frame(op="lookup", keys=["a", ""])).error.details == {"index": 1, "length": 0}


def test_bad_block_id_reports_field_and_index() -> None:
    exc = rejected(frame(op="swap_in", keys=["a", "b"], block_ids=[0, -1]))
    assert exc.error.details == {"field": "block_ids", "index": 1}


FIELD_REFUSALS = [
    # (frame fields, code, message, details): what the engine's log shows for each field check.
    (dict(timeout_ms="x"), "bad_request", "timeout_ms must be an integer in 0..3600000", {"field": "timeout_ms"}),
    (dict(op="lookup", keys="a"), "bad_request", "keys must be a list of strings", {"field": "keys"}),
    (dict(op="swap_in", keys=["a"], block_ids=3), "bad_request", "block_ids must be a list of integers",
     {"field": "block_ids"}),
    (dict(op="swap_in", keys=["a", "b"], block_ids=[0, True]), "bad_request",
     "block_ids[1] must be an integer in 0..2147483647", {"field": "block_ids", "index": 1}),
    (dict(op="swap_in", keys=["a"], block_ids=[0] * 8193), "too_large",
     "block_ids has 8193 entries, the limit is 8192", {"field": "block_ids", "count": 8193, "limit": 8192}),
    (dict(op="swap_out", keys=["a"], block_ids=[0], wait="later"), "bad_request",
     "wait must be one of ['copied', 'persisted']", {"field": "wait"}),
    (dict(op="swap_out", keys=["a"], block_ids=[0], partial=1), "bad_request", "partial must be true or false",
     {"field": "partial"}),
    (dict(op="register", layout=[], handles=[], regions=[]), "bad_request", "layout must be a map",
     {"field": "layout"}),
    (dict(op="register", layout={}, handles=[1], regions=[]), "bad_request", "handles must be a list of maps",
     {"field": "handles"}),
    (dict(op="register", layout={}, handles=[], regions=[{}] * 4097), "too_large",
     "regions has 4097 entries, the limit is 4096", {"field": "regions", "count": 4097, "limit": 4096}),
    (dict(op="register", layout={}, handles=[], regions=[], pid=2**31), "bad_request",
     "pid must be an integer in 0..2147483647", {"field": "pid"}),
    (dict(op="hello", client="c" * 257), "bad_request", "client must be a string of at most 256 characters",
     {"field": "client"}),
]


@pytest.mark.parametrize("fields, code, message, details", FIELD_REFUSALS, ids=[m for _, _, m, _ in FIELD_REFUSALS])
def test_each_field_refusal_says_which_field_and_why(fields: dict[str, Any], code: str, message: str,
                                                     details: dict[str, Any]) -> None:
    exc = rejected(frame(**fields))
    assert (exc.error.code, exc.error.message, exc.error.details) == (code, message, details)
    assert exc.request_id == 5
    assert exc.op == fields.get("op", "ping")  # counted under its op in the metrics


ENVELOPE_REFUSALS = [
    # (frame bytes, code, message, details)
    (pack([1, 2]), "bad_request", "a request is a msgpack map", {}),
    (pack({1: 2}), "bad_request", "not a msgpack message: ValueError", {}),  # map keys must be strings
    (b"\xc1", "bad_request", "not a msgpack message: FormatError", {}),
    (frame(id=-1), "bad_request", "id must be an integer in 0..18446744073709551615", {"field": "id"}),
    (frame(v="x" * 40), "unsupported_version", "protocol version must be 1", {"got": repr("x" * 40)[:32]}),
    (frame(op="o" * 70), "unknown_op", f"unknown op {'o' * 64!r}", {"known": sorted(REQUEST_TYPES)}),
    (frame(op="lookup", keys=["a"], **{f"f{i:02d}": 0 for i in range(17)}), "bad_request",
     "unknown fields for lookup", {"fields": [f"f{i:02d}" for i in range(16)]}),
    (frame(op="register", layout={}), "bad_request", "missing fields for register", {"fields": ["handles", "regions"]}),
    (frame(op="swap_in", keys=["a"], block_ids=[]), "bad_request", "keys and block_ids must have the same length",
     {"keys": 1, "block_ids": 0}),
    (b"\x00" * (MAX_MESSAGE_BYTES + 1), "too_large", "message of 4194305 bytes, the limit is 4194304",
     {"size": 4194305, "limit": 4194304}),
]


@pytest.mark.parametrize("data, code, message, details", ENVELOPE_REFUSALS, ids=[r[2][:40] for r in ENVELOPE_REFUSALS])
def test_each_envelope_refusal_says_why(data: bytes, code: str, message: str, details: dict[str, Any]) -> None:
    exc = rejected(data)
    assert (exc.error.code, exc.error.message, exc.error.details) == (code, message, details)
    # Only a refusal after the op was read is counted under that op.
    assert exc.op == ("lookup" if b"lookup" in data else "register" if b"register" in data
                      else "swap_in" if b"swap_in" in data else None)


def test_a_reply_that_is_not_a_map_is_named() -> None:
    with pytest.raises(BadRequest) as info:
        decode_reply(pack([1]))
    assert info.value.message == "a reply is a msgpack map with 'ok'"


def test_field_values_at_their_edges_are_accepted() -> None:
    assert decode_request(frame(op="hello", client="c" * 256)).client == "c" * 256
    assert decode_request(frame(op="swap_out", keys=["a"], block_ids=[0], partial=True)).partial is True
    assert decode_request(frame(op="swap_out", keys=["a"], block_ids=[0], partial=False)).partial is False
    got = decode_request(frame(op="register", layout={"a": 1}, handles=[{}] * 4096, regions=[{}], pid=2**31 - 1))
    assert (got.layout, len(got.handles), got.pid) == ({"a": 1}, 4096, 2**31 - 1)


@pytest.mark.parametrize("name,data,error,request_id", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_peek_id_agrees_with_decode_request(name: str, data: bytes, error: type[KvswapError],
                                            request_id: int | None) -> None:
    # The daemon uses peek_id to address a refusal it makes before decoding (busy, too large).
    assert peek_id(data) == request_id


def test_peek_id_of_valid_frames() -> None:
    assert peek_id(PING_7) == 7
    assert peek_id(SWAP_OUT_42) == 42
    assert peek_id(encode_request(Ping(id=MAX_REQUEST_ID))) == 2**64 - 1
    assert peek_id(frame(op="no_such_op", v=9)) == 5


# -- limits at their edges ----------------------------------------------------------------


def test_exactly_max_keys_is_accepted() -> None:
    keys = [f"k{i}" for i in range(MAX_KEYS_PER_REQUEST)]
    got = decode_request(frame(op="swap_out", keys=keys, block_ids=list(range(MAX_KEYS_PER_REQUEST))))
    assert len(got.keys) == len(got.block_ids) == 8192


def test_frame_of_exactly_max_bytes_is_parsed() -> None:
    # Pad an otherwise valid frame with an unknown field (strings within the shape limits) so
    # it is exactly the limit: the size and shape checks let it through and the field check is
    # what rejects it.
    chunk = "x" * 500  # 503 bytes with its str16 header; the list's array16 header adds 2
    count = (MAX_MESSAGE_BYTES - len(frame(pad=[])) - 2 - 259) // 503
    tail = 500 + MAX_MESSAGE_BYTES - len(frame(pad=[chunk] * count + ["x" * 500]))
    assert 256 <= tail <= 1024  # the tail keeps its 3-byte header
    data = frame(pad=[chunk] * count + ["x" * tail])
    assert len(data) == MAX_MESSAGE_BYTES
    exc = rejected(data)
    assert type(exc.error) is BadRequest
    assert exc.request_id == 5


def test_largest_block_id_and_longest_key_are_accepted() -> None:
    key = "a" * MAX_KEY_LENGTH
    got = decode_request(frame(op="swap_out", block_ids=[MAX_BLOCK_ID, 0], keys=[key, "b"]))
    assert got.block_ids == (2**31 - 1, 0)
    assert got.keys == (key, "b")


def test_largest_timeout_is_accepted() -> None:
    assert decode_request(frame(timeout_ms=MAX_TIMEOUT_MS)).timeout_ms == 3_600_000


@pytest.mark.parametrize("key", ["a", "0", "_", "Z.:=+-_9", "h:0f1e", "sha256:AbC+/x=".replace("/", "_"),
                                 "a..b", "x" * 128])
def test_check_key_accepts(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize("key", ["", "x" * 129, "/", "a/b", "..", ".", ".a", "=a", "+a", "a b", "a\tb", "a\n",
                                 "é", "a%2Fb", 1, None, b"a", ["a"]])
def test_check_key_rejects(key: object) -> None:
    with pytest.raises(InvalidKey) as info:
        check_key(key, 4)
    assert info.value.details["index"] == 4


def test_check_count() -> None:
    check_count("keys", MAX_KEYS_PER_REQUEST)
    check_count("regions", 10, limit=10)
    with pytest.raises(TooLarge) as info:
        check_count("regions", 11, limit=10)
    assert info.value.details == {"field": "regions", "count": 11, "limit": 10}


def test_limit_values() -> None:
    # Engines are built against these numbers; changing one is a protocol change.
    assert (MAX_MESSAGE_BYTES, MAX_KEYS_PER_REQUEST, MAX_KEY_LENGTH, MAX_BLOCK_ID, MAX_TIMEOUT_MS) == (
        4_194_304, 8192, 128, 2_147_483_647, 3_600_000)
    assert WAIT_MODES == ("copied", "persisted")


@pytest.mark.parametrize("version", [True, 1.0])
def test_version_must_be_the_integer_one(version: object) -> None:
    exc = rejected(frame(v=version))
    assert type(exc.error) is UnsupportedVersion


# -- properties ---------------------------------------------------------------------------

_KEY_HEAD = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
#: Valid keys: ``[A-Za-z0-9_][A-Za-z0-9_.:=+-]{0,127}`` (faster to draw than ``from_regex``).
KEYS = st.builds(lambda head, tail: head + tail, st.sampled_from(_KEY_HEAD),
                 st.text(alphabet=_KEY_HEAD + ".:=+-", max_size=MAX_KEY_LENGTH - 1))
IDS = st.integers(0, MAX_REQUEST_ID)
TIMEOUTS = st.none() | st.integers(0, MAX_TIMEOUT_MS)
BLOCK_IDS = st.integers(0, MAX_BLOCK_ID)
PAIRS = st.lists(st.tuples(KEYS, BLOCK_IDS), max_size=24)


@st.composite
def valid_requests(draw: st.DrawFn) -> Request:
    kind = draw(st.sampled_from(["swap_out", "swap_in", "lookup"]))
    rid, timeout = draw(IDS), draw(TIMEOUTS)
    if kind == "lookup":
        return Lookup(id=rid, timeout_ms=timeout, keys=tuple(draw(st.lists(KEYS, max_size=24))))
    pairs = draw(PAIRS)
    keys, block_ids = tuple(k for k, _ in pairs), tuple(b for _, b in pairs)
    if kind == "swap_in":
        return SwapIn(id=rid, timeout_ms=timeout, keys=keys, block_ids=block_ids)
    return SwapOut(id=rid, timeout_ms=timeout, keys=keys, block_ids=block_ids, wait=draw(st.sampled_from(WAIT_MODES)))


@settings(FAST, max_examples=300)
@given(valid_requests())
def test_decode_inverts_encode(req: Request) -> None:
    data = encode_request(req)
    got = decode_request(data)
    assert got == req
    assert type(got) is type(req)
    assert encode_request(got) == data


# -- an independent model of the request schema (docs/protocol.md), the oracle for decoding --

_SPEC_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=+-]{0,127}")


def _spec_uint(value: Any, top: int) -> bool:
    return type(value) is int and 0 <= value <= top


def _spec_keys(value: Any) -> str | None:
    """The error code a ``keys`` value earns, or None when it is valid."""
    if type(value) is not list:
        return "bad_request"
    if len(value) > 8192:
        return "too_large"
    if not all(type(k) is str and _SPEC_KEY.fullmatch(k) for k in value):
        return "invalid_key"
    return None


def _spec_block_ids(value: Any) -> str | None:
    if type(value) is not list:
        return "bad_request"
    if len(value) > 8192:
        return "too_large"
    return None if all(_spec_uint(b, 2**31 - 1) for b in value) else "bad_request"


def _spec_maps(value: Any) -> str | None:
    if type(value) is not list or not all(type(v) is dict for v in value):
        return "bad_request"
    return "too_large" if len(value) > 4096 else None


def _code(ok: bool) -> str | None:
    return None if ok else "bad_request"


#: op -> field -> (check returning an error code or None, required, default)
SPEC_OWNER: dict[str, tuple[Any, bool, Any]] = {  # who sends a swap_out, swap_in or unregister
    "token": (lambda v: _code(type(v) is str and len(v) <= 256), False, ""),
    "pid": (lambda v: _code(_spec_uint(v, 2**31 - 1)), False, 0),
}
SPEC: dict[str, dict[str, tuple[Any, bool, Any]]] = {
    "hello": {"client": (lambda v: _code(type(v) is str and len(v) <= 256), False, "")},
    "ping": {}, "unregister": dict(SPEC_OWNER), "clear": {}, "flush": {}, "stats": {},
    "register": {"layout": (lambda v: _code(type(v) is dict), True, None),
                 "handles": (_spec_maps, True, None), "regions": (_spec_maps, True, None),
                 "pid": (lambda v: _code(_spec_uint(v, 2**31 - 1)), False, 0)},
    "swap_out": {"block_ids": (_spec_block_ids, True, None), "keys": (_spec_keys, True, None),
                 "wait": (lambda v: _code(v in ("copied", "persisted") and type(v) is str), False, "copied"),
                 "partial": (lambda v: _code(type(v) is bool), False, False), **SPEC_OWNER},
    "swap_in": {"keys": (_spec_keys, True, None), "block_ids": (_spec_block_ids, True, None), **SPEC_OWNER},
    "lookup": {"keys": (_spec_keys, True, None),
               "peer": (lambda v: _code(type(v) is str and len(v) <= 256 and (v == "" or v.startswith("tcp://"))),
                        False, ""),
               "wait_ms": (lambda v: _code(_spec_uint(v, 60_000)), False, 0)},
    "delete": {"keys": (_spec_keys, True, None)},
    "peer_export": {"keys": (_spec_keys, True, None),
                    "namespace": (lambda v: _code(type(v) is str and re.fullmatch(r"[0-9a-f]{32}", v) is not None),
                                  True, None),
                    "wait_ms": (lambda v: _code(_spec_uint(v, 60_000)), False, 0),
                    "transport": (lambda v: _code(type(v) is str and v in ("mooncake", "inline")), False, "inline")},
    "peer_release": {"lease": (lambda v: _code(type(v) is str and len(v) <= 256), True, None)},
}


def _spec_past_shape_limits(msg: Any) -> bool:
    """The shape limits of docs/protocol.md, walked independently of the decoder: a string or
    bytes over 1,024 bytes, a map of over 64 entries, a list of over 16,384 items, or over
    65,536 entries (each container counting one more) in the whole frame."""
    items = 0
    stack = [msg]
    while stack:
        obj = stack.pop()
        if isinstance(obj, str) and len(obj.encode()) > 1024 or isinstance(obj, bytes) and len(obj) > 1024:
            return True
        if isinstance(obj, dict):
            if len(obj) > 64:
                return True
            items += len(obj) + 1
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list):
            if len(obj) > 16_384:
                return True
            items += len(obj) + 1
            stack.extend(obj)
    return items > 65_536


def spec_outcome(msg: Any) -> tuple[int | None, set[str] | dict[str, Any]]:
    """What the schema says of an unpacked frame: ``(id, {codes})`` for a refusal (any of the
    codes may be the one reported when several fields are wrong), or ``(id, fields)`` for a
    valid request, with every field the request carries (defaults filled in, lists as tuples)."""
    if _spec_past_shape_limits(msg):
        return None, {"too_large"}  # refused before the frame is read, so its id is unknown
    if type(msg) is not dict:
        return None, {"bad_request"}
    rid = msg.get("id")
    if not _spec_uint(rid, 2**64 - 1):
        return None, {"bad_request"}
    if type(msg.get("v")) is not int or msg.get("v") != 1:
        return rid, {"unsupported_version"}
    op = msg.get("op")
    if type(op) is not str or op not in SPEC:
        return rid, {"unknown_op"}
    fields = SPEC[op]
    codes = set()
    timeout = msg.get("timeout_ms")
    if timeout is not None and not _spec_uint(timeout, 3_600_000):
        codes.add("bad_request")
    if set(msg) - {"v", "id", "op", "timeout_ms"} - set(fields):
        codes.add("bad_request")
    out: dict[str, Any] = {"op": op, "id": rid, "timeout_ms": timeout}
    for name, (check, required, default) in fields.items():
        if name not in msg:
            if required:
                codes.add("bad_request")
            out[name] = default
            continue
        code = check(msg[name])
        if code is not None:
            codes.add(code)
        out[name] = tuple(msg[name]) if type(msg[name]) is list else msg[name]
    if op in ("swap_out", "swap_in") and not codes and len(msg["keys"]) != len(msg["block_ids"]):
        codes.add("bad_request")
    return rid, (codes or out)


def _check_decode_outcome(data: bytes) -> None:
    """Decoding agrees with the schema model: a frame the model calls valid decodes to exactly
    its fields, and any other is refused with one of the codes the model finds."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        rid, want = None, {"bad_request"}
    else:
        rid, want = spec_outcome(msg)
    try:
        got = decode_request(data)
    except DecodeError as exc:
        assert isinstance(want, set), f"a valid request was refused: {exc.error.code} {exc.error.message}"
        assert exc.error.code in want, (exc.error.code, want)
        assert exc.request_id == rid
        # Every rejection can be answered.
        assert decode_reply(encode_reply(Reply(exc.request_id, False, error=exc.error))).error.code == exc.error.code
        assert peek_id(data) == exc.request_id
    else:
        assert isinstance(want, dict), f"accepted a request the schema refuses with {want}: {got}"
        assert type(got) is REQUEST_TYPES[want["op"]]
        assert {f: getattr(got, f) for f in want if f != "op"} == {f: v for f, v in want.items() if f != "op"}
        assert peek_id(data) == got.id
        assert decode_request(encode_request(got)) == got


@settings(FAST, max_examples=2000)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    _check_decode_outcome(data)


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELD_NAMES = st.sampled_from(
    ["v", "id", "op", "timeout_ms", "keys", "block_ids", "wait", "client", "layout", "handles", "regions", "pid", "x"]
)
PLAUSIBLE = st.one_of(
    st.sampled_from([1, 0, 5, 2**64 - 1, *REQUEST_TYPES, *WAIT_MODES]),
    st.lists(st.sampled_from(["a", "b1", ".x", "", "a/b", 3]), max_size=4),
    st.lists(st.integers(-2, 2**31), max_size=4),
    st.lists(st.dictionaries(st.text(max_size=4), st.integers(-5, 2**32), max_size=2), max_size=2),
    MSGPACK_VALUES,
)


@settings(FAST, max_examples=300)
@given(st.dictionaries(FIELD_NAMES, PLAUSIBLE, max_size=7))
def test_near_miss_maps_decode_or_raise_decode_error(msg: dict[str, Any]) -> None:
    # Random bytes rarely get past the msgpack layer; near-miss maps exercise the field checks.
    _check_decode_outcome(pack(msg))


@st.composite
def one_edit_from_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request's map with one field changed, added or removed: half of these stay
    valid (the model says which), so both of the oracle's branches are exercised."""
    msg = msgpack.unpackb(encode_request(draw(valid_requests())), raw=False)
    name = draw(FIELD_NAMES)
    action = draw(st.sampled_from(["set", "delete", "key"]))
    if action == "delete":
        msg.pop(name, None)
    elif action == "key" and msg.get("keys"):
        i = draw(st.integers(0, len(msg["keys"]) - 1))
        msg["keys"][i] = draw(st.sampled_from(["a/b", "/", ".x", "-x", "a b", "é", "x" * 129, "", "ok.key", 7]))
    else:
        msg[name] = draw(PLAUSIBLE | KEYS | st.lists(KEYS, max_size=3))
    return msg


@settings(FAST, max_examples=600)
@given(one_edit_from_valid())
def test_one_edit_from_a_valid_request_decodes_as_the_schema_says(msg: dict[str, Any]) -> None:
    _check_decode_outcome(pack(msg))


def test_the_schema_model_refuses_a_key_with_a_slash() -> None:
    """The oracle itself: a key with ``/`` is refused (the old oracle accepted any decode)."""
    msg = {"v": 1, "id": 1, "op": "lookup", "keys": ["a/b"]}
    assert spec_outcome(msg) == (1, {"invalid_key"})
    assert spec_outcome({**msg, "keys": ["a.b"]})[1] == {"op": "lookup", "id": 1, "timeout_ms": None, "keys": ("a.b",),
                                                         "peer": "", "wait_ms": 0}
    _check_decode_outcome(pack(msg))


def test_lookup_leaves_its_peer_fields_off_the_wire_at_their_defaults() -> None:
    # Byte-identical to the lookup of before the fields existed (test_encode_lookup_literal).
    assert encode_request(Lookup(id=1, keys=("h:00ff",), peer="", wait_ms=0)) == (
        b"\x84\xa1v\x01\xa2id\x01\xa2op\xa6lookup\xa4keys\x91\xa6h:00ff"
    )
    with pytest.raises(BadRequest):
        encode_request(Lookup(id=1, keys=("a",), wait_ms=60_001))
    with pytest.raises(BadRequest):
        encode_request(Lookup(id=1, keys=("a",), peer="10.0.0.5:55500"))
    with pytest.raises(BadRequest):
        encode_request(PeerExport(id=1, keys=("a",), namespace="not-hex"))


# Keys near the grammar's edges: its alphabet, the bytes a key may not start with, a newline
# (what check_keys joins keys with), a space, non-ASCII, lengths around the limit, non-strings.
_KEY_PARTS = st.text(alphabet="aZ09_.:=+-\n é", max_size=6)
_EDGE_KEYS = st.one_of(
    _KEY_PARTS,
    st.builds(lambda p, n: p + "a" * n, _KEY_PARTS, st.sampled_from([0, 120, 127, 128, 129])),
    st.sampled_from(["", "a", ".a", "a.", "-", "a\n", "\na", "k" * MAX_KEY_LENGTH, "k" * (MAX_KEY_LENGTH + 1)]),
    st.integers(), st.none(), st.binary(max_size=3),
)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_EDGE_KEYS, max_size=6))
def test_check_keys_decides_as_check_key_does_key_by_key(keys: list) -> None:
    """The all-at-once check accepts exactly the lists whose every key check_key accepts, and
    refuses the others with check_key's error for the first bad key."""
    expected: tuple | InvalidKey
    try:
        expected = tuple(check_key(k, i) for i, k in enumerate(keys))
    except InvalidKey as exc:
        expected = exc
    try:
        got: tuple | InvalidKey = check_keys(keys)
    except InvalidKey as exc:
        got = exc
    if isinstance(expected, InvalidKey):
        assert isinstance(got, InvalidKey)
        assert (got.message, got.details) == (expected.message, expected.details)
    else:
        assert got == expected and all(type(k) is str for k in got)
