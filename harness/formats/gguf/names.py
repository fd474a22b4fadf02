"""GGUF spellings of canonical weight names (llama.cpp's llama and qwen2 architectures)."""

from __future__ import annotations

from harness.formats.names import translate, translate_back

# canonical per-layer suffix -> GGUF per-layer suffix (llama.cpp's llama and qwen2 architectures)
GGUF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "attn_norm.weight",
    "q.weight": "attn_q.weight",
    "k.weight": "attn_k.weight",
    "v.weight": "attn_v.weight",
    "q.bias": "attn_q.bias",
    "k.bias": "attn_k.bias",
    "v.bias": "attn_v.bias",
    "o.weight": "attn_output.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "gate.weight": "ffn_gate.weight",
    "up.weight": "ffn_up.weight",
    "down.weight": "ffn_down.weight",
}
GGUF_TOP_NAMES: dict[str, str] = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(canonical: str) -> str:
    """Canonical name -> GGUF tensor name."""
    return translate(canonical, GGUF_TOP_NAMES, GGUF_LAYER_NAMES, "blk.")


def canonical_from_gguf(name: str) -> str | None:
    """GGUF tensor name -> canonical name, or None when it is not one we know."""
    return translate_back(name, GGUF_TOP_NAMES, GGUF_LAYER_NAMES, "blk.")
