"""A ModelSpec from a Hugging Face folder's config.json: the fields every family shares read here, the family's own
(attention, experts, linear attention, what the embedded engine lacks) by its adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.formats.hf.adapter import HFAdapter
from harness.formats.hf.config import config_value, has_chat_template, hf_config, max_seq_len, rope_theta, rope_type
from harness.formats.hf.registry import adapter_for_config
from harness.specs.model import ModelSpec


def _check_supported(config: dict[str, Any], where: Path) -> HFAdapter:
    """The folder's adapter, or one ConfigError naming what the embedded engine's decoder cannot compute."""
    adapter = adapter_for_config(config.get("model_type"), where)
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}/config.json: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    if config.get("use_sliding_window"):
        raise ConfigError(f"{where}/config.json: sliding-window attention is not supported")
    if config.get("mlp_bias"):
        raise ConfigError(f"{where}/config.json: mlp_bias is not supported")
    if config.get("attention_bias") and config.get("model_type") != "qwen2":
        raise ConfigError(f"{where}/config.json: attention_bias (biases on q/k/v and o) is not supported; "
                          f"only Qwen2's q/k/v biases are")
    return adapter


def _rope_theta(config: dict[str, Any], adapter: HFAdapter, where: Path) -> float:
    """Plain RoPE's theta; scaled RoPE is refused unless the family records it as an engine gap."""
    if rope_type(config) != "default" and adapter.engine_gaps is None:
        raise ConfigError(f"{where}/config.json: rope type {rope_type(config)!r} is not supported (only plain RoPE)")
    return rope_theta(config)


def spec_from_hf(folder: Path) -> ModelSpec:
    """A ModelSpec from config.json of a folder of any family in harness/formats/hf/registry.py."""
    config = hf_config(folder)
    adapter = _check_supported(config, folder)
    heads = int(config_value(config, "num_attention_heads", folder))
    hidden = int(config_value(config, "hidden_size", folder))
    fields = adapter.spec_fields(config, folder)
    if adapter.engine_gaps is not None:
        fields["engine_gaps"] = adapter.engine_gaps(config)
    return ModelSpec(
        name=folder.resolve().name, heads=heads, **fields, hidden=hidden,
        layers=int(config_value(config, "num_hidden_layers", folder)),
        ffn=int(config_value(config, "intermediate_size", folder)),
        vocab=int(config_value(config, "vocab_size", folder)),
        rope_theta=_rope_theta(config, adapter, folder), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        source="hf", path=str(folder), max_seq_len=max_seq_len(config), chat_template=has_chat_template(folder))
