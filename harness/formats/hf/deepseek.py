"""The DeepSeek family (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention, a dense FFN
in every layer, or with experts (spec.moe) a dense FFN in the first moe.first_dense layers and routed experts plus a
shared expert in the others, one tensor per expert in the file (`unstack_experts` / `stack_experts`); DeepSeek-V3
adds its MTP layer after the target's layers (harness/formats/hf/deepseek_mtp.py). DeepSeek rotates its RoPE
dimensions as interleaved pairs (x[2i], x[2i+1]) where the harness rotates halves (x[i], x[i + d/2]): the rope rows
of q and kv_a are written in the interleaved order (`rope_rows_interleaved`) and read back in the halves order, so
both engines compute the same scores from the same file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from harness.core.errors import ConfigError
from harness.formats.hf.adapter import HFAdapter, Shape, Weights
from harness.formats.hf.config import config_value, rope_type
from harness.formats.hf.files import by_name
from harness.formats.hf.names import hf_name
from harness.formats.names import EXPERT_CANONICAL, check_weights, expert_name
from harness.partition.hybrid_layout import MoeShape
from harness.specs.model import ModelSpec

FAMILY = "DeepSeek-V2/V3"


def spec_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The MLA numbers of a DeepSeek-V2 config.json as ModelSpec fields (head_dim is the value width), and its
    routed experts where a layer has them (first_k_dense_replace < num_hidden_layers)."""
    fields: dict[str, Any] = {
        "kv_heads": 1, "head_dim": int(config_value(config, "v_head_dim", where)),
        "kv_lora_rank": int(config_value(config, "kv_lora_rank", where)),
        "q_lora_rank": int(config.get("q_lora_rank") or 0),
        "qk_rope_dim": int(config_value(config, "qk_rope_head_dim", where)),
        "qk_nope_dim": int(config_value(config, "qk_nope_head_dim", where)),
        "nextn_layers": int(config.get("num_nextn_predict_layers") or 0)}  # DeepSeek-V3's MTP layers
    layers, first_dense = int(config_value(config, "num_hidden_layers", where)), int(
        config.get("first_k_dense_replace") or 0)
    experts = int(config.get("n_routed_experts") or 0)
    if experts and first_dense < layers:
        moe_ffn = int(config_value(config, "moe_intermediate_size", where))
        fields["moe"] = MoeShape(experts=experts, top_k=int(config_value(config, "num_experts_per_tok", where)),
                                 moe_ffn=moe_ffn, shared_ffn=int(config.get("n_shared_experts") or 0) * moe_ffn,
                                 first_dense=first_dense, renormalize=bool(config.get("norm_topk_prob", False)))
    return fields


def rope_gaps(config: dict[str, Any]) -> list[str]:
    """Scaled or partial RoPE, which the embedded engine does not implement."""
    gaps = []
    if rope_type(config) != "default":
        gaps.append(f"{rope_type(config)} RoPE scaling")
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        gaps.append(f"partial RoPE (partial_rotary_factor {config['partial_rotary_factor']})")
    return gaps


def engine_gaps(config: dict[str, Any]) -> tuple[str, ...]:
    """What a DeepSeek checkpoint holds that the embedded engine does not implement."""
    gaps = rope_gaps(config)
    if int(config.get("n_routed_experts") or 0):
        gaps += _routing_gaps(config)
    return tuple(gaps)


def _routing_gaps(config: dict[str, Any]) -> list[str]:
    """The DeepSeek expert routing the embedded engine does not implement: it takes the greedy top-k of a softmax
    over all experts (optionally renormalized), unscaled."""
    gaps = []
    if config.get("topk_method", "greedy") != "greedy":
        gaps.append(f"topk_method {config['topk_method']!r} (expert groups)")
    if config.get("scoring_func", "softmax") != "softmax":
        gaps.append(f"scoring_func {config['scoring_func']!r}")
    if float(config.get("routed_scaling_factor") or 1.0) != 1.0:
        gaps.append(f"routed_scaling_factor {config['routed_scaling_factor']}")
    return gaps


def deepseek_v2_config(spec: ModelSpec) -> dict[str, Any]:
    """A DeepSeek-V2 config.json for an MLA `spec` (DeepSeek-V3's with spec.nextn_layers MTP layers, numbered
    after the target's layers), plain RoPE: without experts every layer dense
    (first_k_dense_replace = layers: its one nominal routed expert is never built); with spec.moe its routed
    experts (greedy top-k of a softmax, norm_topk_prob = moe.renormalize, no scaling) and one shared expert of
    moe.shared_ffn columns (n_shared_experts = shared_ffn / moe_ffn) from layer moe.first_dense on."""
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_act": "silu",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "moe_intermediate_size": spec.ffn, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.heads,
        "kv_lora_rank": spec.kv_lora_rank, "q_lora_rank": spec.q_lora_rank or None,
        "qk_rope_head_dim": spec.qk_rope_dim, "qk_nope_head_dim": spec.qk_nope_dim, "v_head_dim": spec.head_dim,
        "n_routed_experts": 1, "n_shared_experts": 0, "first_k_dense_replace": spec.layers,
        "moe_layer_freq": 1, "num_experts_per_tok": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "scoring_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta, "rope_scaling": None,
        "attention_bias": False, "tie_word_embeddings": spec.tied_embeddings,
        "max_position_embeddings": spec.max_seq_len, "torch_dtype": "float32", "dtype": "float32",
    }
    if spec.nextn_layers:  # DeepSeek-V3 with its MTP layer(s) numbered after the target's (mtp_checkpoint.py)
        config.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                       "num_nextn_predict_layers": spec.nextn_layers,
                       "first_k_dense_replace": spec.layers + spec.nextn_layers})  # the MTP layer dense too
    moe = spec.moe
    if moe is not None:
        if moe.shared_ffn % moe.moe_ffn or moe.redundant_experts:
            raise ConfigError(f"model {spec.name!r}: DeepSeek-V2 holds shared experts of moe_intermediate_size "
                              f"columns each and no redundant experts; moe.shared_ffn={moe.shared_ffn} must be a "
                              f"multiple of moe.moe_ffn={moe.moe_ffn} and redundant_experts={moe.redundant_experts} 0")
        config.update({"n_routed_experts": moe.experts, "num_experts_per_tok": moe.top_k,
                       "moe_intermediate_size": moe.moe_ffn, "n_shared_experts": moe.shared_ffn // moe.moe_ffn,
                       "first_k_dense_replace": moe.first_dense, "norm_topk_prob": moe.renormalize})
    return config


_STACKED = re.compile(r"(layers\.\d+\.)experts\.(gate|up|down)\.weight")
_ONE_EXPERT = re.compile(r"(layers\.\d+\.)" + EXPERT_CANONICAL.pattern)


def unstack_experts(weights: Weights) -> Weights:
    """Canonical stacked expert tensors layers.{i}.experts.gate.weight [E, F, H] -> one per expert, as a
    Hugging Face folder holds them: layers.{i}.experts.{e}.gate.weight [F, H] (down: [H, F])."""
    out: Weights = {}
    for name, t in weights.items():
        match = _STACKED.fullmatch(name)
        if match is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            out[match.group(1) + expert_name(e, match.group(2))] = t[e]
    return out


def stack_experts(weights: Weights) -> Weights:
    """The reverse of unstack_experts: each layer's experts 0..E-1 stacked in order (a gap in the expert
    ids is a ConfigError naming it)."""
    out: Weights = {}
    found: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in weights.items():
        match = _ONE_EXPERT.fullmatch(name)
        if match is None:
            out[name] = t
        else:
            found.setdefault(f"{match.group(1)}experts.{match.group(3)}.weight", {})[int(match.group(2))] = t
    for name, experts in found.items():
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise ConfigError(f"{name}: the checkpoint holds experts {sorted(experts)}, missing {missing}")
        out[name] = torch.stack([experts[e] for e in range(len(experts))])  # E x [F, H] -> [E, F, H]
    return out


def interleave_order(rope: int) -> torch.Tensor:
    """Row j of the interleaved order is row order[j] of the halves order: pairs (i, i + rope/2) -> (2i, 2i+1)."""
    half = torch.arange(rope // 2)
    return torch.stack((half, half + rope // 2), dim=1).flatten()  # [rope/2, 2] -> [rope]


def _permute_rope_rows(spec: ModelSpec, weights: Weights, order: torch.Tensor) -> Weights:
    """`weights` with the rope rows of each head's query and of the latent projection's k_pe in `order`."""
    qk = spec.qk_nope_dim + spec.qk_rope_dim
    out = dict(weights)
    for i in range(spec.layers):
        p = f"layers.{i}."
        q_name = p + ("q_b.weight" if spec.q_lora_rank else "q.weight")
        q = weights[q_name].view(spec.heads, qk, -1)  # [heads * qk, in] -> [heads, qk, in]
        out[q_name] = torch.cat((q[:, : spec.qk_nope_dim], q[:, spec.qk_nope_dim:][:, order]),
                                dim=1).reshape(spec.heads * qk, -1)
        kv_a = weights[p + "kv_a.weight"]  # [kv_lora + rope, H]
        out[p + "kv_a.weight"] = torch.cat((kv_a[: spec.kv_lora_rank], kv_a[spec.kv_lora_rank:][order]))
    return out


def rope_rows_interleaved(spec: ModelSpec, weights: Weights) -> Weights:
    """Canonical (halves RoPE) MLA weights -> DeepSeek's interleaved RoPE order, each expert its own tensor."""
    return unstack_experts(_permute_rope_rows(spec, weights, interleave_order(spec.qk_rope_dim)))


def rope_rows_halves(spec: ModelSpec, weights: Weights) -> Weights:
    """DeepSeek's interleaved RoPE order -> canonical (halves RoPE) MLA weights."""
    return _permute_rope_rows(spec, weights, torch.argsort(interleave_order(spec.qk_rope_dim)))


def mtp_prefix(spec: ModelSpec) -> str:
    """The file-name prefix of the MTP layer: DeepSeek-V3 numbers it after the target's layers."""
    return f"model.layers.{spec.layers}."


def is_mtp_tensor(spec: ModelSpec, key: str) -> bool:
    """Whether file tensor `key` belongs to the checkpoint's MTP layers (read by the speculator, not the target)."""
    if not spec.nextn_layers or not key.startswith("model.layers."):
        return False
    index = key.removeprefix("model.layers.").partition(".")[0]
    return index.isdigit() and spec.layers <= int(index) < spec.layers + spec.nextn_layers


def to_file(spec: ModelSpec, weights: Weights) -> Weights:
    return {hf_name(name): t for name, t in rope_rows_interleaved(spec, weights).items()}


def from_file(spec: ModelSpec, found: Weights, where: Path) -> Weights:
    """The target's tensors (the MTP layer is the -mtp speculator's: load_mtp_weights) -> canonical float32."""
    named = by_name(spec, found, where, FAMILY, skip=lambda key: is_mtp_tensor(spec, key))
    weights = stack_experts({name: t.to(torch.float32).contiguous() for name, t in named.items()})
    check_weights(spec, weights, where)
    return rope_rows_halves(spec, weights)


def canonical_shapes(spec: ModelSpec, found: dict[str, Shape], where: Path) -> dict[str, Shape]:
    """Header shapes with each layer's per-expert tensors stacked as the loader stacks them (meta tensors)."""
    named = by_name(spec, found, where, FAMILY, skip=lambda key: is_mtp_tensor(spec, key))
    stacked = stack_experts({name: torch.empty(shape, device="meta") for name, shape in named.items()})
    return {name: tuple(t.shape) for name, t in stacked.items()}


DEEPSEEK = HFAdapter(family=FAMILY, model_types=("deepseek_v2", "deepseek_v3"),
                     engine_module="harness.engine.layers.mla", spec_fields=spec_fields, engine_gaps=engine_gaps,
                     config=deepseek_v2_config, to_file=to_file, from_file=from_file,
                     canonical_shapes=canonical_shapes)
