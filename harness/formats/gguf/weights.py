"""Canonical float32 weights from a llama / qwen2 GGUF file: dequantized, Q/K rows un-permuted for llama, converted
once per (file, spec) into the GGUF cache; and the tensors' shapes from the file's tensor infos alone."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from harness.core.errors import ConfigError
from harness.formats.gguf.cache import converted
from harness.formats.gguf.file import architecture, dequantize, open_gguf, unpermute_rows
from harness.formats.gguf.names import canonical_from_gguf
from harness.formats.names import Shape, expected_shapes, shape_error
from harness.specs.model import ModelSpec


def _gguf_heads(spec: ModelSpec, name: str) -> int | None:
    """How many heads the llama.cpp converter permuted this tensor's rows by; None if not permuted."""
    suffix = name.partition(".")[2].partition(".")[2]  # layers.{i}.q.weight -> q.weight
    if suffix.startswith("q."):
        return spec.heads
    if suffix.startswith("k."):
        return spec.kv_heads
    return None


def _gguf_tensor(spec: ModelSpec, arch: str, name: str, values: np.ndarray) -> torch.Tensor:
    heads = _gguf_heads(spec, name) if arch == "llama" else None  # qwen2 GGUFs keep HF row order
    if heads is not None:
        values = unpermute_rows(values, heads)
    return torch.from_numpy(values)


def _gguf_canonical(name: str, arch: str, path: Path) -> str | None:
    canonical = canonical_from_gguf(name)
    if canonical is None and not name.startswith("rope_"):  # rope_* factors come only with rope scaling
        raise ConfigError(f"GGUF file {path}: tensor {name!r} is not part of a {arch} model")
    return canonical


def load_gguf_file(spec: ModelSpec, path: Path) -> dict[str, torch.Tensor]:
    """dequantize_gguf_file, converted once per (file, spec) into the GGUF cache (harness/formats/gguf/cache.py)
    as float32 safetensors, and read from there."""
    from safetensors.torch import load_file, save_file

    spec_key = hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:  # safetensors wants contiguous tensors that share no storage (tied embeddings)
        save_file({k: v.contiguous().clone() for k, v in dequantize_gguf_file(spec, path).items()}, str(tmp))

    return load_file(str(converted(path, f"weights-{spec_key}.safetensors", build)))


def dequantize_gguf_file(spec: ModelSpec, path: Path) -> dict[str, torch.Tensor]:
    """Canonical float32 weights dequantized from a llama / qwen2 GGUF file (Q/K rows un-permuted for llama)."""
    reader = open_gguf(path)
    arch = architecture(reader)
    expected = expected_shapes(spec)
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _gguf_canonical(tensor.name, arch, path)
        if name is None:
            continue
        values = dequantize(tensor)
        if name in expected and values.shape != expected[name]:  # checked before the un-permute reshapes rows
            raise shape_error(spec, name, values.shape, path)
        weights[name] = _gguf_tensor(spec, arch, name, values)
    return weights


def gguf_header_shapes(path: Path) -> dict[str, Shape]:
    """Canonical name -> shape of every tensor of a GGUF file, from its tensor infos only."""
    reader = open_gguf(path)
    arch = architecture(reader)
    shapes: dict[str, Shape] = {}
    for tensor in reader.tensors:
        name = _gguf_canonical(tensor.name, arch, path)
        if name is not None:
            shapes[name] = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return shapes
