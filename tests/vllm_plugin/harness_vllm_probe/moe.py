"""The layout probe's mixture-of-experts part (DeepSeek-V2/V3 in vLLM: RoutedExperts under a FusedMoE runner).

At load time each routed-expert weight load is watched: the local slot whose rows the load changed is the slot that
now holds that checkpoint expert (found from the data, so it holds whatever wraps the loader, a fault included).
Per rank the report then says, for the first MoE layer: the experts it routes to (the global ids its expert map
gives its slots), the checkpoint expert each slot loaded, its columns per expert and its [lo, hi) share of each
expert's FFN (its expert-TP rank), its shared-expert columns and a checksum of its router (replicated).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable

# id(RoutedExperts) -> local slot -> the checkpoint expert whose gate_proj (w1) rows it loaded
_LOADED: dict[int, dict[int, int]] = {}
# id(router linear) -> the checkpoint row shard it equals (0: replicated) and its weight as loaded: the CPU backend
# repacks linear weights after loading, leaving the module's own `weight` empty (mla.recording keeps them)
ROUTER_SHARDS: dict[int, int | None] = {}
ROUTER_ROWS: dict[int, Any] = {}


def is_router(prefix: str) -> bool:
    """Whether the linear at `prefix` is an MoE block's router (DeepSeek-V2's and Qwen3-Next's `mlp.gate`)."""
    return prefix.endswith(".gate")


def router_checksum(router: Any) -> str:
    """A checksum of the router linear's weight as loaded (its own weight where the load was not seen), or
    'not-recorded' without either."""
    rows = ROUTER_ROWS.get(id(router)) if router is not None else None
    if rows is None:
        weight = getattr(router, "weight", None)
        rows = weight if weight is not None and weight.numel() else None
    return _digest(rows) if rows is not None else "not-recorded"


def recording(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap RoutedExperts.weight_loader: a w1 (gate_proj) load records the slot it changed and the expert it came
    from."""

    @functools.wraps(load)
    def loader(self: Any, param: Any, loaded_weight: Any, weight_name: str, shard_id: str, expert_id: int,
               *args: Any, **kwargs: Any) -> Any:
        import torch

        watch = shard_id == "w1" and str(weight_name).endswith("weight") and getattr(param, "dim", lambda: 0)() == 3
        before = param.data.detach().clone() if watch else None
        out = load(self, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs)
        if before is not None:
            try:
                changed = (before != param.data).flatten(1).any(dim=1)  # [E_local]
                for slot in torch.nonzero(changed).flatten().tolist():
                    _LOADED.setdefault(id(self), {})[int(slot)] = int(expert_id)
            except Exception:  # the probe never breaks a load
                pass
        return out

    loader.__harness_probe__ = True  # type: ignore[attr-defined]
    return loader


def register() -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    current = vars(RoutedExperts)["weight_loader"]
    if not getattr(current, "__harness_probe__", False):
        RoutedExperts.weight_loader = recording(current)


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def experts_record(model: Any) -> dict[str, Any] | None:
    """The rank's record of its first MoE layer (None for a model without routed experts)."""
    modules = dict(model.named_modules())
    found = next(((name, m) for name, m in modules.items() if type(m).__name__ == "RoutedExperts"), None)
    if found is None:
        return None
    name, experts = found
    manager = experts.expert_map_manager
    columns = int(experts.intermediate_size_per_partition)
    tp_rank = int(manager.tp_rank)
    ids = [int(e) for e in manager.get_local_expert_ids()]
    loaded = _LOADED.get(id(experts), {})
    mlp = name.rsplit(".experts", 1)[0]  # ...layers.{i}.mlp(.experts.routed_experts) -> ...layers.{i}.mlp
    shared = modules.get(mlp + ".shared_experts")
    gate_up = getattr(shared, "gate_up_proj", None)
    router = modules.get(mlp + ".gate")
    return {"layer": mlp, "experts": ids, "expert_ffn_shard": [tp_rank * columns, (tp_rank + 1) * columns],
            "expert_columns": columns,
            "shared_columns": int(gate_up.output_size_per_partition) // 2 if gate_up is not None else 0,
            "router_checksum": router_checksum(router),
            "logical": [loaded.get(slot, -1) for slot in range(len(ids))] if loaded else []}
