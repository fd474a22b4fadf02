"""Canonical weight names and shapes (every checkpoint format maps its own spellings to these: harness/formats/hf/,
harness/formats/gguf/), and the check of a checkpoint's shapes against them.

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
  each expert apart (mlp.experts.{e}.gate_proj.weight: `expert_name`, harness/formats/hf/deepseek.py stacks them).
Sparse-attention models add the indexer to the dense layer: layers.{i}.index_q.weight [index_heads*d, H],
  index_k.weight [d, H] (one key per token), index_w.weight [index_heads, H] (d = index_head_dim).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Mapping

from harness.arch.model import Model, model_of
from harness.core.errors import ConfigError
from harness.formats.hybrid_names import expert_shapes, hybrid_shapes
from harness.specs.model import ModelSpec

Shape = tuple[int, ...]

# one routed expert's tensor: canonical per-layer suffix experts.{e}.gate.weight <-> HF mlp.experts.{e}.gate_proj.weight
EXPERT_CANONICAL = re.compile(r"experts\.(\d+)\.(gate|up|down)\.weight")


def expert_name(expert: int, part: str) -> str:
    """The canonical per-layer suffix of routed expert `expert`'s `part` (gate, up or down) as a file holds it."""
    return f"experts.{expert}.{part}.weight"

LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


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


def translate(name: str, top: dict[str, str], layer: dict[str, str], layer_prefix: str) -> str:
    """Canonical name -> a format's name, from its top-level and per-layer suffix tables."""
    match = LAYER_RE.fullmatch(name)
    if match:
        return f"{layer_prefix}{match.group(1)}.{layer[match.group(2)]}"
    return top[name]


def translate_back(name: str, top: dict[str, str], layer: dict[str, str], layer_prefix: str) -> str | None:
    """A format's name -> canonical name, or None when the tables do not know it."""
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


def check_weights(spec: ModelSpec, weights: Mapping[str, Any], path: Path) -> None:
    """One ConfigError naming the checkpoint when a tensor is missing, unexpected or of the wrong shape."""
    check_shapes(spec, {name: tuple(t.shape) for name, t in weights.items()}, path)


def check_shapes(spec: ModelSpec, shapes: dict[str, Shape], path: Path) -> None:
    """One ConfigError naming the checkpoint when a tensor is missing, unexpected or of the wrong shape."""
    expected = expected_shapes(spec)
    weights = shapes
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ConfigError(f"checkpoint {path}: missing tensor {missing[0]!r} "
                          f"({len(missing)} missing in all) for model {spec.name!r}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ConfigError(f"checkpoint {path}: unexpected tensor {unexpected[0]!r} for model {spec.name!r} "
                          f"(qkv_bias={spec.qkv_bias}, tied_embeddings={spec.tied_embeddings})")
    for name, shape in expected.items():
        if tuple(weights[name]) != shape:
            raise shape_error(spec, name, tuple(weights[name]), path)


def shape_error(spec: ModelSpec, name: str, shape: Shape, path: Path) -> ConfigError:
    """The error for canonical tensor `name` found with a shape that `spec` does not call for."""
    return ConfigError(f"checkpoint {path}: tensor {name!r} has shape {tuple(shape)}, "
                       f"model {spec.name!r} expects {expected_shapes(spec).get(name)}")
