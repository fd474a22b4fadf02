"""The Llama family (LlamaForCausalLM, Qwen2ForCausalLM with q/k/v biases, MistralForCausalLM): dense GQA models,
every tensor under its own name (harness/formats/hf/names.py), values as the embedded engine holds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.formats.hf.adapter import HFAdapter, Shape, Weights
from harness.formats.hf.config import config_value
from harness.formats.hf.files import by_name
from harness.formats.hf.names import hf_name
from harness.formats.names import check_weights
from harness.specs.model import ModelSpec

FAMILY = "Llama/Qwen2/Mistral"


def spec_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    heads = int(config_value(config, "num_attention_heads", where))
    hidden = int(config_value(config, "hidden_size", where))
    return {"kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads),
            "qkv_bias": config.get("model_type") == "qwen2"}


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


def to_file(spec: ModelSpec, weights: Weights) -> Weights:
    return {hf_name(name): t for name, t in weights.items()}


def from_file(spec: ModelSpec, found: Weights, where: Path) -> Weights:
    weights = {name: t.to(torch.float32).contiguous() for name, t in by_name(spec, found, where, FAMILY).items()}
    check_weights(spec, weights, where)
    return weights


def canonical_shapes(spec: ModelSpec, found: dict[str, Shape], where: Path) -> dict[str, Shape]:
    return by_name(spec, found, where, FAMILY)


LLAMA = HFAdapter(family=FAMILY, model_types=("llama", "qwen2", "mistral"), engine_module="harness.engine.layers.dense",
                  spec_fields=spec_fields, engine_gaps=None, config=llama_config, to_file=to_file,
                  from_file=from_file, canonical_shapes=canonical_shapes)
