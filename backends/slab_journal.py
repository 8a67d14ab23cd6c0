"""The slab layout's journal: which record lies in which slot, as fixed-size entries appended
to a file.

Every slab file (``<id>.slab``, fixed-size slots) has a journal (``<id>.journal``) written only
by the daemon that owns the slab. A journal starts with a header entry that says what it
describes, then holds one 64-byte entry per event (little-endian)::

    0   4s  magic       b"KVJ1"
    4   B   op          1 put, 2 free, 3 touch, 15 header
    5   3x  reserved
    8   4s  slab        the id of the slab the entry is about (not always the journal's own:
                        a daemon frees and touches records in others' slabs through its own)
    12  I   slot        slot index in that slab
    16  I   gen         the slot's generation: each put into a slot takes the next one
    20  4x  reserved
    24  q   stamp       the record's recency stamp (ns; ChainOrder's stamp)
    32  16s name        the record's name: xxh3-128 of its key, raw
    48  8x  reserved
    56  Q   checksum    :func:`entry_checksum` of bytes 0..55

The header entry's fields mean: slab = the journal's own id, slot = slot bytes,
gen = journal format (1), stamp = record bytes, name = the namespace fingerprint.

Entries are applied by generation, so the journals of several daemons can be read in any
order: a put applies when its generation is newer than what is known of its slot; a free or
a touch only when it names the slot's current generation. An entry whose checksum does not
hold is skipped (a torn append at the tail after a SIGKILL, or a damaged sector), never
trusted; its fixed size keeps the entries after it readable.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Final, Iterator

import numpy as np

ENTRY_BYTES: Final = 64
MAGIC: Final = b"KVJ1"
JOURNAL_FORMAT: Final = 1

PUT: Final = 1
FREE: Final = 2
TOUCH: Final = 3
HEADER: Final = 15

_BODY = struct.Struct("<4sB3x4sII4xq16s8x")
_SUM = struct.Struct("<Q")
_WORDS = struct.Struct("<7Q")
_M64: Final = (1 << 64) - 1
_PRIME1: Final = 0x9E3779B185EBCA87
_PRIME2: Final = 0xC2B2AE3D27D4EB4F


def entry_checksum(body: bytes) -> int:
    """The checksum of an entry's first 56 bytes: its seven 64-bit words folded through
    multiply-xorshift rounds. Not cryptographic (the journal is the daemon's own 0600 file); it
    catches torn appends and damaged sectors, and numpy computes it for a whole journal at once
    (:func:`_checksums`), where a per-entry hash call cost most of a million-entry replay."""
    h = 0x27D4EB2F165667C5
    for word in _WORDS.unpack(body):
        h = ((h ^ word) * _PRIME1) & _M64
        h ^= h >> 31
    h = (h * _PRIME2) & _M64
    return h ^ (h >> 29)


def _checksums(words: np.ndarray) -> np.ndarray:
    """:func:`entry_checksum` of every row of an ``(n, 7)`` uint64 array (wrapping arithmetic)."""
    h = np.full(len(words), 0x27D4EB2F165667C5, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(7):
            h = (h ^ words[:, i]) * np.uint64(_PRIME1)
            h ^= h >> np.uint64(31)
        h = h * np.uint64(_PRIME2)
    return h ^ (h >> np.uint64(29))
assert _BODY.size + _SUM.size == ENTRY_BYTES

#: The same layout as a numpy record type, to decode a whole journal at once (a million
#: entries in well under a second, where a struct loop takes several).
ENTRY_DTYPE: Final = np.dtype([("magic", "S4"), ("op", "u1"), ("_r0", "V3"), ("slab", "V4"), ("slot", "<u4"),
                               ("gen", "<u4"), ("_r1", "V4"), ("stamp", "<i8"), ("name", "V16"), ("_r2", "V8"),
                               ("sum", "<u8")])
assert ENTRY_DTYPE.itemsize == ENTRY_BYTES


@dataclass(frozen=True)
class Entry:
    op: int
    slab: bytes
    slot: int
    gen: int
    stamp: int
    name: bytes

    def encode(self) -> bytes:
        body = _BODY.pack(MAGIC, self.op, self.slab, self.slot, self.gen, self.stamp, self.name)
        return body + _SUM.pack(entry_checksum(body))


def header_entry(slab: bytes, slot_bytes: int, record_bytes: int, namespace: bytes) -> Entry:
    return Entry(HEADER, slab, slot_bytes, JOURNAL_FORMAT, record_bytes, namespace)


def decode(buf: bytes | memoryview) -> tuple[np.ndarray, int, int]:
    """The entries of ``buf`` whose checksums hold (a structured array), how many entries
    before the last good one failed theirs (damaged: skipped for good), and how many bytes
    were consumed: up to the end of the last good entry. What follows it (a partial entry, or
    one whose checksum fails because its append is still in progress) is read again later."""
    whole = len(buf) - len(buf) % ENTRY_BYTES
    if not whole:
        return np.empty(0, dtype=ENTRY_DTYPE), 0, 0
    blob = bytes(buf[:whole])
    words = np.frombuffer(blob, dtype="<u8").reshape(-1, ENTRY_BYTES // 8)
    good = _checksums(words[:, :7]) == words[:, 7]
    entries = np.frombuffer(blob, dtype=ENTRY_DTYPE)
    good &= entries["magic"] == MAGIC
    hits = np.flatnonzero(good)
    if not len(hits):
        return entries[:0], 0, 0
    last = int(hits[-1]) + 1
    return entries[: last][good[: last]], last - len(hits), last * ENTRY_BYTES


def iter_entries(entries: np.ndarray) -> Iterator[Entry]:
    """Entries as objects (tools and tests; the store works on the arrays)."""
    for e in entries:
        yield Entry(int(e["op"]), bytes(e["slab"]), int(e["slot"]), int(e["gen"]), int(e["stamp"]), bytes(e["name"]))


@dataclass(frozen=True)
class SlotRecord:
    """A record a namespace's journals say is live: where it lies and what it is called."""

    slab_path: str
    slot: int
    offset: int
    name: str
    stamp: int


def live_records(slab_dir: str) -> list[SlotRecord]:
    """Replay every journal under ``slab_dir`` with the rule the store applies (per slot, the
    newest generation decides; of two slots holding one name, the newer put, then the
    greater (slab id, slot)), reading only the files: what a restart would serve. For tools, the crash harness
    and tests; the store itself replays with numpy (slab_store.py)."""
    state: dict[tuple[bytes, int], Entry] = {}
    slot_bytes: dict[bytes, int] = {}
    try:
        names = sorted(os.listdir(slab_dir))
    except FileNotFoundError:
        return []
    for file_name in names:
        if not file_name.endswith(".journal"):
            continue
        with open(os.path.join(slab_dir, file_name), "rb") as f:
            entries, _, _ = decode(f.read())
        for e in iter_entries(entries):
            if e.op == HEADER:
                slot_bytes[e.slab] = e.slot
                continue
            if e.op not in (PUT, FREE):
                continue
            cur = state.get((e.slab, e.slot))
            if cur is None or e.gen > cur.gen or (e.gen == cur.gen and e.op == FREE):
                state[(e.slab, e.slot)] = e
    kept: dict[bytes, Entry] = {}
    for (sid, slot), e in state.items():
        if e.op != PUT or sid not in slot_bytes:
            continue
        other = kept.get(e.name)
        if other is None or (e.stamp, sid, slot) > (other.stamp, other.slab, other.slot):
            kept[e.name] = e
    return sorted((SlotRecord(os.path.join(slab_dir, e.slab.hex() + ".slab"), e.slot, e.slot * slot_bytes[e.slab],
                              e.name.hex(), e.stamp) for e in kept.values()), key=lambda r: (r.slab_path, r.slot))
