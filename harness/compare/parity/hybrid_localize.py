"""Localization wording for hybrid models: which kind of layer diverged (Gated DeltaNet linear
attention or gated full attention) and whether its token mixer or its FFN (MoE: router, routed experts,
shared expert) did, from the model spec in the run's manifest."""

from __future__ import annotations

from harness.core.errors import ConfigError
from harness.core.verdict import Localization
from harness.partition.hybrid_layout import FULL, HybridShape, layer_kinds
from harness.records.artifacts import RunArtifacts
from harness.specs.loader import build

__all__ = ["FULL", "hybrid_layer_kind", "hybrid_localization"]


def hybrid_layer_kind(run: RunArtifacts, layer: int) -> str | None:
    """`linear` or `full` for layer `layer` of a hybrid model's run, None for a dense model."""
    model = run.manifest.get("model")
    raw = model.get("hybrid") if isinstance(model, dict) else None
    if not isinstance(raw, dict) or not isinstance(model.get("layers"), int):
        return None
    try:
        shape = build(HybridShape, "manifest model hybrid", raw)
    except ConfigError:
        return None
    kinds = layer_kinds(model["layers"], shape.full_attention_interval)
    return kinds[layer] if 0 <= layer < len(kinds) else None


def hybrid_localization(layer: int, kind: str, mixer_diverges: bool, err: str) -> Localization:
    """The summary for a first diverging hybrid layer (a full-attention layer whose heads diverge is
    named by its heads instead); `mixer_diverges`: the linear layer's output is beyond its noise."""
    what = "gated full attention" if kind == FULL else "Gated DeltaNet linear attention"
    if mixer_diverges:
        summary = (f"layer {layer}, {what}: its output diverges ({err}): the in_proj / conv1d shards, the "
                   f"recurrent state or the out projection of this linear-attention layer")
    else:
        # the component blamed leads: the layer's token mixer is within noise, so naming it first misleads
        summary = (f"layer {layer}, the FFN (MoE: router, routed experts or shared expert), norm or residual: "
                   f"residual stream diverges ({err}) while the layer's token mixer ({what}) stays within noise")
    return Localization(layer=layer, heads=(), ranks=(), kv_heads=(), summary=summary)
