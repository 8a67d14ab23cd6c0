"""A CPU engine's paged KV cache in POSIX shared memory, for CPU engines, tests and the demo.

``keys[l]`` and ``values[l]`` are numpy arrays shaped ``[num_blocks, num_kv_heads, block_size,
head_dim]`` (FastDeploy's layout); fp8 (``uint8``) caches add ``key_scales[l]`` and
``value_scales[l]`` shaped ``[num_blocks, num_kv_heads, block_size]``. numpy has no bfloat16,
so bfloat16 tensors are ``uint16`` arrays holding the same bits.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kvswap.common.shm import SharedSegment
from kvswap.common.units import round_up_to_page

from .layout import CacheLayout

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "uint8": np.uint8, "float32": np.float32,
                "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def _align(n: int) -> int:
    """Tensors start on page boundaries, as a GPU allocator would place them."""
    return round_up_to_page(n)


class HostKVCache:
    def __init__(self, layout: CacheLayout, segment: SharedSegment) -> None:
        self.layout = layout
        self.segment = segment
        self._offsets: dict[str, int] = {}
        self.arrays: dict[str, np.ndarray] = {}
        offset = 0
        for region in layout.regions:
            is_scale = region.name.startswith(("ks.", "vs."))
            shape = layout.scale_shape() if is_scale else layout.tensor_shape()
            dtype = NUMPY_DTYPES[layout.scale_dtype if is_scale else layout.dtype]
            nbytes = layout.num_blocks * region.block_bytes
            self._offsets[region.name] = offset
            self.arrays[region.name] = np.frombuffer(segment.buffer, dtype=dtype, count=nbytes // np.dtype(dtype).itemsize,
                                                     offset=offset).reshape(shape)
            offset = _align(offset + nbytes)
        n = layout.total_layers
        self.keys = [self.arrays[f"k.{i}"] for i in range(n)]
        self.values = [self.arrays[f"v.{i}"] for i in range(n)] if layout.has_values else []
        self.key_scales = [self.arrays[f"ks.{i}"] for i in range(n)] if layout.has_scales else []
        self.value_scales = (
            [self.arrays[f"vs.{i}"] for i in range(n)] if layout.has_scales and layout.has_values else []
        )

    @staticmethod
    def segment_bytes(layout: CacheLayout) -> int:
        return sum(_align(layout.num_blocks * r.block_bytes) for r in layout.regions)

    @classmethod
    def create(cls, layout: CacheLayout) -> "HostKVCache":
        return cls(layout, SharedSegment.create(cls.segment_bytes(layout)))

    # -- what the daemon needs --------------------------------------------------------------

    def registration(self) -> dict[str, Any]:
        """The body of a ``register`` request for this cache."""
        return {
            "layout": self.layout.to_wire(),
            "handles": [{"kind": "shm", "name": self.segment.name, "size": self.segment.size}],
            "regions": [
                {"name": r.name, "handle": 0, "offset": self._offsets[r.name], "stride": r.block_bytes}
                for r in self.layout.regions
            ],
            "pid": os.getpid(),
        }

    # -- helpers for engines that test themselves ------------------------------------------

    def fill_random(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        for arr in self.arrays.values():
            raw = arr.view(np.uint8).reshape(-1)
            raw[:] = rng.integers(0, 256, size=raw.size, dtype=np.uint8)

    def block_record(self, block_id: int) -> bytes:
        """The record payload of one block: every region's chunk in region order."""
        return b"".join(self.arrays[r.name][block_id].tobytes() for r in self.layout.regions)

    def zero_blocks(self, block_ids: list[int]) -> None:
        for arr in self.arrays.values():
            arr[block_ids] = 0

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, unlink: bool = True) -> None:
        self.arrays.clear()
        self.keys, self.values, self.key_scales, self.value_scales = [], [], [], []
        self.segment.close()
        if unlink and self.segment.owner:
            self.segment.unlink()

    def __enter__(self) -> "HostKVCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
