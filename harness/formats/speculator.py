"""A speculator's full (unsharded) weights, built from the target's or read from the checkpoint's MTP layer:
the weights part of harness/engine/speculative/speculator.py (which documents the draft and MTP modules), kept apart so
`harness export` writes an MTP layer without importing the engine's runtime."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import torch

from harness.arch.model import model_of
from harness.core.errors import ConfigError
from harness.formats.hf.read import load_mtp_weights
from harness.formats.weights import seeded_generator, synthetic_weights
from harness.specs.model import ModelSpec
from harness.specs.speculative import SpeculativeSettings

SPECULATOR_KINDS: tuple[str, ...] = ("draft", "mtp")
NOISE_SALT = 0x5EED_D2AF  # keeps the draft's noise independent of the synthetic init's draws



def speculator_spec(spec: ModelSpec) -> ModelSpec:
    """The speculator's architecture: the target's with `speculator_layers` dense-FFN layers (a hybrid target's
    speculator: dense full-attention layers with the target's heads and FFN width; an MLA target's: latent
    attention layers, as DeepSeek-V3's MTP layer), holding no MTP layers of its own."""
    return dataclasses.replace(spec, layers=spec.speculator_layers, hybrid=None, moe=None, nextn_layers=0)


def _noise(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal noise that depends only on (seed, name): identical in every process."""
    gen = seeded_generator(seed, name, NOISE_SALT)
    return torch.from_numpy(gen.standard_normal(shape).astype(np.float32))


def _shared(spec: ModelSpec, target: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Embedding, final norm and lm_head, shared with the target."""
    out = {"embed.weight": target["embed.weight"], "norm.weight": target["norm.weight"].clone()}
    if "lm_head.weight" in target:
        out["lm_head.weight"] = target["lm_head.weight"]
    return out


HYBRID_MTP_OUT_SCALE = 0.1


def hybrid_mtp_layers(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A hybrid target's speculator layers: seeded dense layers (its own layers are linear attention and
    MoE) whose output projections (o, down) are scaled by HYBRID_MTP_OUT_SCALE, so the speculator stays
    close to the path the target's residual stream carries from the token embedding to the logits and
    agrees with the target on some tokens (a fully random layer agrees on none)."""
    dense = synthetic_weights(speculator_spec(spec))
    return {name: t * HYBRID_MTP_OUT_SCALE if name.endswith((".o.weight", ".down.weight")) else t
            for name, t in dense.items() if name.startswith("layers.")}


def _layers(spec: ModelSpec, target: Mapping[str, torch.Tensor], noise: float) -> dict[str, torch.Tensor]:
    """Copies of the target's first speculator_layers layers; with noise, each tensor t gets
    t + noise * rms(t) * N(0, 1), seeded by (spec.seed, name)."""
    if spec.speculator_layers > spec.layers:
        raise ConfigError(f"model {spec.name!r}: speculator_layers={spec.speculator_layers} exceeds "
                          f"layers={spec.layers}")
    if not model_of(spec).speculator.copies_target:  # a hybrid target's layers: seeded dense layers instead
        target = hybrid_mtp_layers(spec)
    out = {}
    for name, t in target.items():
        if not name.startswith("layers.") or int(name.split(".")[1]) >= spec.speculator_layers:
            continue
        if noise > 0:
            rms = t.pow(2).mean().sqrt()
            t = t + noise * rms * _noise(spec.seed, name, tuple(t.shape))
        out[name] = t.clone()
    return out


def draft_weights(spec: ModelSpec, target: Mapping[str, torch.Tensor], noise: float) -> dict[str, torch.Tensor]:
    """The draft model: target's first layers (+ noise), final norm and lm_head; canonical names."""
    return {**_shared(spec, target), **_layers(spec, target, noise)}


def mtp_weights(spec: ModelSpec, target: Mapping[str, torch.Tensor], hidden_mix: float) -> dict[str, torch.Tensor]:
    """The MTP module: decoder layer(s) copied from the target's first layers, its own final norm (a copy
    of the target's), shared embedding and lm_head, and eh_proj [H, 2H] acting on
    concat[hnorm(h); enorm(e)] (both norms unit weight, so each half has rms ~1):
        eh_proj = [hidden_mix * s * I | s * I],   s = rms of the target's embedding matrix,
    i.e. the MTP input is the token embedding at the scale the first layer expects, plus the target's
    hidden state mixed in with relative weight hidden_mix."""
    embed = target["embed.weight"]
    scale = float(embed.pow(2).mean().sqrt())
    eye = torch.eye(spec.hidden, dtype=torch.float32)
    return {**_shared(spec, target), **_layers(spec, target, 0.0),
            "eh_proj.weight": torch.cat([hidden_mix * scale * eye, scale * eye], dim=1),  # [H, 2H]
            "hnorm.weight": torch.ones(spec.hidden), "enorm.weight": torch.ones(spec.hidden)}


def speculator_weights(kind: str, spec: ModelSpec, target: Mapping[str, torch.Tensor],
                       settings: SpeculativeSettings) -> dict[str, torch.Tensor]:
    """The speculator's full (unsharded) weights: a checkpoint's own MTP layer where it holds one
    (spec.nextn_layers: harness/formats/hf/deepseek_mtp.py), else built from the target's (above)."""
    if kind == "draft":
        return draft_weights(spec, target, settings.draft_noise)
    if kind == "mtp" and spec.nextn_layers and spec.source == "hf":
        return {**_shared(spec, target), **load_mtp_weights(spec)}
    if kind == "mtp":
        return mtp_weights(spec, target, settings.mtp_hidden_mix)
    raise ConfigError(f"unknown speculator kind {kind!r}; valid: {', '.join(SPECULATOR_KINDS)}")
