"""Writing canonical weights as a Hugging Face folder (config.json + model.safetensors): the reverse of
harness/specs/checkpoint.py, which reads specs from checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from harness.engine.names import hf_name
from harness.specs.model import ModelSpec


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """A transformers config.json for `spec` (Qwen2 when it has q/k/v biases, else Llama)."""
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


def save_hf_checkpoint(spec: ModelSpec, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write canonical `weights` as a Hugging Face folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config_dict(spec), indent=2) + "\n")
    tensors = {hf_name(name): t.contiguous() for name, t in weights.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
