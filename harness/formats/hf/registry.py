"""The Hugging Face adapters, one per architecture family, found by a folder's model_type or a spec's attention."""

from __future__ import annotations

from pathlib import Path

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.hf.adapter import HFAdapter
from harness.formats.hf.deepseek import DEEPSEEK
from harness.formats.hf.llama import LLAMA
from harness.formats.hf.qwen3_next import QWEN3_NEXT
from harness.specs.model import ModelSpec

ADAPTERS: tuple[HFAdapter, ...] = (LLAMA, DEEPSEEK, QWEN3_NEXT)
HF_MODEL_TYPES: tuple[str, ...] = tuple(t for a in ADAPTERS for t in a.model_types)


def adapter_for_config(model_type: object, where: Path) -> HFAdapter:
    """The adapter of a config.json's model_type; one ConfigError naming the supported ones otherwise."""
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise ConfigError(f"{where}/config.json: model_type {model_type!r} is not supported; "
                      f"supported: {', '.join(HF_MODEL_TYPES)}")


def adapter_for_spec(spec: ModelSpec) -> HFAdapter:
    """The adapter whose models run on the engine module of `spec`'s attention; a ConfigError for a model no
    Hugging Face architecture here holds (its export refusal says why first, harness/arch/components.py)."""
    module = model_of(spec).attention.engine_module
    for adapter in ADAPTERS:
        if adapter.engine_module == module:
            return adapter
    raise ConfigError(f"model {spec.name!r}: no Hugging Face architecture here holds a model of {module}")
