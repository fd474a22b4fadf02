"""An MLA model's MTP layer in DeepSeek-V3's checkpoint format, and back.

DeepSeek-V3 keeps its MTP module as decoder layer `num_hidden_layers` of the checkpoint (config
`num_nextn_predict_layers`): `model.layers.{L}.` + the layer's own attention / MLP / norm tensors under their usual
names, plus `enorm`, `hnorm`, `eh_proj` (acting on concat[enorm(embedding); hnorm(hidden)]), `shared_head.norm`
(its final norm), `shared_head.head` (its lm_head) and `embed_tokens` (a copy of the target's). The embedded
engine's MTP weights (harness/formats/speculator.py: `layers.0.*`, `eh_proj.weight` on concat[hidden;
embedding], `hnorm.weight`, `enorm.weight`, `norm.weight`, `lm_head.weight`) are written with eh_proj's two column
blocks swapped and the latent attention's RoPE rows interleaved as the target's (checkpoint.py), and read back the same
way, so a folder's MTP layer is the module the embedded engine ran before the export.
"""

from __future__ import annotations

import dataclasses

import torch

from harness.core.errors import ConfigError
from harness.formats.hf.adapter import Weights
from harness.formats.hf.deepseek import mtp_prefix, rope_rows_halves, rope_rows_interleaved
from harness.formats.hf.names import canonical_from_hf, hf_name
from harness.specs.model import ModelSpec

# the MTP layer's own tensors beside its decoder layer: file suffix -> canonical MTP name (None: not kept)
MTP_OWN: dict[str, str | None] = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                                  "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "norm.weight",
                                  "shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": None}


def _one_layer(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, layers=1, moe=None, nextn_layers=0)


def _swap_halves(eh_proj: torch.Tensor, hidden: int) -> torch.Tensor:
    """[H, 2H] with its two column blocks swapped: [hidden | embedding] <-> [embedding | hidden]."""
    return torch.cat([eh_proj[:, hidden:], eh_proj[:, :hidden]], dim=1)


def check_exportable(spec: ModelSpec) -> None:
    """DeepSeek-V3's format holds one MTP layer per step of a one-layer module, dense beside a dense target."""
    if spec.nextn_layers != 1 or spec.speculator_layers != 1 or spec.moe is not None:
        raise ConfigError(f"model {spec.name!r}: an MTP layer is exported in DeepSeek-V3's format for nextn_layers 1, "
                          f"speculator_layers 1 and a model without experts (DeepSeek-V3's MTP layer beside experts "
                          f"is itself an MoE layer); got nextn_layers={spec.nextn_layers}, speculator_layers="
                          f"{spec.speculator_layers}, experts={spec.moe is not None}")


def to_deepseek_mtp(spec: ModelSpec, mtp: Weights) -> Weights:
    """The embedded engine's MTP weights (spec_weights.mtp_weights) -> DeepSeek-V3's MTP layer tensors by file name."""
    check_exportable(spec)
    prefix = mtp_prefix(spec)
    layer = rope_rows_interleaved(_one_layer(spec), {n: t for n, t in mtp.items() if n.startswith("layers.")})
    out = {hf_name(name).replace("model.layers.0.", prefix, 1): t for name, t in layer.items()}
    head = mtp.get("lm_head.weight", mtp["embed.weight"])
    out.update({prefix + "enorm.weight": mtp["enorm.weight"], prefix + "hnorm.weight": mtp["hnorm.weight"],
                prefix + "eh_proj.weight": _swap_halves(mtp["eh_proj.weight"], spec.hidden),
                prefix + "shared_head.norm.weight": mtp["norm.weight"], prefix + "shared_head.head.weight": head,
                prefix + "embed_tokens.weight": mtp["embed.weight"]})
    return out


def from_deepseek_mtp(spec: ModelSpec, tensors: dict[str, torch.Tensor], where: str) -> Weights:
    """DeepSeek-V3's MTP layer tensors (file names, is_mtp_tensor) -> the embedded engine's MTP weights (float32);
    one ConfigError naming the folder and the first missing or unknown tensor."""
    check_exportable(spec)
    prefix = mtp_prefix(spec)
    layer: Weights = {}
    own: Weights = {}
    for key, t in tensors.items():
        rest = key.removeprefix(prefix)
        if rest in MTP_OWN:
            if MTP_OWN[rest] is not None:
                own[str(MTP_OWN[rest])] = t.to(torch.float32)
            continue
        name = canonical_from_hf("model.layers.0." + rest)
        if name is None or not key.startswith(prefix):
            raise ConfigError(f"{where}: tensor {key!r} is not part of a DeepSeek-V3 MTP layer")
        layer[name] = t.to(torch.float32)
    wanted = [n for n in MTP_OWN.values() if n is not None and not (n == "lm_head.weight" and spec.tied_embeddings)]
    missing = [n for n in wanted if n not in own]
    if missing:
        raise ConfigError(f"{where}: the MTP layer (num_nextn_predict_layers {spec.nextn_layers}) has no "
                          f"{prefix}{next(k for k, v in MTP_OWN.items() if v == missing[0])}")
    own["eh_proj.weight"] = _swap_halves(own["eh_proj.weight"], spec.hidden)
    if spec.tied_embeddings:
        own.pop("lm_head.weight", None)
    return {**rope_rows_halves(_one_layer(spec), layer), **own}
