"""KV events on the wire: what kvswapd publishes so a cache-aware router knows what each tier
holds, in vLLM's format (``vllm/distributed/kv_events.py``), encoded here without vLLM.

A message is three ZMQ frames ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian batch
number (0 for the first batch of a daemon's life), ``payload`` a msgpack ``EventBatch``
``[ts, events]`` (``[ts, events, data_parallel_rank]`` when a rank is set). Each event is
tagged with its type; two encodings are written:

- ``map`` (the default; what vLLM 0.32's ``KVEventBatch`` decoder reads): each event is a map
  ``{"type": "BlockStored", "block_hashes": [...], ...}`` whose optional fields are left out
  at their default (None), as msgspec does;
- ``array`` (the tagged-array form of earlier vLLM releases): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``; ``locality`` and
  ``ownership`` are not in this form (their position differs between releases).

Replay (a ROUTER socket): a subscriber sends ``[b"", start_seq]`` (an 8-byte big-endian
number) from a DEALER or REQ socket and gets ``[b"", topic, seq, payload]`` for every buffered
batch from ``start_seq`` on, then ``[b"", b"", END_SEQ, b""]``.

:class:`BlockMeta` is what an engine may send with each key of a ``swap_out`` (the
``block_meta`` field) so the events name the block as the engine's own events do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Iterable, Sequence, Union

import msgpack

from .errors import BadRequest

#: vLLM's media: the RAM tier is ``CPU``; the file and remote tiers are ``STORAGE``, told
#: apart by ``locality`` (``LOCAL``/``REMOTE``) and ``ownership`` (the kvswap tier).
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
ENCODINGS: Final = ("map", "array")
#: The replay's end marker: sequence number -1.
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)

#: Bounds on one key's metadata in a swap_out (a record covers at most this many engine
#: blocks, and their tokens).
MAX_HASHES_PER_KEY: Final = 64
MAX_TOKENS_PER_KEY: Final = 8192
MAX_HASH_BYTES: Final = 64

#: What vLLM calls an ExternalBlockHash: sha256 bytes, or an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
BlockHash = Union[bytes, int]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """The engine's view of one record: its block hashes (one per engine block the record
    covers, in order), the hash of the block before the first, the tokens, the engine's
    block size and LoRA."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"block_hashes": list(self.block_hashes)}
        if self.parent_block_hash is not None:
            out["parent_block_hash"] = self.parent_block_hash
        if self.token_ids:
            out["token_ids"] = list(self.token_ids)
        if self.block_size:
            out["block_size"] = self.block_size
        if self.lora_name is not None:
            out["lora_name"] = self.lora_name
        return out

    @classmethod
    def from_wire(cls, value: Any, index: int) -> "BlockMeta":
        """Check one key's metadata; raises :class:`BadRequest` naming the key's index."""
        where = f"block_meta[{index}]"
        if not isinstance(value, dict):
            raise BadRequest(f"{where} must be a map or nil", field="block_meta", index=index)
        unknown = set(value) - _META_FIELDS
        if unknown:
            raise BadRequest(f"{where} has unknown fields", field="block_meta", index=index,
                             fields=sorted(str(u)[:32] for u in unknown)[:8])
        hashes = value.get("block_hashes")
        if not isinstance(hashes, list) or not 1 <= len(hashes) <= MAX_HASHES_PER_KEY:
            raise BadRequest(f"{where}.block_hashes must be a list of 1..{MAX_HASHES_PER_KEY} hashes",
                             field="block_meta", index=index)
        parent = value.get("parent_block_hash")
        tokens = value.get("token_ids", [])
        if not isinstance(tokens, list) or len(tokens) > MAX_TOKENS_PER_KEY or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
            raise BadRequest(f"{where}.token_ids must be a list of at most {MAX_TOKENS_PER_KEY} token ids",
                             field="block_meta", index=index)
        block_size = value.get("block_size", 0)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 <= block_size <= 65_536:
            raise BadRequest(f"{where}.block_size must be an integer in 0..65536", field="block_meta", index=index)
        lora = value.get("lora_name")
        if lora is not None and (not isinstance(lora, str) or len(lora) > 256):
            raise BadRequest(f"{where}.lora_name must be a string of at most 256 characters or nil",
                             field="block_meta", index=index)
        return cls(tuple(_hash(h, where) for h in hashes), None if parent is None else _hash(parent, where),
                   tuple(tokens), block_size, lora)


_META_FIELDS: Final = frozenset({"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name"})


def _hash(value: Any, where: str) -> BlockHash:
    if isinstance(value, bytes) and 1 <= len(value) <= MAX_HASH_BYTES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        return value
    raise BadRequest(f"{where}: a block hash is 1..{MAX_HASH_BYTES} bytes or an unsigned 64-bit integer",
                     field="block_meta")


# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None
    locality: str | None = None
    ownership: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def _event_to_wire(event: Event, encoding: str) -> Any:
    if isinstance(event, BlockStored):
        if encoding == "array":
            return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                    event.block_size, None, event.medium, event.lora_name]
        out: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                               "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                               "block_size": event.block_size, "lora_id": None, "medium": event.medium,
                               "lora_name": event.lora_name}
        _optional(out, event.locality, event.ownership)
        return out
    if isinstance(event, BlockRemoved):
        if encoding == "array":
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
        _optional(out, event.locality, event.ownership)
        return out
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def _optional(out: dict[str, Any], locality: str | None, ownership: str | None) -> None:
    # msgspec leaves fields at their default out of the map (omit_defaults).
    if locality is not None:
        out["locality"] = locality
    if ownership is not None:
        out["ownership"] = ownership


def encode_batch(ts: float, events: Iterable[Event], encoding: str = "map", rank: int | None = None) -> bytes:
    """One ``EventBatch`` payload."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    batch: list[Any] = [ts, [_event_to_wire(e, encoding) for e in events]]
    if rank is not None:
        batch.append(rank)
    return msgpack.packb(batch, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """A payload of either encoding back into events (for subscribers and tests). Raises
    ``ValueError`` for anything that is not an event batch."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for bad input
        raise ValueError(f"not a msgpack event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3) or not isinstance(batch[1], list):
        raise ValueError("an event batch is [ts, events] or [ts, events, rank]")
    rank = batch[2] if len(batch) == 3 else None
    try:
        return float(batch[0]), [_event_from_wire(raw) for raw in batch[1]], rank
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"malformed KV event: {exc!r}") from None


def _event_from_wire(raw: Any) -> Event:
    if isinstance(raw, list) and raw:
        tag, fields = raw[0], raw[1:]
        if tag == "BlockStored" and len(fields) >= 7:
            return BlockStored(tuple(fields[0]), fields[1], tuple(fields[2]), fields[3], fields[5], lora_name=fields[6])
        if tag == "BlockRemoved" and len(fields) >= 2:
            return BlockRemoved(tuple(fields[0]), fields[1])
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if tag == "BlockStored":
            return BlockStored(tuple(raw["block_hashes"]), raw.get("parent_block_hash"), tuple(raw.get("token_ids", ())),
                               raw.get("block_size", 0), raw.get("medium"), raw.get("locality"), raw.get("ownership"),
                               raw.get("lora_name"))
        if tag == "BlockRemoved":
            return BlockRemoved(tuple(raw["block_hashes"]), raw.get("medium"), raw.get("locality"), raw.get("ownership"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    raise ValueError(f"not a KV event: {str(raw)[:80]}")


def metas_from_wire(value: Any, keys: Sequence[str]) -> tuple[BlockMeta | None, ...]:
    """A swap_out's ``block_meta``: one entry (a map, or nil) per key."""
    if not isinstance(value, list) or len(value) != len(keys):
        raise BadRequest("block_meta must be a list with one entry (a map or nil) per key", field="block_meta",
                         keys=len(keys), entries=len(value) if isinstance(value, list) else None)
    return tuple(None if v is None else BlockMeta.from_wire(v, i) for i, v in enumerate(value))
