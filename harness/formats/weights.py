"""Full (unsharded) float32 CPU weights under canonical names (harness/formats/names.py), from any source: seeded
synthetic init, Hugging Face folders (harness/formats/hf/, one adapter per architecture family), GGUF files
(harness/formats/gguf/) and GGUFs shipped inside pip packages. Q/K rows always follow the Hugging Face rotate_half
RoPE convention.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import numpy as np
import torch

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.gguf.weights import gguf_header_shapes, load_gguf_file
from harness.formats.hf.read import hf_header_shapes, load_hf_folder
from harness.formats.hybrid_names import synthetic_std
from harness.formats.locate import checkpoint_path
from harness.formats.names import Shape, check_shapes, check_weights, expected_shapes
from harness.specs.model import ModelSpec

# Synthetic init. The lm_head (or the tied embedding) is scaled so that the logits have a standard
# deviation of about SYNTHETIC_LOGIT_STD: top-2 gaps of greedy decoding are then rarely near-ties.
SYNTHETIC_LOGIT_STD = 4.0
SYNTHETIC_NORM_NOISE = 0.1
SYNTHETIC_BIAS_STD = 0.02


def load_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every canonical tensor of `spec` as a float32 CPU tensor, checked against the spec's shapes; a model the
    embedded engine cannot run (Model.embedded_refusal) is one ConfigError saying why."""
    refusal = model_of(spec).embedded_refusal()
    if refusal is not None:
        raise ConfigError(refusal)
    if spec.source == "synthetic":
        return synthetic_weights(spec)
    path = checkpoint_path(spec)
    weights = load_hf_folder(spec, path) if spec.source == "hf" else load_gguf_file(spec, path)
    check_weights(spec, weights, path)
    return weights


def weights_hash(weights: dict[str, torch.Tensor]) -> str:
    """sha256 hex over sorted names, dtypes, shapes and raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def validate_checkpoint(spec: ModelSpec) -> None:
    """The cheap check before any rank starts: every tensor's name and shape from the file headers
    (safetensors metadata, GGUF tensor infos), without reading or dequantizing the data."""
    refusal = model_of(spec).embedded_refusal()
    if refusal is not None:
        raise ConfigError(refusal)
    if spec.source != "synthetic":
        path = checkpoint_path(spec)
        check_shapes(spec, checkpoint_shapes(spec, path), path)


def checkpoint_shapes(spec: ModelSpec, path: Path) -> dict[str, Shape]:
    """Canonical name -> shape of every tensor in a checkpoint, read from headers only."""
    return hf_header_shapes(spec, path) if spec.source == "hf" else gguf_header_shapes(path)


# ---- synthetic ---------------------------------------------------------------------------------------


def seeded_generator(seed: int, name: str, *salt: int) -> np.random.Generator:
    """A generator that depends only on (seed, name, salt): identical in every process and independent
    of creation order; a salt gives another stream for the same tensor name."""
    entropy = [seed % 2**64, zlib.crc32(name.encode("utf-8")), *salt]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def _synthetic_std(spec: ModelSpec, name: str) -> float:
    output_matrix = name == "lm_head.weight" or (name == "embed.weight" and spec.tied_embeddings)
    if output_matrix:
        return SYNTHETIC_LOGIT_STD / spec.hidden ** 0.5  # logits = rmsnormed hidden (rms ~1) @ lm_head.T
    if name.endswith(".bias"):
        return SYNTHETIC_BIAS_STD
    return synthetic_std(name) or spec.init_std


def _synthetic_tensor(spec: ModelSpec, name: str, shape: Shape) -> torch.Tensor:
    noise = seeded_generator(spec.seed, name).standard_normal(shape)  # float64, then rounded once to float32
    if name.endswith("norm.weight"):
        values = 1.0 + SYNTHETIC_NORM_NOISE * noise
    else:
        values = _synthetic_std(spec, name) * noise
    return torch.from_numpy(values.astype(np.float32))


def synthetic_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Seeded weights: N(0, init_std) matrices, norms 1 + N(0, 0.1), small biases, a wide lm_head."""
    return {name: _synthetic_tensor(spec, name, shape) for name, shape in expected_shapes(spec).items()}
