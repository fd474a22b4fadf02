"""KV bytes one token takes on a rank, counted from the attention's shape alone: the independent side of the pool
check (harness/compare/layout/capacity.py), never the planner's own sizing (layout.py)."""

from __future__ import annotations

from harness.partition.layout import AttentionShape


def token_bytes(shape: AttentionShape, kv_heads_held: int) -> int:
    """KV bytes one token takes on a rank holding `kv_heads_held` KV heads (MLA: the shared latent row)."""
    if shape.kv_lora_rank:
        return shape.layers * (shape.kv_lora_rank + shape.qk_rope_dim) * shape.dtype_bytes
    return 2 * shape.layers * kv_heads_held * shape.head_dim * shape.dtype_bytes
