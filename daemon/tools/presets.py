"""Realistic cache layouts for the demo and the bench.

The dimensions are those of the model class named; the bench only needs the bytes per block
and the region count to be right, not the weights.
"""

from __future__ import annotations

from kvswap.protocol.layout import CacheLayout

#: name -> (description, layout keyword arguments other than num_blocks)
PRESETS: dict[str, tuple[str, dict]] = {
    "small": ("ERNIE-4.5-0.3B class: 18 layers, 2 KV heads, head_dim 128, 64-token blocks, bf16 (1.1 MiB/block)",
              dict(model_id="ernie-4.5-0.3b", num_layers=18, block_size=64, num_kv_heads=2, head_dim=128,
                   dtype="bfloat16")),
    "8b": ("Llama-3-8B class: 32 layers, 8 KV heads, head_dim 128, 64-token blocks, bf16 (8 MiB/block)",
           dict(model_id="llama-3-8b", num_layers=32, block_size=64, num_kv_heads=8, head_dim=128, dtype="bfloat16")),
    "8b-16": ("Llama-3-8B class with vLLM's default 16-token blocks: 32 layers, 8 KV heads, head_dim 128, bf16 "
              "(2 MiB/block)",
              dict(model_id="llama-3-8b", num_layers=32, block_size=16, num_kv_heads=8, head_dim=128,
                   dtype="bfloat16")),
    "tiny": ("A toy layout for smoke tests: 2 layers, 1 KV head, head_dim 64, 16-token blocks (8 KiB/block)",
             dict(model_id="tiny", num_layers=2, block_size=16, num_kv_heads=1, head_dim=64, dtype="bfloat16")),
}


def preset_layout(name: str, num_blocks: int) -> CacheLayout:
    try:
        _, kwargs = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
    return CacheLayout(num_blocks=num_blocks, **kwargs)
