"""A ModelSpec from the metadata of a llama / qwen2 GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.formats.gguf.file import architecture, field, float32_decimal, open_gguf, tensor_index
from harness.formats.hf.config import DEFAULT_MAX_SEQ_LEN
from harness.specs.model import ModelSpec


def _gguf_head_dim(reader: Any, arch: str, hidden: int, heads: int) -> int:
    key_length = field(reader, f"{arch}.attention.key_length", None)
    return int(key_length) if key_length else hidden // heads


def _check_gguf_rope(reader: Any, arch: str, path: Path) -> None:
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"GGUF file {path}: rope scaling {scaling!r} is not supported (only plain RoPE)")


def spec_from_gguf(path: Path) -> ModelSpec:
    """A ModelSpec from the metadata of a llama / qwen2 GGUF file."""
    reader = open_gguf(path)
    arch = architecture(reader)
    _check_gguf_rope(reader, arch, path)
    tensors = tensor_index(reader)
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"GGUF file {path}: missing tensor 'token_embd.weight'")
    heads = int(field(reader, f"{arch}.attention.head_count"))
    hidden = int(field(reader, f"{arch}.embedding_length"))
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF dims innermost first: [H, V]
    context = int(field(reader, f"{arch}.context_length", DEFAULT_MAX_SEQ_LEN))
    return ModelSpec(
        name=path.stem, heads=heads, kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=_gguf_head_dim(reader, arch, hidden, heads), hidden=hidden,
        layers=int(field(reader, f"{arch}.block_count")), ffn=int(field(reader, f"{arch}.feed_forward_length")),
        vocab=vocab, rope_theta=float32_decimal(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float32_decimal(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
        source="gguf", path=str(path), max_seq_len=min(DEFAULT_MAX_SEQ_LEN, context),
        chat_template="tokenizer.chat_template" in reader.fields)
