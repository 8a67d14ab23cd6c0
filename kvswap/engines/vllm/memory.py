"""vLLM's CPU KV cache in POSIX shared memory, and its registration with kvswapd.

vLLM (0.32) allocates the whole KV cache as one flat ``torch.zeros(n, dtype=int8)`` inside
the context manager a connector returns from ``get_mem_pool_context`` (Mooncake uses the same
hook on GPUs for its own pool), then views it per layer as ``[blocks, heads, N, C]``.
:class:`SharedKVAllocation` is that context manager for CPU engines: a torch function mode
that turns the one large CPU ``zeros`` into a tensor over a fresh shared-memory segment
(created zero-filled, mode 0600, see :mod:`kvswap.common.shm`). The engine then computes
in memory kvswapd maps by name: nothing is copied to register, and a load or save is one
``memmove`` per layer and block on the daemon's side.

:func:`build_registration` turns vLLM's per-layer views into a kvswap layout with one
``kv.<layer>`` region per layer (``packed_kv``: one block of one layer is a single contiguous
run of K and V in vLLM's CPU cache) at the view's byte offset and block stride, so any layout
vLLM picks (layer-outermost, block-outermost, padded pages) is described as it is.

Imports torch only inside functions: importing this module needs numpy alone.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

from kvswap.common.shm import SharedSegment
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import CacheLayout

#: Under vLLM's logger, so these lines land in the engine's log with its own.
log = logging.getLogger("vllm.kvswap")

#: Below this a CPU ``zeros`` is not the KV cache (vLLM makes small bookkeeping tensors in the
#: same context); the cache is at least a few blocks of every layer.
MIN_CACHE_BYTES = 1 << 20

#: torch's dtype names -> kvswap's. A float8 cache (vLLM's ``fp8_inc``) keeps its scales as
#: per-layer scalars in the model, so a block's bytes are all there is to move. vLLM's other
#: fp8 caches are ``torch.uint8`` tensors, refused: kvswap's ``uint8`` has scale regions.
TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


class SharedKVAllocation:
    """Context manager: the first large CPU ``torch.zeros`` made inside it is placed in shared
    memory. ``segment`` and ``tensor`` are set once that happened; the owner keeps both alive
    and calls :meth:`close` at shutdown (which unlinks the segment's name)."""

    def __init__(self, prefix: str = "kvswap-vllm") -> None:
        self.prefix = prefix
        self.segment: SharedSegment | None = None
        self.tensor: Any = None
        self._mode: Any = None

    def __enter__(self) -> SharedKVAllocation:
        self._mode = _allocation_mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)

    def place(self, nbytes: int) -> Any:
        """A zero-filled int8 CPU tensor of ``nbytes`` over a new shared-memory segment."""
        import torch

        segment = SharedSegment.create(nbytes, prefix=self.prefix)
        # frombuffer keeps the memoryview (and so the mapping) alive as long as the tensor.
        tensor = torch.frombuffer(segment.buffer, dtype=torch.int8, count=nbytes)
        self.segment, self.tensor = segment, tensor
        # The name goes at the latest when the engine process exits normally (a killed engine
        # leaves it in /dev/shm: docs/integration.md).
        weakref.finalize(self, segment.unlink)
        log.info("KV cache placed in shared memory %s (%d bytes)", segment.name, nbytes)
        return tensor

    def contains(self, tensor: Any) -> bool:
        if self.tensor is None:
            return False
        base = self.tensor.data_ptr()
        return base <= tensor.data_ptr() < base + self.tensor.numel()

    def close(self) -> None:
        """Unlink the segment's name. The mapping stays valid for the engine (its tensors) and
        for a daemon that has it mapped; the memory goes when the last of them unmaps."""
        if self.segment is not None:
            self.segment.unlink()


def _allocation_mode(owner: SharedKVAllocation) -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    class _PlaceInSharedMemory(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.zeros and owner.tensor is None:
                nbytes = _flat_int8_size(args, kwargs)
                if nbytes is not None and nbytes >= MIN_CACHE_BYTES:
                    return owner.place(nbytes)
            return func(*args, **kwargs)

    return _PlaceInSharedMemory()


def _flat_int8_size(args: tuple, kwargs: dict) -> int | None:
    """The size of ``zeros(n, dtype=int8[, device=cpu])``, the call vLLM makes for its cache;
    None for any other call (left alone)."""
    import torch

    if len(args) != 1 or not isinstance(args[0], int) or set(kwargs) - {"dtype", "device"}:
        return None
    if kwargs.get("dtype") is not torch.int8:
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    return args[0]


@dataclass(frozen=True)
class CacheFacts:
    """What the registration needs from vLLM's config."""

    model_id: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1


def build_registration(kv_caches: dict[str, Any], allocation: SharedKVAllocation, facts: CacheFacts) -> dict[str, Any]:
    """The ``register`` body for vLLM's per-layer cache views placed by ``allocation``.

    Each view is ``[blocks (or kernel blocks), heads, N, C]``. A manager block of one layer
    must be one contiguous run of ``2 * heads * block_size * head_dim`` elements (K and V);
    anything else raises :class:`InvalidLayout` (the connector then runs without offload).
    Layers that share one cache (vLLM's cross-layer KV sharing) are registered once.
    """
    if allocation.segment is None or allocation.tensor is None:
        raise InvalidLayout("the KV cache is not in shared memory: vLLM did not allocate it inside the "
                            "connector's get_mem_pool_context (a GPU engine, or a vLLM version that allocates "
                            "differently)")
    base = allocation.tensor.data_ptr()
    seen: set[tuple[int, tuple[int, ...]]] = set()
    regions: list[tuple[int, int]] = []
    dtype_name = None
    for name, view in kv_caches.items():
        if not allocation.contains(view):
            raise InvalidLayout(f"layer {name} is outside the shared-memory KV cache")
        identity = (view.data_ptr(), tuple(view.stride()))
        if identity in seen:
            continue
        seen.add(identity)
        dtype_name = _dtype_name(view, dtype_name)
        blocks = view if view.shape[0] == facts.num_blocks else view.unflatten(0, (facts.num_blocks, -1))
        if blocks.shape[0] != facts.num_blocks or not blocks[0].is_contiguous():
            raise InvalidLayout(f"layer {name}: one block is not contiguous (shape {tuple(view.shape)}, "
                                f"strides {tuple(view.stride())})")
        block_bytes = blocks[0].numel() * view.element_size()
        regions.append((view.data_ptr() - base, blocks.stride(0) * view.element_size()))
    if not regions:
        raise InvalidLayout("vLLM registered no KV cache layers")
    layout = CacheLayout(facts.model_id, num_layers=len(regions), num_blocks=facts.num_blocks,
                         block_size=facts.block_size, num_kv_heads=facts.num_kv_heads, head_dim=facts.head_dim,
                         dtype=dtype_name or "bfloat16", tp_rank=facts.tp_rank, tp_size=facts.tp_size,
                         packed_kv=True)
    expected = layout.regions[0].block_bytes
    if block_bytes != expected:
        raise InvalidLayout(f"a block of one layer is {block_bytes} bytes; {facts.num_kv_heads} heads x "
                            f"{facts.block_size} tokens x {facts.head_dim} x K and V make {expected}")
    assert allocation.segment is not None
    return {
        "layout": layout.to_wire(),
        "handles": [{"kind": "shm", "name": allocation.segment.name, "size": allocation.segment.size}],
        "regions": [{"name": r.name, "handle": 0, "offset": offset, "stride": stride}
                    for r, (offset, stride) in zip(layout.regions, regions)],
        "pid": os.getpid(),
    }


def _dtype_name(view: Any, previous: str | None) -> str:
    name = str(view.dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise InvalidLayout(f"KV cache dtype {name} is not supported by the connector ({', '.join(TORCH_DTYPES)})")
    if previous is not None and name != previous:
        raise InvalidLayout(f"layers mix KV cache dtypes {previous} and {name}")
    return name
