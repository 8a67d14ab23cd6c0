"""The stored record format (kvswap.backends.record): byte layout of the header, round trips,
and that every damaged or misdirected record is refused with ``Corrupt``. Pure units."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvswap.backends import record
from kvswap.backends.record import (
    HEADER_CORE_BYTES,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
    verify,
)
from kvswap.protocol.errors import Corrupt

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
KEY = "blk:00ab=cd+ef-1.2_3"

_FIRST = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
_REST = _FIRST + ".:=+-"

keys = st.builds(lambda a, b: a + b, st.sampled_from(_FIRST), st.text(alphabet=_REST, max_size=127))
namespaces = st.binary(min_size=16, max_size=16)
payloads = st.binary(max_size=2048)

_FIXED = struct.Struct("<4sHHI16sQQQH6x128s")


def craft_header(*, magic=b"KVSR", version=1, header_len=256, flags=1, namespace=NS, payload_len=8, checksum=0,
                 created=0, key_len=None, key_raw=KEY.encode()) -> bytes:
    """A header with every field chosen by the test and a *valid* header checksum, so the
    field checks behind the checksum are reached."""
    key_len = len(key_raw) if key_len is None else key_len
    core = _FIXED.pack(magic, version, header_len, flags, namespace, payload_len, checksum, created, key_len, key_raw)
    core += struct.pack("<Q", xxhash.xxh3_64_intdigest(core))
    return core + bytes(header_len - len(core))


# -- byte layout ----------------------------------------------------------------------------


def test_header_core_is_196_bytes():
    assert HEADER_CORE_BYTES == 196
    assert record.SMALL_HEADER == 256 and record.ALIGNED_HEADER == 4096


def test_header_bytes_match_the_documented_layout():
    header = encode_header(NS, "abc", payload_len=10, checksum=0x1122334455667788, created_ns=0x0102030405060708)
    assert len(header) == 256
    assert header[0:4] == b"KVSR"
    assert header[4:6] == b"\x01\x00"  # format version 1, little-endian
    assert header[6:8] == b"\x00\x01"  # header_len 256
    assert header[8:12] == b"\x01\x00\x00\x00"  # flags: xxh3-64
    assert header[12:28] == NS
    assert header[28:36] == b"\x0a" + bytes(7)  # payload_len
    assert header[36:44] == bytes.fromhex("8877665544332211")  # payload checksum
    assert header[44:52] == bytes.fromhex("0807060504030201")  # created
    assert header[52:54] == b"\x03\x00"  # key_len
    assert header[54:60] == bytes(6)  # reserved
    assert header[60:188] == b"abc" + bytes(125)
    assert header[188:196] == struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:188]))
    assert header[196:] == bytes(60)


def test_record_is_header_then_payload():
    payload = b"\x00\x01hello\xff"
    data = encode_record(NS, KEY, payload)
    assert len(data) == 256 + len(payload)
    assert data[256:] == payload
    h = decode_header(data)
    assert (h.namespace, h.key, h.payload_len, h.header_len) == (NS, KEY, len(payload), 256)
    assert h.checksum == xxhash.xxh3_64_intdigest(payload)


@pytest.mark.parametrize("size, header_len", [(0, 256), (1, 256), (65535, 256), (65536, 4096), (65537, 4096),
                                              (1 << 20, 4096)])
def test_header_len_is_page_sized_from_64_kib(size, header_len):
    payload = bytes([7]) * size
    data = encode_record(NS, KEY, payload)
    assert record.header_len_for(size) == header_len
    assert len(data) == header_len + size
    assert data[6:8] == struct.pack("<H", header_len)
    assert data[HEADER_CORE_BYTES:header_len] == bytes(header_len - HEADER_CORE_BYTES)
    assert bytes(decode_record(data, NS, KEY)) == payload


def test_encode_header_refuses_long_key_and_bad_namespace():
    encode_header(NS, "k" * 128, 1, 0)  # the longest key fits
    with pytest.raises(ValueError):
        encode_header(NS, "k" * 129, 1, 0)
    with pytest.raises(ValueError):
        encode_header(NS[:15], KEY, 1, 0)
    with pytest.raises(ValueError):
        encode_header(NS + b"\x00", KEY, 1, 0)


# -- round trip -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(key=keys, namespace=namespaces, payload=payloads)
def test_round_trip(key, namespace, payload):
    data = encode_record(namespace, key, payload)
    assert bytes(decode_record(data, namespace, key)) == payload
    h = decode_header(data)
    assert (h.namespace, h.key, h.payload_len) == (namespace, key, len(payload))
    # from a memoryview and a bytearray too (the file store reads into buffers)
    assert bytes(decode_record(memoryview(bytearray(data)), namespace, key)) == payload


@settings(max_examples=20, deadline=None)
@given(key=keys, size=st.integers(min_value=65536 - 8, max_value=65536 + 8), seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_round_trip_around_the_alignment_threshold(key, size, seed, data):
    """Random bytes (not a constant, which would hide a payload read from the wrong offset)
    either side of the 64 KiB header switch; any payload byte flipped is then corrupt."""
    payload = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    encoded = encode_record(NS, key, payload)
    header_len = 4096 if size >= 65536 else 256
    assert len(encoded) - size == header_len
    assert encoded[header_len:] == payload
    assert bytes(decode_record(encoded, NS, key)) == payload
    flip = data.draw(st.integers(0, size - 1), label="flip")
    damaged = bytearray(encoded)
    damaged[header_len + flip] ^= 0x01
    with pytest.raises(Corrupt):
        decode_record(bytes(damaged), NS, key)


# -- damage is Corrupt ----------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_header_core_byte_is_protected(mask):
    data = encode_record(NS, KEY, b"payload bytes")
    for i in range(HEADER_CORE_BYTES):
        damaged = bytearray(data)
        damaged[i] ^= mask
        with pytest.raises(Corrupt):
            decode_record(bytes(damaged), NS, KEY)


@settings(max_examples=100, deadline=None)
@given(key=keys, payload=st.binary(min_size=1, max_size=512), data=st.data())
def test_flipping_any_payload_byte_is_corrupt(key, payload, data):
    encoded = bytearray(encode_record(NS, key, payload))
    index = data.draw(st.integers(0, len(payload) - 1), label="index")
    mask = data.draw(st.integers(1, 255), label="mask")
    encoded[256 + index] ^= mask
    with pytest.raises(Corrupt, match="payload checksum"):
        decode_record(bytes(encoded), NS, key)


@settings(max_examples=100, deadline=None)
@given(key=keys, namespace=namespaces, payload=payloads, index=st.integers(0, 195), mask=st.integers(1, 255))
def test_flipping_any_header_core_byte_is_corrupt(key, namespace, payload, index, mask):
    encoded = bytearray(encode_record(namespace, key, payload))
    encoded[index] ^= mask
    with pytest.raises(Corrupt):
        decode_record(bytes(encoded), namespace, key)


@settings(max_examples=60, deadline=None)
@given(key=keys, namespace=namespaces, other=namespaces, payload=payloads)
def test_wrong_namespace_is_corrupt(key, namespace, other, payload):
    data = encode_record(namespace, key, payload)
    if other == namespace:
        other = bytes(b ^ 1 for b in other)
    with pytest.raises(Corrupt, match="namespace"):
        decode_record(data, other, key)


@settings(max_examples=60, deadline=None)
@given(key=keys, other=keys, payload=payloads)
def test_wrong_key_is_corrupt(key, other, payload):
    data = encode_record(NS, key, payload)
    if other == key:
        other = key + "x" if len(key) < 128 else key[:-1]
    with pytest.raises(Corrupt, match="another key") as info:
        decode_record(data, NS, other)
    assert info.value.details["stored_key"] == key


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(min_size=1, max_size=600), data=st.data())
def test_truncated_record_is_corrupt(payload, data):
    encoded = encode_record(NS, KEY, payload)
    cut = data.draw(st.integers(0, len(encoded) - 1), label="cut")
    with pytest.raises(Corrupt):
        decode_record(encoded[:cut], NS, KEY)


def test_truncated_payload_reports_lengths():
    encoded = encode_record(NS, KEY, b"0123456789")
    with pytest.raises(Corrupt, match="length") as info:
        decode_record(encoded[:-3], NS, KEY)
    assert info.value.details == {"expected": 10, "got": 7}


def test_trailing_bytes_are_corrupt():
    encoded = encode_record(NS, KEY, b"0123456789")
    with pytest.raises(Corrupt, match="length"):
        decode_record(encoded + b"\x00", NS, KEY)


def test_short_header_is_corrupt():
    with pytest.raises(Corrupt, match="shorter") as info:
        decode_header(b"KVSR" + bytes(100))
    assert info.value.details == {"size": 104}
    with pytest.raises(Corrupt):
        decode_header(b"")


def test_all_zero_header_is_corrupt():
    with pytest.raises(Corrupt):
        decode_record(bytes(300), NS, KEY)


# -- each field check, behind a valid header checksum -----------------------------------------


def test_crafted_valid_header_decodes():
    h = decode_header(craft_header(payload_len=8, checksum=5, created=9))
    assert (h.namespace, h.key, h.payload_len, h.checksum, h.created_ns, h.header_len) == (NS, KEY, 8, 5, 9, 256)


@pytest.mark.parametrize("fields, message, details", [
    (dict(magic=b"KVSX"), "bad magic", {}),
    (dict(version=2), "unknown record format version", {"version": 2}),
    (dict(version=0), "unknown record format version", {"version": 0}),
    (dict(flags=2), "unknown checksum algorithm", {"flags": 2}),
    (dict(flags=0), "unknown checksum algorithm", {"flags": 0}),
    (dict(header_len=4096, payload_len=8), "inconsistent header lengths", {}),  # small payload, big header
    (dict(header_len=256, payload_len=65536), "inconsistent header lengths", {}),  # big payload, small header
    (dict(key_len=129), "inconsistent header lengths", {}),
    (dict(key_raw=b"\xff\xfe"), "key is not utf-8", {}),
])
def test_each_header_field_is_checked(fields, message, details):
    """The exact reason and its details: ``kvswap verify`` and the daemon's log show them."""
    with pytest.raises(Corrupt) as info:
        decode_header(craft_header(**fields))
    assert (info.value.message, info.value.details) == (message, details)


def test_a_key_of_the_longest_length_round_trips():
    key = "k" * 128
    assert decode_header(craft_header(key_raw=key.encode())).key == key
    assert bytes(decode_record(encode_record(NS, key, b"x"), NS, key)) == b"x"


def test_the_header_core_alone_decodes():
    """The 196 core bytes are the whole header as far as decoding goes (the zero padding
    after them is not read)."""
    core = encode_header(NS, KEY, 8, 5, created_ns=9)[:HEADER_CORE_BYTES]
    assert decode_header(core).payload_len == 8
    with pytest.raises(Corrupt) as info:
        decode_header(core[:-1])
    assert (info.value.message, info.value.details) == ("record shorter than its header", {"size": 195})


def test_damage_is_named_exactly():
    data = bytearray(encode_record(NS, KEY, b"payload"))
    data[100] ^= 1
    with pytest.raises(Corrupt) as info:
        decode_header(bytes(data))
    assert info.value.message == "header checksum mismatch"
    h = decode_header(encode_header(NS, KEY, 7, record.payload_checksum(b"payload")))
    reasons = []
    for args in ((OTHER_NS, KEY, b"payload"), (NS, "other", b"payload"), (NS, KEY, b"payloa"),
                 (NS, KEY, b"Payload")):
        with pytest.raises(Corrupt) as info:
            verify(h, *args)
        reasons.append((info.value.message, info.value.details))
    assert reasons == [("record belongs to another namespace", {}),
                       ("record holds another key", {"stored_key": KEY}),
                       ("payload length mismatch", {"expected": 7, "got": 6}),
                       ("payload checksum mismatch", {})]


def test_encode_header_says_what_is_wrong():
    with pytest.raises(ValueError) as info:
        encode_header(NS, "k" * 129, 1, 0)
    assert str(info.value) == "key too long for a record header"
    with pytest.raises(ValueError) as info:
        encode_header(NS[:15], KEY, 1, 0)
    assert str(info.value) == "namespace must be 16 bytes"


def test_verify_checks_payload_against_header():
    payload = b"abcdef"
    h = decode_header(encode_header(NS, KEY, len(payload), record.payload_checksum(payload)))
    verify(h, NS, KEY, payload)  # matches: no error
    with pytest.raises(Corrupt, match="checksum"):
        verify(h, NS, KEY, b"abcdeg")
    with pytest.raises(Corrupt, match="length"):
        verify(h, NS, KEY, b"abcde")
    with pytest.raises(Corrupt, match="namespace"):
        verify(h, OTHER_NS, KEY, payload)
    with pytest.raises(Corrupt, match="another key"):
        verify(h, NS, KEY + "x", payload)
