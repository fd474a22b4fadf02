"""Writing canonical weights as a Hugging Face folder (config.json + model.safetensors): the reverse of
harness/formats/locate.py, which reads specs from checkpoints.

Each engine module an attention component names (harness/arch/components.py) has its own Hugging Face
architecture: dense models are Llama (Qwen2 with q/k/v biases), MLA models DeepSeek-V2
(DeepseekV2ForCausalLM: the latent attention, a dense FFN in every layer, or with experts (spec.moe) a dense
FFN in the first moe.first_dense layers and routed experts plus a shared expert in the others, one tensor per
expert in the file: `unstack_experts` / `stack_experts`), hybrid models Qwen3-Next (Qwen3NextForCausalLM,
harness/formats/hf/qwen3_next.py: packed and per-expert tensors, converted as whole files). DeepSeek rotates its RoPE
dimensions as interleaved pairs (x[2i], x[2i+1]) where the harness rotates halves (x[i], x[i + d/2]): the
rope rows of q and kv_a are written in the interleaved order (`rope_rows_interleaved`) and read back in
the halves order, so both engines compute the same scores from the same file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.hf.qwen3_next import from_qwen3_next, qwen3_next_config, qwen3_next_shapes, to_qwen3_next
from harness.formats.names import EXPERT_CANONICAL, Shape, expert_name, hf_name
from harness.specs.model import ModelSpec

Weights = dict[str, torch.Tensor]


def llama_config(spec: ModelSpec) -> dict[str, Any]:
    """A transformers config.json for a dense `spec` (Qwen2 when it has q/k/v biases, else Llama)."""
    qwen = spec.qkv_bias
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama", "hidden_act": "silu",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tied_embeddings, "max_position_embeddings": spec.max_seq_len,
        "torch_dtype": "float32", "dtype": "float32",
    }
    if not qwen:
        config.update({"attention_bias": False, "mlp_bias": False})
    return config


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


def _same(spec: ModelSpec, weights: Weights) -> Weights:
    return weights


# per engine module of the attention component: its config.json, its canonical -> file weights and back
HF_FORMATS: dict[str, tuple[Callable[[ModelSpec], dict[str, Any]], Callable[[ModelSpec, Weights], Weights],
                            Callable[[ModelSpec, Weights], Weights]]] = {
    "harness.engine.layers.dense": (llama_config, _same, _same),
    "harness.engine.layers.mla": (deepseek_v2_config, rope_rows_interleaved, rope_rows_halves),
    "harness.engine.layers.hybrid": (qwen3_next_config, _same, _same),
}
# engine modules whose files pack several canonical tensors into one or split one per expert (Qwen3-Next): their
# files are converted whole (canonical weights -> file names and tensors, and file tensors + where -> canonical)
WHOLE_FILE_FORMATS: dict[str, tuple[Callable[[ModelSpec, Weights], Weights],
                                    Callable[[ModelSpec, Weights, str], Weights],
                                    Callable[[ModelSpec, dict[str, Shape]], dict[str, Shape]]]] = {
    "harness.engine.layers.hybrid": (to_qwen3_next, from_qwen3_next, qwen3_next_shapes),
}


def whole_file_format(spec: ModelSpec) -> tuple[Callable[[ModelSpec, Weights], Weights],
                                                 Callable[[ModelSpec, Weights, str], Weights],
                                                 Callable[[ModelSpec, dict[str, Shape]], dict[str, Shape]]] | None:
    """(to file, from file, file shapes) of a model whose files are converted whole, else None (name by name)."""
    return WHOLE_FILE_FORMATS.get(model_of(spec).attention.engine_module)


def _format(spec: ModelSpec) -> tuple[Callable[[ModelSpec], dict[str, Any]], Callable[[ModelSpec, Weights], Weights],
                                      Callable[[ModelSpec, Weights], Weights]]:
    return HF_FORMATS[model_of(spec).attention.engine_module]


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The transformers config.json of `spec` (Llama, Qwen2, DeepSeek-V2 or Qwen3-Next)."""
    return _format(spec)[0](spec)


def canonical_from_file(spec: ModelSpec, weights: Weights) -> Weights:
    """Weights read from a Hugging Face folder under canonical names -> the canonical layout (RoPE rows)."""
    return _format(spec)[2](spec, weights)


def save_hf_checkpoint(spec: ModelSpec, weights: Weights, folder: Path) -> Path:
    """Write canonical `weights` as a Hugging Face folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_dict(spec), indent=2) + "\n")
    whole = whole_file_format(spec)
    tensors = ({name: t.contiguous() for name, t in whole[0](spec, weights).items()} if whole is not None else
               {hf_name(name): t.contiguous() for name, t in _format(spec)[1](spec, weights).items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
