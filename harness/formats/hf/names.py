"""Hugging Face spellings of canonical weight names (harness/formats/names.py) for the Llama family (Llama, Qwen2,
Mistral) and DeepSeek-V2/V3, which share them: `hf_name` and back, a routed expert's own tensor included."""

from __future__ import annotations

import re

from harness.formats.names import EXPERT_CANONICAL, LAYER_RE, expert_name, translate, translate_back

# canonical per-layer suffix -> Hugging Face per-layer suffix (Llama, Qwen2 and Mistral agree)
HF_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "q.weight": "self_attn.q_proj.weight",
    "k.weight": "self_attn.k_proj.weight",
    "v.weight": "self_attn.v_proj.weight",
    "q.bias": "self_attn.q_proj.bias",
    "k.bias": "self_attn.k_proj.bias",
    "v.bias": "self_attn.v_proj.bias",
    "o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "gate.weight": "mlp.gate_proj.weight",
    "up.weight": "mlp.up_proj.weight",
    "down.weight": "mlp.down_proj.weight",
    "q_a.weight": "self_attn.q_a_proj.weight",
    "q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "q_b.weight": "self_attn.q_b_proj.weight",
    "kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "kv_b.weight": "self_attn.kv_b_proj.weight",
    # DeepSeek-V2's MoE layers (one tensor per expert in the file: EXPERT_HF below)
    "router.weight": "mlp.gate.weight",
    "shared.gate.weight": "mlp.shared_experts.gate_proj.weight",
    "shared.up.weight": "mlp.shared_experts.up_proj.weight",
    "shared.down.weight": "mlp.shared_experts.down_proj.weight",
}
# one routed expert's tensor: canonical per-layer suffix experts.{e}.gate.weight <-> HF mlp.experts.{e}.gate_proj.weight
EXPERT_HF = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
HF_TOP_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_name(canonical: str) -> str:
    """Canonical name -> Hugging Face parameter name (a routed expert's own tensor: expert_name)."""
    match = LAYER_RE.fullmatch(canonical)
    expert = EXPERT_CANONICAL.fullmatch(match.group(2)) if match else None
    if match and expert:
        return f"model.layers.{match.group(1)}.mlp.experts.{expert.group(1)}.{expert.group(2)}_proj.weight"
    return translate(canonical, HF_TOP_NAMES, HF_LAYER_NAMES, "model.layers.")


def canonical_from_hf(name: str) -> str | None:
    """Hugging Face parameter name -> canonical name, or None when it is not one we know."""
    index, _, suffix = name.removeprefix("model.layers.").partition(".")
    expert = EXPERT_HF.fullmatch(suffix) if name.startswith("model.layers.") and index.isdigit() else None
    if expert:
        return f"layers.{int(index)}.{expert_name(int(expert.group(1)), expert.group(2))}"
    return translate_back(name, HF_TOP_NAMES, HF_LAYER_NAMES, "model.layers.")
