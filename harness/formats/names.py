"""Canonical weight names and shapes, and their spellings in Hugging Face and GGUF checkpoints.

Canonical names (all weights are [out, in] like torch.nn.Linear):
  embed.weight [V, H]; norm.weight [H]; lm_head.weight [V, H] (only when not tied);
  layers.{i}.attn_norm.weight [H]; layers.{i}.q.weight [heads*hd, H]; layers.{i}.k.weight / v.weight [kv*hd, H];
  layers.{i}.q.bias / k.bias / v.bias (only with qkv_bias); layers.{i}.o.weight [H, heads*hd];
  layers.{i}.mlp_norm.weight [H]; layers.{i}.gate.weight / up.weight [ffn, H]; layers.{i}.down.weight [H, ffn].
MLA models (kv_lora_rank > 0; qk = qk_nope_dim + qk_rope_dim, v = head_dim) replace q/k/v with
  layers.{i}.q_a.weight [q_lora, H] and q_a_norm.weight [q_lora] (with a Q LoRA), then q_b.weight
  [heads*qk, q_lora], or q.weight [heads*qk, H] without; layers.{i}.kv_a.weight [kv_lora + qk_rope_dim, H];
  kv_a_norm.weight [kv_lora]; kv_b.weight [heads*(qk_nope_dim + v), kv_lora]; o.weight [H, heads*v]. With
  experts (spec.moe) the layers from first_dense on replace gate/up/down with the MoE tensors of
  harness/formats/hybrid_names.py (router, experts.* stacked [E, ...], shared.*); a Hugging Face folder holds
  each expert apart (mlp.experts.{e}.gate_proj.weight: `expert_name`, harness/formats/checkpoint.py stacks them).
Sparse-attention models add the indexer to the dense layer: layers.{i}.index_q.weight [index_heads*d, H],
  index_k.weight [d, H] (one key per token), index_w.weight [index_heads, H] (d = index_head_dim).
"""

from __future__ import annotations

import re
from typing import Callable

from harness.arch.model import Model, model_of
from harness.formats.hybrid_names import expert_shapes, hybrid_shapes
from harness.specs.model import ModelSpec

Shape = tuple[int, ...]

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
EXPERT_CANONICAL = re.compile(r"experts\.(\d+)\.(gate|up|down)\.weight")
EXPERT_HF = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def expert_name(expert: int, part: str) -> str:
    """The canonical per-layer suffix of routed expert `expert`'s `part` (gate, up or down) as a file holds it."""
    return f"experts.{expert}.{part}.weight"
HF_TOP_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}

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

_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def mla_attention_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """Per-layer canonical suffix -> shape of an MLA model's attention weights."""
    qk, h = spec.qk_nope_dim + spec.qk_rope_dim, spec.hidden
    shapes: dict[str, Shape] = (
        {"q_a.weight": (spec.q_lora_rank, h), "q_a_norm.weight": (spec.q_lora_rank,),
         "q_b.weight": (spec.heads * qk, spec.q_lora_rank)} if spec.q_lora_rank else {"q.weight": (spec.heads * qk, h)})
    shapes.update({"kv_a.weight": (spec.kv_lora_rank + spec.qk_rope_dim, h), "kv_a_norm.weight": (spec.kv_lora_rank,),
                   "kv_b.weight": (spec.heads * (spec.qk_nope_dim + spec.head_dim), spec.kv_lora_rank),
                   "o.weight": (h, spec.heads * spec.head_dim)})
    return shapes


def mla_layer_shapes(spec: ModelSpec, layer: int = 0) -> dict[str, Shape]:
    """Per-layer canonical suffix -> shape of layer `layer` of an MLA model (a dense FFN, or from
    moe.first_dense on the experts)."""
    shapes: dict[str, Shape] = {"attn_norm.weight": (spec.hidden,), **mla_attention_shapes(spec),
                                "mlp_norm.weight": (spec.hidden,)}
    if spec.moe is not None and layer >= spec.moe.first_dense:
        return {**shapes, **expert_shapes(spec.hidden, spec.moe)}
    return {**shapes, "gate.weight": (spec.ffn, spec.hidden), "up.weight": (spec.ffn, spec.hidden),
            "down.weight": (spec.hidden, spec.ffn)}


def indexer_shapes(model: Model) -> dict[str, Shape]:
    """Per-layer canonical suffix -> shape of a sparse-attention model's indexer (harness/engine/layers/sparse.py)."""
    shape, hidden = model.sparse_shape(), model.spec.hidden
    d = shape.index_head_dim
    return {"index_q.weight": (shape.index_heads * d, hidden), "index_k.weight": (d, hidden),
            "index_w.weight": (shape.index_heads, hidden)}


def layer_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """Per-layer canonical suffix -> shape of a dense/GQA model."""
    q_out, kv_out = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    shapes: dict[str, Shape] = {
        "attn_norm.weight": (spec.hidden,),
        "q.weight": (q_out, spec.hidden),
        "k.weight": (kv_out, spec.hidden),
        "v.weight": (kv_out, spec.hidden),
        "o.weight": (spec.hidden, q_out),
        "mlp_norm.weight": (spec.hidden,),
        "gate.weight": (spec.ffn, spec.hidden),
        "up.weight": (spec.ffn, spec.hidden),
        "down.weight": (spec.hidden, spec.ffn),
    }
    if spec.qkv_bias:
        shapes.update({"q.bias": (q_out,), "k.bias": (kv_out,), "v.bias": (kv_out,)})
    return shapes


def expected_shapes(spec: ModelSpec) -> dict[str, Shape]:
    """Every canonical tensor name the spec calls for -> its shape (by the engine module of its attention)."""
    model = model_of(spec)
    return MODEL_SHAPES[model.attention.engine_module](model)


def stacked_shapes(spec: ModelSpec,
                   per_layer: dict[str, Shape] | Callable[[int], dict[str, Shape]]) -> dict[str, Shape]:
    """Embedding, `per_layer` in every layer (or per_layer(i) in layer i), final norm and (untied) lm_head."""
    shapes: dict[str, Shape] = {"embed.weight": (spec.vocab, spec.hidden)}
    for i in range(spec.layers):
        layer = per_layer(i) if callable(per_layer) else per_layer
        shapes.update({f"layers.{i}.{suffix}": shape for suffix, shape in layer.items()})
    shapes["norm.weight"] = (spec.hidden,)
    if not spec.tied_embeddings:
        shapes["lm_head.weight"] = (spec.vocab, spec.hidden)
    return shapes


# the weight shapes of each engine module an attention component names (harness/arch/components.py)
MODEL_SHAPES: dict[str, Callable[[Model], dict[str, Shape]]] = {
    "harness.engine.layers.dense": lambda m: stacked_shapes(m.spec, layer_shapes(m.spec)),
    "harness.engine.layers.mla": lambda m: stacked_shapes(m.spec, lambda i: mla_layer_shapes(m.spec, i)),
    "harness.engine.layers.hybrid": lambda m: hybrid_shapes(m.spec, m.hybrid_shape()),
    "harness.engine.layers.sparse": lambda m: stacked_shapes(m.spec, {**layer_shapes(m.spec), **indexer_shapes(m)}),
}


def _translate(name: str, top: dict[str, str], layer: dict[str, str], layer_prefix: str) -> str:
    match = _LAYER_RE.fullmatch(name)
    if match:
        return f"{layer_prefix}{match.group(1)}.{layer[match.group(2)]}"
    return top[name]


def _translate_back(name: str, top: dict[str, str], layer: dict[str, str], layer_prefix: str) -> str | None:
    inverse_top = {v: k for k, v in top.items()}
    if name in inverse_top:
        return inverse_top[name]
    if not name.startswith(layer_prefix):
        return None
    index, _, suffix = name[len(layer_prefix):].partition(".")
    inverse_layer = {v: k for k, v in layer.items()}
    if not index.isdigit() or suffix not in inverse_layer:
        return None
    return f"layers.{int(index)}.{inverse_layer[suffix]}"


def hf_name(canonical: str) -> str:
    """Canonical name -> Hugging Face parameter name (a routed expert's own tensor: expert_name)."""
    match = _LAYER_RE.fullmatch(canonical)
    expert = EXPERT_CANONICAL.fullmatch(match.group(2)) if match else None
    if match and expert:
        return f"model.layers.{match.group(1)}.mlp.experts.{expert.group(1)}.{expert.group(2)}_proj.weight"
    return _translate(canonical, HF_TOP_NAMES, HF_LAYER_NAMES, "model.layers.")


def canonical_from_hf(name: str) -> str | None:
    """Hugging Face parameter name -> canonical name, or None when it is not one we know."""
    index, _, suffix = name.removeprefix("model.layers.").partition(".")
    expert = EXPERT_HF.fullmatch(suffix) if name.startswith("model.layers.") and index.isdigit() else None
    if expert:
        return f"layers.{int(index)}.{expert_name(int(expert.group(1)), expert.group(2))}"
    return _translate_back(name, HF_TOP_NAMES, HF_LAYER_NAMES, "model.layers.")


def gguf_name(canonical: str) -> str:
    """Canonical name -> GGUF tensor name."""
    return _translate(canonical, GGUF_TOP_NAMES, GGUF_LAYER_NAMES, "blk.")


def canonical_from_gguf(name: str) -> str | None:
    """GGUF tensor name -> canonical name, or None when it is not one we know."""
    return _translate_back(name, GGUF_TOP_NAMES, GGUF_LAYER_NAMES, "blk.")
