"""A hybrid model's canonical weights as a Qwen3-Next checkpoint (Qwen3NextForCausalLM) and back.

Qwen3-Next computes what the embedded hybrid decoder (harness/engine/layers/hybrid.py) computes, with these
differences of form, each converted exactly here (the file holds the canonical values in the model's dtype):

- Its RMSNorms scale by (1 + w) (input_layernorm, post_attention_layernorm, model.norm, the attention's
  q_norm / k_norm): the file holds w - 1, the weight rounded to the model's dtype first (w - 1 is then exact
  for w in [0.5, 2]); the gated norm of the linear attention (linear_attn.norm) scales by w itself.
- Its linear attention packs q | k | v | z per K head (in_proj_qkvz: for each K head its q and k rows, then the
  v and z rows of the V heads reading it) and b | a the same way (in_proj_ba); the canonical weights keep
  q | k | v of all heads in lin_qkv (the conv's channel order, which Qwen3-Next's conv1d shares) and z, b, a
  apart.
- Its shared expert's output is scaled by sigmoid(shared_expert_gate . h), which the embedded engine does not
  have: the file holds a zero gate (sigmoid 0 = 1/2 exactly) and the shared expert's down projection times 2
  (exact), so the product is the canonical shared expert. A checkpoint with a nonzero gate is refused on load.
- Experts are one tensor per expert (mlp.experts.{e}.gate_proj / up_proj / down_proj), the router mlp.gate.
- RoPE covers the whole head (partial_rotary_factor 1.0), rotate-half as in the harness.

The gated attention's q_proj rows are per head [q rows, gate rows] in both. MTP layers are not written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.hf.adapter import HFAdapter
from harness.formats.hf.config import config_value
from harness.formats.hf.deepseek import rope_gaps
from harness.formats.hf.files import whole_file_shapes
from harness.formats.names import check_weights
from harness.partition.hybrid_layout import FULL, HybridShape, layer_kinds
from harness.specs.model import DTYPES as SPEC_DTYPES
from harness.specs.model import ModelSpec

Weights = dict[str, torch.Tensor]
Shape = tuple[int, ...]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# canonical norm suffix -> Qwen3-Next suffix, for the (1 + w) norms
OFFSET_NORMS: dict[str, str] = {"attn_norm.weight": "input_layernorm.weight",
                                "mlp_norm.weight": "post_attention_layernorm.weight",
                                "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight"}
# canonical suffix -> Qwen3-Next suffix, tensors written as they are
PLAIN: dict[str, str] = {
    "q.weight": "self_attn.q_proj.weight", "k.weight": "self_attn.k_proj.weight",
    "v.weight": "self_attn.v_proj.weight", "o.weight": "self_attn.o_proj.weight",
    "lin_A_log": "linear_attn.A_log", "lin_dt_bias": "linear_attn.dt_bias",
    "lin_norm.weight": "linear_attn.norm.weight", "lin_out.weight": "linear_attn.out_proj.weight",
    "router.weight": "mlp.gate.weight", "shared.gate.weight": "mlp.shared_expert.gate_proj.weight",
    "shared.up.weight": "mlp.shared_expert.up_proj.weight",
}
EXPERT_PARTS: dict[str, str] = {"experts.gate.weight": "gate_proj", "experts.up.weight": "up_proj",
                                "experts.down.weight": "down_proj"}
SHARED_DOWN = "mlp.shared_expert.down_proj.weight"
SHARED_GATE = "mlp.shared_expert_gate.weight"
IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)


def hybrid_shape(spec: ModelSpec) -> HybridShape:
    return model_of(spec).hybrid_shape()


def qwen3_next_config(spec: ModelSpec) -> dict[str, Any]:
    """The Qwen3-Next config.json of a hybrid `spec` (every layer MoE, whole-head RoPE)."""
    h = hybrid_shape(spec)
    kinds = layer_kinds(spec.layers, h.full_attention_interval)
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_act": "silu",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "layer_types": ["full_attention" if k == FULL else "linear_attention" for k in kinds],
        "full_attention_interval": h.full_attention_interval, "linear_conv_kernel_dim": h.conv_kernel,
        "linear_num_key_heads": h.linear_k_heads, "linear_num_value_heads": h.linear_v_heads,
        "linear_key_head_dim": h.linear_k_dim, "linear_value_head_dim": h.linear_v_dim,
        "num_experts": h.experts, "num_experts_per_tok": h.top_k, "moe_intermediate_size": h.moe_ffn,
        "shared_expert_intermediate_size": h.shared_ffn, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "partial_rotary_factor": 1.0, "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": 1.0},
        "attention_bias": False, "tie_word_embeddings": spec.tied_embeddings,
        "max_position_embeddings": spec.max_seq_len, "torch_dtype": spec.dtype, "dtype": spec.dtype,
    }


def _offset_out(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (t.to(dtype).float() - 1.0).to(dtype)  # exact: w in [0.5, 2] rounded to dtype, minus 1


def to_qwen3_next(spec: ModelSpec, w: Weights) -> Weights:
    """Canonical hybrid weights -> Qwen3-Next tensor names and layouts, in the model's dtype."""
    h = hybrid_shape(spec)
    dtype = DTYPES[spec.dtype]
    nk, nv, dk, H = h.linear_k_heads, h.linear_v_heads, h.linear_k_dim, spec.hidden
    out: Weights = {"model.embed_tokens.weight": w["embed.weight"].to(dtype),
                    "model.norm.weight": _offset_out(w["norm.weight"], dtype)}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = w["lm_head.weight"].to(dtype)
    for i, kind in enumerate(layer_kinds(spec.layers, h.full_attention_interval)):
        p, f = f"layers.{i}.", f"model.layers.{i}."
        for suffix, name in OFFSET_NORMS.items():
            if p + suffix in w:
                out[f + name] = _offset_out(w[p + suffix], dtype)
        for suffix, name in PLAIN.items():
            if p + suffix in w:
                out[f + name] = w[p + suffix].to(dtype)
        if kind != FULL:
            qkv = w[p + "lin_qkv.weight"]
            # q [nk dk, H] -> [nk, dk, H]; k likewise; v [nv dv, H] -> [nk, (nv / nk) dv, H]; z likewise
            q, k, v = (qkv[: nk * dk].view(nk, dk, H), qkv[nk * dk: 2 * nk * dk].view(nk, dk, H),
                       qkv[2 * nk * dk:].view(nk, -1, H))
            z = w[p + "lin_z.weight"].view(nk, -1, H)
            out[f + "linear_attn.in_proj_qkvz.weight"] = torch.cat((q, k, v, z), dim=1).reshape(-1, H).to(dtype)
            # b, a [nv, H] -> [nk, nv / nk, H] -> per K head its b rows, then its a rows -> [2 nv, H]
            b, a = w[p + "lin_b.weight"].view(nk, -1, H), w[p + "lin_a.weight"].view(nk, -1, H)
            out[f + "linear_attn.in_proj_ba.weight"] = torch.cat((b, a), dim=1).reshape(2 * nv, H).to(dtype)
            out[f + "linear_attn.conv1d.weight"] = w[p + "lin_conv.weight"][:, None, :].to(dtype)  # [C, 1, K]
        for suffix, part in EXPERT_PARTS.items():
            for e in range(h.experts):
                out[f"{f}mlp.experts.{e}.{part}.weight"] = w[p + suffix][e].to(dtype)
        out[f + SHARED_DOWN] = w[p + "shared.down.weight"].to(dtype) * 2  # exact; sigmoid(0) halves it
        out[f + SHARED_GATE] = torch.zeros(1, H, dtype=dtype)
    return out


def _take(f: Weights, name: str, where: str) -> torch.Tensor:
    if name not in f:
        raise ConfigError(f"{where}: missing tensor {name!r} of a Qwen3-Next checkpoint")
    return f.pop(name).to(torch.float32)


def from_qwen3_next(spec: ModelSpec, tensors: Weights, where: str) -> Weights:
    """Qwen3-Next tensors (file names) -> canonical float32 hybrid weights; one ConfigError naming the file for a
    missing or unknown tensor or a nonzero shared_expert_gate (the embedded engine has no such gate)."""
    h = hybrid_shape(spec)
    nk, dk, H = h.linear_k_heads, h.linear_k_dim, spec.hidden
    f = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}
    if spec.tied_embeddings:
        f.pop("lm_head.weight", None)
    w: Weights = {"embed.weight": _take(f, "model.embed_tokens.weight", where),
                  "norm.weight": _take(f, "model.norm.weight", where) + 1.0}
    if not spec.tied_embeddings:
        w["lm_head.weight"] = _take(f, "lm_head.weight", where)
    for i, kind in enumerate(layer_kinds(spec.layers, h.full_attention_interval)):
        p, fp = f"layers.{i}.", f"model.layers.{i}."
        full = kind == FULL
        for suffix, name in OFFSET_NORMS.items():
            if suffix.startswith(("q_norm", "k_norm")) and not (full and h.qk_norm):
                continue
            w[p + suffix] = _take(f, fp + name, where) + 1.0
        for suffix, name in PLAIN.items():
            if (suffix.startswith(("q.", "k.", "v.", "o.")) and not full) or (suffix.startswith("lin_") and full):
                continue
            w[p + suffix] = _take(f, fp + name, where)
        if not full:
            qkvz = _take(f, fp + "linear_attn.in_proj_qkvz.weight", where)
            # [nk * (2 dk + 2 r dv), H] -> [nk, 2 dk + 2 r dv, H] -> q, k [nk, dk, H], v, z [nk, r dv, H]
            grouped = qkvz.view(nk, -1, H)
            vz = (grouped.shape[1] - 2 * dk) // 2
            q, k, v, z = grouped.split([dk, dk, vz, vz], dim=1)
            w[p + "lin_qkv.weight"] = torch.cat((q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)))
            w[p + "lin_z.weight"] = z.reshape(-1, H)
            ba = _take(f, fp + "linear_attn.in_proj_ba.weight", where).view(nk, -1, H)  # [nk, 2 r, H]
            b, a = ba.split(ba.shape[1] // 2, dim=1)
            w[p + "lin_b.weight"], w[p + "lin_a.weight"] = b.reshape(-1, H), a.reshape(-1, H)
            conv = _take(f, fp + "linear_attn.conv1d.weight", where)
            w[p + "lin_conv.weight"] = conv.flatten(1)  # [C, 1, K] -> [C, K]
        for suffix, part in EXPERT_PARTS.items():
            w[p + suffix] = torch.stack([_take(f, f"{fp}mlp.experts.{e}.{part}.weight", where)
                                         for e in range(h.experts)])
        gate = _take(f, fp + SHARED_GATE, where)
        if torch.count_nonzero(gate):
            raise ConfigError(f"{where}: {fp + SHARED_GATE} is nonzero (max |w| {gate.abs().max().item():.3g}); the "
                              f"embedded engine has no shared-expert gate and runs a Qwen3-Next checkpoint only where "
                              f"it is zero (as harness export writes it)")
        w[p + "shared.down.weight"] = _take(f, fp + SHARED_DOWN, where) / 2  # exact
    if f:
        raise ConfigError(f"{where}: tensor {sorted(f)[0]!r} is not part of the Qwen3-Next model {spec.name!r} "
                          f"({len(f)} unknown in all)")
    return w


def qwen3_next_shapes(spec: ModelSpec, canonical: dict[str, Shape]) -> dict[str, Shape]:
    """The Qwen3-Next file's tensor names and shapes for canonical `canonical` shapes (no data: meta tensors)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in canonical.items()}
    return {name: tuple(t.shape) for name, t in to_qwen3_next(spec, meta).items()}


def _hybrid_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """A Qwen3-Next config.json's linear attention, gated attention and experts as ModelSpec fields."""
    value = lambda key: int(config_value(config, key, where))  # noqa: E731
    experts = int(config.get("num_experts") or 0)
    hybrid = HybridShape(
        linear_k_heads=value("linear_num_key_heads"), linear_v_heads=value("linear_num_value_heads"),
        linear_k_dim=value("linear_key_head_dim"), linear_v_dim=value("linear_value_head_dim"),
        full_attention_interval=value("full_attention_interval"),
        conv_kernel=int(config.get("linear_conv_kernel_dim") or 4), attn_output_gate=True, qk_norm=True,
        experts=experts,
        top_k=value("num_experts_per_tok") if experts else 0, moe_ffn=value("moe_intermediate_size") if experts else 0,
        shared_ffn=int(config.get("shared_expert_intermediate_size") or 0) if experts else 0)
    fields: dict[str, Any] = {"hybrid": hybrid}
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype in SPEC_DTYPES:  # Qwen3-Next runs in its checkpoint's dtype (vLLM's CPU GDN kernel takes bfloat16 only)
        fields["dtype"] = dtype
    return fields


def spec_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """Qwen3-Next's gated attention heads and its linear attention, experts and dtype as ModelSpec fields."""
    heads = int(config_value(config, "num_attention_heads", where))
    hidden = int(config_value(config, "hidden_size", where))
    return {"kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads), **_hybrid_fields(config, where)}


def engine_gaps(config: dict[str, Any]) -> tuple[str, ...]:
    """What a Qwen3-Next checkpoint holds that the embedded engine does not implement."""
    gaps = rope_gaps(config)
    if int(config.get("decoder_sparse_step") or 1) != 1 or config.get("mlp_only_layers"):
        gaps.append("dense MLP layers among the MoE layers (decoder_sparse_step / mlp_only_layers)")
    if not int(config.get("num_experts") or 0):
        gaps.append("a Qwen3-Next model without routed experts")
    return tuple(gaps)


def from_file(spec: ModelSpec, found: Weights, where: Path) -> Weights:
    weights = from_qwen3_next(spec, found, str(where))
    check_weights(spec, weights, where)
    return weights


def canonical_shapes(spec: ModelSpec, found: dict[str, Shape], where: Path) -> dict[str, Shape]:
    return whole_file_shapes(spec, found, qwen3_next_shapes, where)


QWEN3_NEXT = HFAdapter(family="Qwen3-Next", model_types=("qwen3_next",), engine_module="harness.engine.layers.hybrid",
                       spec_fields=spec_fields, engine_gaps=engine_gaps, config=qwen3_next_config,
                       to_file=to_qwen3_next, from_file=from_file, canonical_shapes=canonical_shapes)
