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

An *annotation* may follow the core in a page-sized header (flags bit 8 set): ``I`` length,
``Q`` xxh3-64 of the annotation, then its bytes, zero padded as before. It is what KV events
name the record by (the engine's block hashes and tokens, msgpack), kept so that a restart
announces records under the same names. Readers that do not look for it are unaffected
(flags' high bits are ignored on read); the payload's checks never depend on it.
"""

from __future__ import annotations

import os
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
#: flags bit: an annotation follows the header core.
FLAG_ANNOTATED: Final = 0x100

_FIXED = struct.Struct("<4sHHI16sQQQH6x128s")
_HEADER_CHECKSUM = struct.Struct("<Q")
HEADER_CORE_BYTES: Final = _FIXED.size + _HEADER_CHECKSUM.size  # 196
SMALL_HEADER: Final = 256
#: One page, so a large record's payload starts page aligned (O_DIRECT reads it in place).
ALIGNED_HEADER: Final = PAGE_BYTES
#: Payloads from this size on get a page-sized header so the payload is page aligned.
ALIGN_PAYLOAD_FROM: Final = 64 * 1024
_ANNOTATION = struct.Struct("<IQ")


def annotation_room(header_len: int) -> int:
    """The most annotation bytes a header of ``header_len`` carries (3,888 in a page-sized
    one; none in the 256-byte header of a small record)."""
    return max(0, header_len - HEADER_CORE_BYTES - _ANNOTATION.size)


def header_len_for(payload_len: int) -> int:
    return ALIGNED_HEADER if payload_len >= ALIGN_PAYLOAD_FROM else SMALL_HEADER


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def checksum_at(fd: int, offset: int, length: int, chunk_bytes: int) -> int | None:
    """:func:`payload_checksum` of ``length`` bytes of ``fd`` from ``offset``, read in chunks of
    at most ``chunk_bytes`` (memory stays bounded whatever the record's size); None when the
    file ends first."""
    digest = xxhash.xxh3_64()
    chunk = memoryview(bytearray(max(1, min(chunk_bytes, length))))
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [chunk[: min(len(chunk), end - offset)]], offset)
        if n <= 0:
            return None
        digest.update(chunk[:n])
        offset += n
    return digest.intdigest()


@dataclass(frozen=True)
class RecordHeader:
    namespace: bytes
    key: str
    payload_len: int
    checksum: int
    created_ns: int
    header_len: int


def encode_header(namespace: bytes, key: str, payload_len: int, checksum: int, created_ns: int | None = None,
                  annotation: bytes = b"") -> bytes:
    """The header bytes (``header_len`` long, zero padded) for one record; ``annotation`` is
    kept only where it fits (:func:`annotation_room`), else left out."""
    key_bytes = key.encode()
    if len(key_bytes) > MAX_KEY_LENGTH:
        raise ValueError("key too long for a record header")
    if len(namespace) != 16:
        raise ValueError("namespace must be 16 bytes")
    header_len = header_len_for(payload_len)
    created = time.time_ns() if created_ns is None else created_ns
    annotated = 0 < len(annotation) <= annotation_room(header_len)
    flags = CHECKSUM_XXH3_64 | (FLAG_ANNOTATED if annotated else 0)
    core = _FIXED.pack(MAGIC, FORMAT_VERSION, header_len, flags, namespace, payload_len, checksum, created,
                       len(key_bytes), key_bytes)
    core += _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(core))
    if annotated:
        core += _ANNOTATION.pack(len(annotation), xxhash.xxh3_64_intdigest(annotation)) + annotation
    return core + bytes(header_len - len(core))


def decode_annotation(data: bytes | memoryview) -> bytes | None:
    """The annotation of a header whose core :func:`decode_header` accepted, or None when it
    has none, or when ``data`` (the header's first bytes) does not hold all of it, or its
    checksum fails (the record itself is still good: it is only served by its other checks)."""
    (flags,) = struct.unpack_from("<I", data, 8)
    if not flags & FLAG_ANNOTATED or len(data) < HEADER_CORE_BYTES + _ANNOTATION.size:
        return None
    length, checksum = _ANNOTATION.unpack_from(data, HEADER_CORE_BYTES)
    start = HEADER_CORE_BYTES + _ANNOTATION.size
    body = bytes(data[start:start + length])
    if len(body) != length or xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    return body


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
