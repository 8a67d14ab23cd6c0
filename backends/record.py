"""The stored record: a fixed header, zero padding, then the block's payload.

Header (little-endian), 196 bytes, followed by zeros up to ``header_len``::

    0   4s   magic            b"KVSR"
    4   H    format version   1
    6   H    header_len       256, or 4096 for payloads >= 64 KiB (so the payload
                              starts on a page boundary and O_DIRECT can read it)
    8   I    flags            low byte: checksum algorithm (1 = xxh3-64)
    12  16s  namespace        the layout fingerprint, as 16 raw bytes
    28  Q    payload_len
    36  Q    payload checksum xxh3-64 of the payload
    44  Q    created          unix time in nanoseconds
    52  H    key_len
    54  6x   reserved (zero)
    60  128s key              utf-8, zero padded
    188 Q    header checksum  xxh3-64 of bytes 0..187

A record is served only when every field matches what the reader expects (magic, version,
namespace, key, length) and both checksums hold; anything else is *corrupt*, which callers
treat as a miss. The key inside the header is what makes a hash collision of two keys' file
names harmless.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Final

import xxhash

from kvswap.common.units import PAGE_BYTES
from kvswap.protocol.errors import Corrupt
from kvswap.protocol.layout import RECORD_FORMAT
from kvswap.protocol.limits import MAX_KEY_LENGTH

MAGIC: Final = b"KVSR"
#: One constant for the format: it is in every header and in every namespace fingerprint, so a
#: new format is a new namespace and old records are never misread.
FORMAT_VERSION: Final = RECORD_FORMAT
CHECKSUM_XXH3_64: Final = 1

_FIXED = struct.Struct("<4sHHI16sQQQH6x128s")
_HEADER_CHECKSUM = struct.Struct("<Q")
HEADER_CORE_BYTES: Final = _FIXED.size + _HEADER_CHECKSUM.size  # 196
SMALL_HEADER: Final = 256
#: One page, so a large record's payload starts page aligned (O_DIRECT reads it in place).
ALIGNED_HEADER: Final = PAGE_BYTES
#: Payloads from this size on get a page-sized header so the payload is page aligned.
ALIGN_PAYLOAD_FROM: Final = 64 * 1024


def header_len_for(payload_len: int) -> int:
    return ALIGNED_HEADER if payload_len >= ALIGN_PAYLOAD_FROM else SMALL_HEADER


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True)
class RecordHeader:
    namespace: bytes
    key: str
    payload_len: int
    checksum: int
    created_ns: int
    header_len: int


def encode_header(namespace: bytes, key: str, payload_len: int, checksum: int, created_ns: int | None = None) -> bytes:
    """The header bytes (``header_len`` long, zero padded) for one record."""
    key_bytes = key.encode()
    if len(key_bytes) > MAX_KEY_LENGTH:
        raise ValueError("key too long for a record header")
    if len(namespace) != 16:
        raise ValueError("namespace must be 16 bytes")
    header_len = header_len_for(payload_len)
    created = time.time_ns() if created_ns is None else created_ns
    core = _FIXED.pack(MAGIC, FORMAT_VERSION, header_len, CHECKSUM_XXH3_64, namespace, payload_len, checksum, created,
                       len(key_bytes), key_bytes)
    core += _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(core))
    return core + bytes(header_len - len(core))


def decode_header(data: bytes | memoryview) -> RecordHeader:
    """Parse and check the header's own integrity. Raises :class:`Corrupt`."""
    if len(data) < HEADER_CORE_BYTES:
        raise Corrupt("record shorter than its header", size=len(data))
    core = bytes(data[: _FIXED.size])
    (stored_sum,) = _HEADER_CHECKSUM.unpack_from(data, _FIXED.size)
    if xxhash.xxh3_64_intdigest(core) != stored_sum:
        raise Corrupt("header checksum mismatch")
    magic, version, header_len, flags, namespace, payload_len, checksum, created, key_len, key_raw = _FIXED.unpack(core)
    if magic != MAGIC:
        raise Corrupt("bad magic")
    if version != FORMAT_VERSION:
        raise Corrupt("unknown record format version", version=version)
    if flags & 0xFF != CHECKSUM_XXH3_64:
        raise Corrupt("unknown checksum algorithm", flags=flags)
    if header_len != header_len_for(payload_len) or key_len > MAX_KEY_LENGTH:
        raise Corrupt("inconsistent header lengths")
    try:
        key = key_raw[:key_len].decode()
    except UnicodeDecodeError:
        raise Corrupt("key is not utf-8") from None
    return RecordHeader(namespace, key, payload_len, checksum, created, header_len)


def verify(header: RecordHeader, namespace: bytes, key: str, payload: memoryview | bytes) -> None:
    """Check a decoded header and its payload against what the reader asked for."""
    if header.namespace != namespace:
        raise Corrupt("record belongs to another namespace")
    if header.key != key:
        raise Corrupt("record holds another key", stored_key=header.key)
    if len(payload) != header.payload_len:
        raise Corrupt("payload length mismatch", expected=header.payload_len, got=len(payload))
    if payload_checksum(payload) != header.checksum:
        raise Corrupt("payload checksum mismatch")


def encode_record(namespace: bytes, key: str, payload: bytes | memoryview) -> bytes:
    """The whole record as one bytes object (tests and small tiers; the file store writes
    header and payload with one vectored write instead)."""
    return encode_header(namespace, key, len(payload), payload_checksum(payload)) + bytes(payload)


def decode_record(data: bytes | memoryview, namespace: bytes, key: str) -> memoryview:
    """Verify a whole record and return a view of its payload. Raises :class:`Corrupt`."""
    view = memoryview(data)
    header = decode_header(view)
    payload = view[header.header_len:]
    verify(header, namespace, key, payload)
    return payload
