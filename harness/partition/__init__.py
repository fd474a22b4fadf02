"""Pure partition math: heads, KV heads, DCP token placement, vocab/FFN shards, pool capacity (layout), MLA Q
weights (mla_layout), linear attention, MoE and cache groups (hybrid_layout)."""
