"""The layout probe's hybrid part (Qwen3-Next in vLLM: Gated DeltaNet linear attention, gated full attention, MoE
with a shared expert), written as the rank report's `hybrid` record (harness/records/rankreport.py HybridReport).

At load time the linear attention's in_proj_qkvz rows (q|k|v|z packed per K head: one contiguous row shard per
rank) are matched against the checkpoint tensor's row shards, so the K / V heads a rank reports are those whose
rows it really loaded (a loader that cut another rank's slice shows); the conv1d's rows (q | k | v channels, cut per
component by vLLM's mamba loader) are located in the checkpoint tensor per component, giving the [lo, hi) conv rows
the rank holds. After the cache is allocated the probe adds each layer's conv and recurrent state as vLLM bound
them (heads held, channels, bytes per slot), the experts (vLLM's RoutedExperts: local experts through its expert map,
columns per expert, its TP rank's column shard), the shared expert's columns and a checksum of the router.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable

from harness_vllm_probe.mla import recording
from harness_vllm_probe.moe import router_checksum

# id(in_proj_qkvz linear) -> the checkpoint row shard its weight equals (None: none); its rows as loaded
_QKVZ_SHARD: dict[int, int | None] = {}
_ROWS: dict[int, Any] = {}
# id(conv1d weight parameter) -> (the checkpoint conv tensor [C, 1, K], the rows the rank holds [C_local, 1, K])
_CONV: dict[int, tuple[Any, Any]] = {}


def recording_merged(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap MergedColumnParallelLinear's loader (mla.recording): an in_proj_qkvz keeps the checkpoint shard its rows
    equal and its rows."""
    return recording(load, lambda prefix: prefix.endswith("in_proj_qkvz"), _QKVZ_SHARD, _ROWS)


def recording_conv_loader(make: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's mamba_v2_sharded_weight_loader factory: each loader it makes keeps the conv tensor and rows."""

    @functools.wraps(make)
    def factory(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        inner = make(*args, **kwargs)

        def loader(param: Any, loaded_weight: Any) -> Any:
            out = inner(param, loaded_weight)
            try:
                _CONV[id(param)] = (loaded_weight.detach().float().clone(), param.data.detach().float().clone())
            except Exception:  # the probe never breaks a load
                pass
            return out

        return loader

    factory.__harness_probe__ = True  # type: ignore[attr-defined]
    return factory


def _conv_rows(full: Any, held: Any, sizes: list[int], totals: list[int]) -> list[list[int]]:
    """Where each component's held rows (sizes) lie in the checkpoint tensor (components of `totals` rows, q|k|v):
    [lo, hi) per component, or [-1, -1] where no aligned slice of it equals them."""
    import torch

    out, offset, start = [], 0, 0
    for size, total in zip(sizes, totals):
        part = held[offset:offset + size]
        found = [-1, -1]
        for lo in range(start, start + total - size + 1, max(1, size)):
            if torch.equal(full[lo:lo + size], part):
                found = [lo, lo + size]
                break
        out.append(found)
        offset, start = offset + size, start + total
    return out


def gdn_layers(model: Any) -> list[tuple[str, Any]]:
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "in_proj_qkvz") and hasattr(m, "A_log")]


def _digest(tensors: list[Any]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _state_bytes(layer: Any) -> tuple[int, int, int, int]:
    """(slots, conv channels, recurrent heads, bytes per slot of conv + recurrent state) as vLLM bound them."""
    cache = layer.kv_cache
    conv, ssm = cache[0], cache[1]
    slots = int(ssm.shape[0])
    per_slot = (conv[0].numel() * conv.element_size() + ssm[0].numel() * ssm.element_size()) if slots else 0
    channels = int(max(conv.shape[1], conv.shape[2]))  # (slots, dim, width - 1) or (slots, width - 1, dim)
    return slots, channels, int(ssm.shape[1]), int(per_slot)


def linear_record(layers: list[tuple[str, Any]], tp_rank: int) -> tuple[dict[str, Any], int]:
    """The rank's linear-attention record: V / K heads as loaded (in_proj_qkvz's checkpoint shard; the shard
    parameters' own where none matched), the conv rows per component, the state as allocated (bytes per slot over
    every linear layer); and the state slots vLLM allocated."""
    _, first = layers[0]
    nk, nv, tp = int(first.num_k_heads), int(first.num_v_heads), int(first.tp_size)
    nk_l, nv_l = nk // tp, nv // tp
    shards = [_QKVZ_SHARD.get(id(m.in_proj_qkvz)) for _, m in layers]
    off = [s for s in shards if s is not None and s != tp_rank]
    shard = off[0] if off else tp_rank
    dk, dv = int(first.head_k_dim), int(first.head_v_dim)
    sizes, totals = [nk_l * dk, nk_l * dk, nv_l * dv], [nk * dk, nk * dk, nv * dv]
    claimed = [[start + tp_rank * size, start + (tp_rank + 1) * size]
               for size, start in zip(sizes, (0, nk * dk, 2 * nk * dk))]
    found = [_conv_rows(*_CONV[id(m.conv1d.weight)], sizes, totals) for _, m in layers if id(m.conv1d.weight) in _CONV]
    conv_rows = next((rows for rows in found if rows != claimed), claimed)  # a layer cut off its shard wins
    slots, channels, heads, per_slot = _state_bytes(first)
    weights = [_ROWS[id(m.in_proj_qkvz)] for _, m in layers if id(m.in_proj_qkvz) in _ROWS]
    weights += [_CONV[id(m.conv1d.weight)][1] for _, m in layers if id(m.conv1d.weight) in _CONV]
    v_heads = list(range(shard * nv_l, (shard + 1) * nv_l))
    return {"v_heads": v_heads, "k_heads": list(range(shard * nk_l, (shard + 1) * nk_l)), "out_v_heads": v_heads,
            "conv_rows": conv_rows, "state_digests": [], "weight_checksum": _digest(weights) if weights else "",
            "recurrent_heads": heads, "conv_channels": channels, "state_bytes_per_slot": per_slot * len(layers)}, slots


def _expert_ids(experts: Any) -> list[int]:
    manager = getattr(experts, "expert_map_manager", None)
    emap = getattr(manager, "expert_map", None) if manager is not None else None
    total = int(experts.global_num_experts)
    if emap is None:
        return list(range(total))
    local = {int(emap[e]): e for e in range(total) if int(emap[e]) >= 0}
    return [local[j] for j in sorted(local)]


def moe_record(model: Any) -> dict[str, Any] | None:
    """The first MoE block's experts as vLLM holds them: local experts (global ids through the expert map), columns
    per expert and the MoE TP rank's column shard, the shared expert's columns, the router's checksum."""
    block = next((m for _, m in model.named_modules() if hasattr(m, "shared_expert_gate") and hasattr(m, "experts")),
                 None)
    if block is None:
        return None
    experts = next((m for m in block.modules() if type(m).__name__ == "RoutedExperts"), None)
    if experts is None:
        return None
    config = experts.moe_config
    columns = int(config.intermediate_size_per_partition)
    moe_tp_rank = int(config.tp_rank)
    shared = getattr(block, "shared_expert", None)
    gate_up = getattr(shared, "gate_up_proj", None) if shared is not None else None
    shared_columns = int(gate_up.output_size_per_partition) // 2 if gate_up is not None else 0
    return {"experts": _expert_ids(experts), "expert_ffn_shard": [moe_tp_rank * columns, (moe_tp_rank + 1) * columns],
            "expert_columns": columns, "shared_columns": shared_columns,
            "router_checksum": router_checksum(block.gate)}
