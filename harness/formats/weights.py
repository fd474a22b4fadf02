"""Full (unsharded) float32 CPU weights under canonical names (see harness.formats.names), from any source.

Sources: seeded synthetic init, Hugging Face folders (safetensors), GGUF files (dequantized), and GGUFs
shipped inside pip packages. Q/K rows always follow the Hugging Face rotate_half RoPE convention.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.checkpoint import canonical_from_file, stack_experts, whole_file_format
from harness.formats.gguf.file import architecture, dequantize, open_gguf, unpermute_rows
from harness.formats.hf.deepseek_mtp import from_deepseek_mtp, is_mtp_tensor
from harness.formats.hybrid_names import synthetic_std
from harness.formats.locate import checkpoint_path, hf_config, read_json
from harness.formats.names import Shape, canonical_from_gguf, canonical_from_hf, expected_shapes
from harness.specs.model import ModelSpec

# Synthetic init. The lm_head (or the tied embedding) is scaled so that the logits have a standard
# deviation of about SYNTHETIC_LOGIT_STD: top-2 gaps of greedy decoding are then rarely near-ties.
SYNTHETIC_LOGIT_STD = 4.0
SYNTHETIC_NORM_NOISE = 0.1
SYNTHETIC_BIAS_STD = 0.02
IGNORED_HF_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)


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


def check_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], path: Path) -> None:
    """One ConfigError naming the checkpoint when a tensor is missing, unexpected or of the wrong shape."""
    check_shapes(spec, {name: tuple(t.shape) for name, t in weights.items()}, path)


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
    shapes: dict[str, Shape] = {}
    if spec.source == "hf":
        from safetensors import SafetensorError, safe_open
        if not path.is_dir():
            raise ConfigError(f"checkpoint folder {path} does not exist")
        hf_config(path)
        whole = whole_file_format(spec)
        for file in safetensors_files(path):
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for key in handle.keys():
                        name = _canonical_hf(spec, key, file) if whole is None else key
                        if name is not None:
                            shapes[name] = tuple(handle.get_slice(key).get_shape())
            except (SafetensorError, OSError) as exc:
                raise ConfigError(f"{file}: not a readable safetensors file: {exc}") from exc
        if whole is not None:
            return _whole_file_shapes(spec, shapes, whole[2], path)
        # per-expert tensors stacked as the loader stacks them (shapes only: meta tensors)
        stacked = stack_experts({name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
        return {name: tuple(t.shape) for name, t in stacked.items()}
    reader = open_gguf(path)
    arch = architecture(reader)
    for tensor in reader.tensors:
        name = _gguf_canonical(tensor.name, arch, path)
        if name is not None:
            shapes[name] = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return shapes


def _whole_file_shapes(spec: ModelSpec, found: dict[str, Shape],
                       file_shapes: Callable[[ModelSpec, dict[str, Shape]], dict[str, Shape]],
                       path: Path) -> dict[str, Shape]:
    """A whole-file format's header shapes checked against the file form of the spec's shapes (one ConfigError
    naming the first missing, unknown or misshapen tensor); the canonical shapes they stand for."""
    expected = expected_shapes(spec)
    wanted = file_shapes(spec, expected)
    found = {k: v for k, v in found.items() if not k.endswith(IGNORED_HF_SUFFIXES)}
    if spec.tied_embeddings:
        found.pop("lm_head.weight", None)
    missing = sorted(set(wanted) - set(found))
    unknown = sorted(set(found) - set(wanted))
    wrong = sorted(k for k in set(wanted) & set(found) if wanted[k] != found[k])
    if missing:
        raise ConfigError(f"checkpoint {path}: missing tensor {missing[0]!r} ({len(missing)} missing in all) "
                          f"for model {spec.name!r}")
    if unknown:
        raise ConfigError(f"checkpoint {path}: unexpected tensor {unknown[0]!r} for model {spec.name!r}")
    if wrong:
        raise ConfigError(f"checkpoint {path}: tensor {wrong[0]!r} has shape {found[wrong[0]]}, model "
                          f"{spec.name!r} expects {wanted[wrong[0]]}")
    return expected


def check_shapes(spec: ModelSpec, shapes: dict[str, Shape], path: Path) -> None:
    """One ConfigError naming the checkpoint when a tensor is missing, unexpected or of the wrong shape."""
    expected = expected_shapes(spec)
    weights = shapes
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ConfigError(f"checkpoint {path}: missing tensor {missing[0]!r} "
                          f"({len(missing)} missing in all) for model {spec.name!r}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ConfigError(f"checkpoint {path}: unexpected tensor {unexpected[0]!r} for model {spec.name!r} "
                          f"(qkv_bias={spec.qkv_bias}, tied_embeddings={spec.tied_embeddings})")
    for name, shape in expected.items():
        if tuple(weights[name]) != shape:
            raise shape_error(spec, name, tuple(weights[name]), path)


def shape_error(spec: ModelSpec, name: str, shape: Shape, path: Path) -> ConfigError:
    """The error for canonical tensor `name` found with a shape that `spec` does not call for."""
    return ConfigError(f"checkpoint {path}: tensor {name!r} has shape {tuple(shape)}, "
                       f"model {spec.name!r} expects {expected_shapes(spec).get(name)}")


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


# ---- Hugging Face folders ------------------------------------------------------------------------------


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


def _canonical_hf(spec: ModelSpec, key: str, path: Path) -> str | None:
    """The canonical name of HF tensor `key`, None for tensors to skip; unknown tensors are an error."""
    if key.endswith(IGNORED_HF_SUFFIXES) or (key == "lm_head.weight" and spec.tied_embeddings):
        return None
    if is_mtp_tensor(spec, key):  # the checkpoint's MTP layer: the -mtp speculator's (load_mtp_weights)
        return None
    name = canonical_from_hf(key)
    if name is None:
        raise ConfigError(f"{path}: tensor {key!r} is not part of a Llama/Qwen2/Mistral model "
                          f"(unsupported architecture?)")
    return name


def load_hf_folder(spec: ModelSpec, folder: Path) -> dict[str, torch.Tensor]:
    """Canonical float32 weights from a Hugging Face checkpoint folder (single or sharded safetensors), in the
    canonical layout (a DeepSeek folder's interleaved RoPE rows reordered: harness/formats/checkpoint.py)."""
    if not folder.is_dir():
        raise ConfigError(f"checkpoint folder {folder} does not exist")
    hf_config(folder)  # a folder without config.json is not a checkpoint
    weights: dict[str, torch.Tensor] = {}
    whole = whole_file_format(spec)
    if whole is not None:  # packed / per-expert tensors: the file's tensors converted together
        found = {key: tensor for path in safetensors_files(folder) for key, tensor in _hf_tensors(path)}
        weights = whole[1](spec, found, str(folder))
        check_weights(spec, weights, folder)
        return weights
    for path in safetensors_files(folder):
        for key, tensor in _hf_tensors(path):
            name = _canonical_hf(spec, key, path)
            if name is not None:
                weights[name] = tensor.to(torch.float32).contiguous()
    weights = stack_experts(weights)  # a DeepSeek folder's one tensor per routed expert -> [E, ...]
    check_weights(spec, weights, folder)
    return canonical_from_file(spec, weights)


def load_mtp_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The MTP layer a DeepSeek-V3 folder holds (spec.nextn_layers) as the embedded engine's MTP weights
    (mtp_checkpoint.from_deepseek_mtp)."""
    folder = checkpoint_path(spec)
    found = {key: tensor for path in safetensors_files(folder) for key, tensor in _hf_tensors(path)
             if is_mtp_tensor(spec, key)}
    return from_deepseek_mtp(spec, found, str(folder))


# ---- GGUF ----------------------------------------------------------------------------------------------


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

    from harness.formats.gguf.cache import converted

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
