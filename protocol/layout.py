"""The engine's KV-cache layout: which tensors exist, how a block sits in each, and the
namespace fingerprint that keeps blocks of different meaning apart.

A *region* is one tensor of the paged cache (the key or value cache of one layer, or a
per-layer fp8 scale tensor). In FastDeploy's layout each tensor is
``[num_blocks, num_kv_heads, block_size, head_dim]``, so one block of one region is a
contiguous run of ``num_kv_heads * block_size * head_dim * itemsize`` bytes and consecutive
blocks sit ``block_bytes`` apart. A stored *record* is the chunks of one block from every
region, concatenated in region order (layer-major: ``k.0, v.0, [ks.0, vs.0,] k.1, ...``).

``packed_kv`` describes caches that keep K and V of a layer in one tensor with both inside
each block (vLLM's CPU cache: ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` per
layer, or any shape where one block of one layer is a single contiguous run of K and V). Such
a cache has one region per layer, ``kv.<layer>``, of ``2 * cache_block_bytes``: the record
holds each block's bytes as the engine laid them out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from .errors import InvalidLayout
from .limits import MAX_BLOCK_ID, MAX_REGIONS

#: Bytes per element of each supported cache dtype. ``uint8`` is an fp8 cache, which carries
#: per-layer scale tensors; ``float32`` is the cache of CPU engines without bf16 (vLLM-CPU picks
#: it on processors without AVX-512 BF16); ``float8_*`` are vLLM's fp8 caches, whose scales are
#: per-layer scalars of the model, not tensors of the cache, so they carry no scale regions.
DTYPE_SIZES: Final[dict[str, int]] = {
    "float16": 2,
    "bfloat16": 2,
    "uint8": 1,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
CACHE_DTYPES: Final = frozenset({"float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"})

#: Upper bounds of the layout's integers, so every size derived from them (a block's bytes, a
#: record's, a region's span) stays far inside 64 bits and can be answered in an error reply.
#: Block ids on the wire stop at MAX_BLOCK_ID, so a pool never needs more blocks than that.
#: Layers are bounded by the region count (MAX_REGIONS), checked before regions are built.
MAX_DIMENSION: Final = 2**20
MAX_FIELD: Final[dict[str, int]] = {"num_blocks": MAX_BLOCK_ID + 1, "num_layers": 2**63, "num_extra_layers": 2**63}

#: Bumped whenever the on-disk record layout changes; part of every namespace fingerprint, so
#: records of an older format are simply never found rather than misread.
RECORD_FORMAT: Final = 1

#: No integer an engine sends about its cache (a count, a size, an offset, a stride, a device)
#: reaches this: byte arithmetic on it stays inside int64, numpy's index type.
FIELD_INT_LIMIT: Final = 2**62


def require_int(name: str, value: Any, minimum: int = 0, maximum: int = FIELD_INT_LIMIT - 1) -> int:
    """``value`` if it is an integer (not a bool) in ``minimum..maximum`` (at most
    ``FIELD_INT_LIMIT-1``), else ``InvalidLayout`` naming the field. The one integer check for
    layout and registration fields (the layout's own, handles, regions, CUDA handles)."""
    maximum = min(maximum, FIELD_INT_LIMIT - 1)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise InvalidLayout(f"{name} must be an integer in {minimum}..{maximum}", field=name)
    return value


def int_field(entry: dict[str, Any], name: str, where: str, minimum: int = 0) -> int:
    """``entry[name]`` checked by :func:`require_int`, named ``<where>.<name>`` in the error."""
    return require_int(f"{where}.{name}", entry.get(name), minimum)


@dataclass(frozen=True)
class Region:
    """One tensor of the cache as the record sees it.

    ``record_offset`` is where this region's chunk starts inside a record's payload.
    """

    name: str
    block_bytes: int
    record_offset: int


@dataclass(frozen=True)
class CacheLayout:
    model_id: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1
    #: False for MLA, which caches a latent per token and has no value tensor.
    has_values: bool = True
    #: Element type of the fp8 scale tensors ``[num_blocks, num_kv_heads, block_size]``;
    #: used only when ``dtype == "uint8"``.
    scale_dtype: str = "float32"
    #: Cache layers beyond the model's own (speculative-decoding draft or MTP layers). They
    #: are stored like any other layer; counting them apart keeps the fingerprint honest.
    num_extra_layers: int = 0
    #: K and V of a layer packed in one tensor, both inside each block: one ``kv.<layer>``
    #: region per layer instead of ``k.<layer>`` and ``v.<layer>`` (see the module docstring).
    packed_kv: bool = False
    #: The order of the axes inside one block of a region, where the engine's differs from the
    #: order documented for its regions (e.g. ``NHC``: tokens, heads, channels, a GPU vLLM on
    #: FlashAttention, against the CPU engine's heads first). Records of two orders hold the
    #: same bytes in different places, so the order is part of the fingerprint; empty (the
    #: documented order) leaves fingerprints as they were before the field existed.
    block_order: str = ""
    regions: tuple[Region, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        object.__setattr__(self, "regions", tuple(self._build_regions()))

    # -- derived sizes -------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_extra_layers

    @property
    def has_scales(self) -> bool:
        return self.dtype == "uint8"

    @property
    def cache_block_bytes(self) -> int:
        """Bytes of one block in one key or value tensor."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def scale_block_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * DTYPE_SIZES[self.scale_dtype]

    @property
    def record_bytes(self) -> int:
        """Payload bytes of one stored block (all regions)."""
        return sum(r.block_bytes for r in self.regions)

    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def scale_shape(self) -> tuple[int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size)

    # -- identity --------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """32 hex digits naming everything that changes what a record's bytes mean.

        ``num_blocks`` is deliberately absent: resizing the engine's pool does not change a
        block's content, so records survive it.
        """
        meaning = {
            "record_format": RECORD_FORMAT,
            "model_id": self.model_id,
            "dtype": self.dtype,
            "scale_dtype": self.scale_dtype if self.has_scales else None,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_layers": self.num_layers,
            "num_extra_layers": self.num_extra_layers,
            "has_values": self.has_values,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "regions": [[r.name, r.block_bytes] for r in self.regions],
        }
        if self.block_order:
            meaning["block_order"] = self.block_order
        canonical = json.dumps(meaning, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()[:32]

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire.pop("regions", None)
        if not self.packed_kv:  # a daemon from before packed layouts still accepts the rest
            wire.pop("packed_kv")
        if not self.block_order:
            wire.pop("block_order")
        return wire

    @classmethod
    def from_wire(cls, payload: Any) -> "CacheLayout":
        if not isinstance(payload, dict):
            raise InvalidLayout("layout must be a map")
        known = {f for f in cls.__dataclass_fields__ if f != "regions"}
        unknown = set(payload) - known
        if unknown:
            raise InvalidLayout("unknown layout fields", fields=sorted(map(str, unknown)))
        try:
            return cls(**payload)
        except TypeError as exc:
            raise InvalidLayout(f"incomplete layout: {exc}") from None

    # -- internals -------------------------------------------------------------------------

    def _validate(self) -> None:
        def positive(name: str, value: Any, minimum: int = 1) -> None:
            require_int(name, value, minimum, MAX_FIELD.get(name, MAX_DIMENSION))

        if not isinstance(self.model_id, str) or not 0 < len(self.model_id) <= 256:
            raise InvalidLayout("model_id must be a non-empty string of at most 256 characters")
        if not isinstance(self.block_order, str) or len(self.block_order) > 16 or \
                not (self.block_order.isascii() and self.block_order.isalpha() or not self.block_order):
            raise InvalidLayout("block_order must be at most 16 ASCII letters", field="block_order")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            positive(name, getattr(self, name))
        positive("tp_rank", self.tp_rank, 0)
        positive("num_extra_layers", self.num_extra_layers, 0)
        if self.tp_rank >= self.tp_size:
            raise InvalidLayout("tp_rank must be below tp_size", field="tp_rank")
        if not isinstance(self.dtype, str) or self.dtype not in CACHE_DTYPES:
            raise InvalidLayout(f"dtype must be one of {sorted(CACHE_DTYPES)}", field="dtype")
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in DTYPE_SIZES:
            raise InvalidLayout(f"scale_dtype must be one of {sorted(DTYPE_SIZES)}", field="scale_dtype")
        if not isinstance(self.has_values, bool):
            raise InvalidLayout("has_values must be a boolean", field="has_values")
        if not isinstance(self.packed_kv, bool):
            raise InvalidLayout("packed_kv must be a boolean", field="packed_kv")
        if self.packed_kv and (not self.has_values or self.has_scales):
            # A packed block holds exactly K then V; keys-only (MLA) and fp8 scale tensors
            # have their own regions, which a packed layout does not describe.
            raise InvalidLayout("packed_kv needs has_values and a dtype without scale tensors", field="packed_kv")
        # Checked before the regions are built: a registration naming a billion layers would
        # otherwise spend minutes and gigabytes building them on the daemon's copy thread.
        count = self.total_layers * (1 if self.packed_kv else (2 if self.has_values else 1) * (2 if self.has_scales else 1))
        if count > MAX_REGIONS:
            raise InvalidLayout(f"the layout has {count} regions, the limit is {MAX_REGIONS}",
                                regions=count, limit=MAX_REGIONS)

    def _build_regions(self) -> list[Region]:
        names: list[tuple[str, int]] = []
        for layer in range(self.total_layers):
            if self.packed_kv:
                names.append((f"kv.{layer}", 2 * self.cache_block_bytes))
                continue
            names.append((f"k.{layer}", self.cache_block_bytes))
            if self.has_values:
                names.append((f"v.{layer}", self.cache_block_bytes))
            if self.has_scales:
                names.append((f"ks.{layer}", self.scale_block_bytes))
                if self.has_values:
                    names.append((f"vs.{layer}", self.scale_block_bytes))
        regions, offset = [], 0
        for name, size in names:
            regions.append(Region(name, size, offset))
            offset += size
        return regions
