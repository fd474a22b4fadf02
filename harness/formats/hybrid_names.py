"""Canonical weight names and shapes of a hybrid model (spec.hybrid set), per layer kind.

All layers: layers.{i}.attn_norm.weight [H], layers.{i}.mlp_norm.weight [H].
Linear-attention layers (Gated DeltaNet):
  lin_qkv.weight [C, H] (packed q | k | v rows, C = 2 k_heads Dk + v_heads Dv), lin_conv.weight [C, K],
  lin_z.weight [v_heads Dv, H] (output gate), lin_b.weight / lin_a.weight [v_heads, H] (beta, decay),
  lin_A_log / lin_dt_bias [v_heads], lin_norm.weight [Dv], lin_out.weight [H, v_heads Dv].
Full-attention layers: q.weight [heads (1 + gate) hd, H] (per head: q rows, then gate rows), k.weight,
  v.weight [kv hd, H], o.weight [H, heads hd]; with qk_norm also q_norm.weight / k_norm.weight [hd] (per-head
  RMSNorm of q and k before RoPE).
FFN: with experts, router.weight [E, H], experts.gate.weight / experts.up.weight [E, F, H],
  experts.down.weight [E, H, F], shared.gate.weight / shared.up.weight [Fs, H], shared.down.weight [H, Fs];
  without, the dense gate/up/down of harness/formats/names.py.
"""

from __future__ import annotations

from harness.partition.hybrid_layout import FULL, HybridShape, MoeShape, layer_kinds
from harness.specs.model import ModelSpec

Shape = tuple[int, ...]

# synthetic init scale per name suffix where the model's init_std does not fit (the conv sums K taps
# of a normalized input: unit-scale taps keep its output at the input's scale)
SYNTHETIC_STD: dict[str, float] = {"lin_conv.weight": 0.5, "lin_A_log": 0.5, "lin_dt_bias": 0.5}


def hybrid_layer_shapes(spec: ModelSpec, h: HybridShape, kind: str) -> dict[str, Shape]:
    """Per-layer canonical suffix -> shape for a layer of `kind` (linear or full)."""
    H = spec.hidden
    shapes: dict[str, Shape] = {"attn_norm.weight": (H,), "mlp_norm.weight": (H,)}
    if kind == FULL:
        q_rows = spec.heads * spec.head_dim * (2 if h.attn_output_gate else 1)
        kv_rows = spec.kv_heads * spec.head_dim
        shapes.update({"q.weight": (q_rows, H), "k.weight": (kv_rows, H), "v.weight": (kv_rows, H),
                       "o.weight": (H, spec.heads * spec.head_dim)})
        if h.qk_norm:
            shapes.update({"q_norm.weight": (spec.head_dim,), "k_norm.weight": (spec.head_dim,)})
    else:
        C, vd = h.conv_channels, h.linear_v_heads * h.linear_v_dim
        shapes.update({"lin_qkv.weight": (C, H), "lin_conv.weight": (C, h.conv_kernel), "lin_z.weight": (vd, H),
                       "lin_b.weight": (h.linear_v_heads, H), "lin_a.weight": (h.linear_v_heads, H),
                       "lin_A_log": (h.linear_v_heads,), "lin_dt_bias": (h.linear_v_heads,),
                       "lin_norm.weight": (h.linear_v_dim,), "lin_out.weight": (H, vd)})
    if h.experts:
        shapes.update(expert_shapes(H, h))
    else:
        shapes.update({"gate.weight": (spec.ffn, H), "up.weight": (spec.ffn, H), "down.weight": (H, spec.ffn)})
    return shapes


def expert_shapes(hidden: int, h: HybridShape | MoeShape) -> dict[str, Shape]:
    """Per-layer canonical suffix -> shape of an MoE layer's router, routed experts and shared expert."""
    shapes: dict[str, Shape] = {
        "router.weight": (h.experts, hidden), "experts.gate.weight": (h.experts, h.moe_ffn, hidden),
        "experts.up.weight": (h.experts, h.moe_ffn, hidden), "experts.down.weight": (h.experts, hidden, h.moe_ffn)}
    if h.shared_ffn:
        shapes.update({"shared.gate.weight": (h.shared_ffn, hidden), "shared.up.weight": (h.shared_ffn, hidden),
                       "shared.down.weight": (hidden, h.shared_ffn)})
    return shapes


def hybrid_shapes(spec: ModelSpec, h: HybridShape) -> dict[str, Shape]:
    """Every canonical tensor of a hybrid model -> its shape."""
    shapes: dict[str, Shape] = {"embed.weight": (spec.vocab, spec.hidden)}
    for i, kind in enumerate(layer_kinds(spec.layers, h.full_attention_interval)):
        shapes.update({f"layers.{i}.{s}": shape for s, shape in hybrid_layer_shapes(spec, h, kind).items()})
    shapes["norm.weight"] = (spec.hidden,)
    if not spec.tied_embeddings:
        shapes["lm_head.weight"] = (spec.vocab, spec.hidden)
    return shapes


def synthetic_std(name: str) -> float | None:
    """The init scale of a hybrid tensor that does not take the model's init_std, else None."""
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    return SYNTHETIC_STD.get(suffix)
