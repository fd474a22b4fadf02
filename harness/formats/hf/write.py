"""Writing canonical weights as a Hugging Face folder (config.json + model.safetensors) in the layout of the spec's
family (harness/formats/hf/registry.py): the reverse of harness/formats/hf/read.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.formats.hf.registry import adapter_for_spec
from harness.specs.model import ModelSpec


def save_hf_checkpoint(spec: ModelSpec, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write canonical `weights` as a Hugging Face folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    adapter = adapter_for_spec(spec)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(adapter.config(spec), indent=2) + "\n")
    tensors = {name: t.contiguous() for name, t in adapter.to_file(spec, weights).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
