"""Reading a Hugging Face folder: its safetensors files (single or sharded), every tensor converted by the folder's
adapter to canonical float32 weights, the header shapes alone (before any rank starts), and a DeepSeek-V3 folder's
MTP layer for the -mtp speculator."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from harness.core.errors import ConfigError
from harness.formats.hf.config import hf_config, read_json
from harness.formats.hf.deepseek import is_mtp_tensor
from harness.formats.hf.deepseek_mtp import from_deepseek_mtp
from harness.formats.hf.registry import adapter_for_spec
from harness.formats.names import Shape
from harness.specs.model import ModelSpec


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those of model.safetensors.index.json, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"{index} lists {absent[0]!r}, which is missing from {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint folder {folder} has no *.safetensors files")
    return files


def _hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path}: not a readable safetensors file: {exc}") from exc


def load_hf_folder(spec: ModelSpec, folder: Path) -> dict[str, torch.Tensor]:
    """Canonical float32 weights from a Hugging Face checkpoint folder, converted by its family's adapter (a DeepSeek
    folder's interleaved RoPE rows reordered, per-expert tensors stacked, Qwen3-Next's packed tensors split)."""
    if not folder.is_dir():
        raise ConfigError(f"checkpoint folder {folder} does not exist")
    hf_config(folder)  # a folder without config.json is not a checkpoint
    found = {key: tensor for path in safetensors_files(folder) for key, tensor in _hf_tensors(path)}
    return adapter_for_spec(spec).from_file(spec, found, folder)


def hf_header_shapes(spec: ModelSpec, folder: Path) -> dict[str, Shape]:
    """Canonical name -> shape of every tensor of the folder, from the safetensors headers only."""
    from safetensors import SafetensorError, safe_open

    if not folder.is_dir():
        raise ConfigError(f"checkpoint folder {folder} does not exist")
    hf_config(folder)
    found: dict[str, Shape] = {}
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    found[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"{file}: not a readable safetensors file: {exc}") from exc
    return adapter_for_spec(spec).canonical_shapes(spec, found, folder)


def load_mtp_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The MTP layer a DeepSeek-V3 folder holds (spec.nextn_layers) as the embedded engine's MTP weights
    (mtp_checkpoint.from_deepseek_mtp)."""
    folder = Path(spec.path)
    found = {key: tensor for path in safetensors_files(folder) for key, tensor in _hf_tensors(path)
             if is_mtp_tensor(spec, key)}
    return from_deepseek_mtp(spec, found, str(folder))
