"""A vLLM general plugin that makes each worker report the layout it actually holds, for the harness's
`layout` check on vLLM. Inactive unless HARNESS_VLLM_PROBE_DIR is set (the harness's HTTP backend sets it
to a folder of the run directory; the template's `layout_report_env`).

In each worker, after vLLM allocated its KV cache (Worker.initialize_from_config), the probe writes
`rank<R>.json` (R: the tensor-parallel rank) with:
  - tp rank / size and DCP rank / size / group members, from vLLM's parallel state;
  - per attention layer: the global Q and KV head ids the layer's QKV projection holds. The ids come from
    the layer's own shard parameters (num_heads, num_kv_heads, num_kv_head_replicas, tp_rank) and, for what
    was really loaded, from the weight loader: after each q / k / v shard load the probe finds which
    checkpoint shard the parameter's rows equal (so a loader that cut another rank's shard shows);
  - a checksum of each held KV head's K and V weights (over all layers);
  - the KV cache as vLLM allocated it: blocks, block size, bytes per token (from the KV cache spec's page
    size), the bytes of the KV tensors bound to the attention layers, and the budget vLLM sized it from.
MLA layers (DeepSeek-V2/V3: multi-head latent attention) report what mla.py finds instead of Q/K/V head ids: the
Q heads whose Q weights (q_proj, kv_b's w_kc) a rank loaded, with checksums, the latent cache's row width and bytes,
the latent projection's checksum as the one KV head every rank duplicates.
Hybrid models (Qwen3-Next: Gated DeltaNet, gated attention, MoE with a shared expert) add a `hybrid` record
(gdn.py): the linear-attention heads and conv rows as loaded, their conv and recurrent state as allocated, the
experts and the shared expert each rank holds.
When the folder also holds the harness's capture-cases.json, forward hooks capture each layer's hidden state
and per-head attention output at the cases' probe positions (capture.py).
The harness process never imports vLLM: it only reads these files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from harness_vllm_probe import gdn, mla, moe

PROBE_ENV = "HARNESS_VLLM_PROBE_DIR"
SCHEMA = 1

# id(QKVParallelLinear) -> {"q"|"k"|"v": index of the checkpoint shard its rows equal (None: none equal)}
_LOADED: dict[int, dict[str, int | None]] = {}
# id(QKVParallelLinear) -> {"k"|"v": sha256 of each local KV head's rows, taken right after the load (the CPU
# backend repacks the weights afterwards, leaving the parameter empty)}
_SUMS: dict[int, dict[str, list[str]]] = {}


def _shard_geometry(layer: Any, shard: str) -> tuple[int, int, int]:
    """(row offset in the fused weight, rows of one shard, how many shards the checkpoint tensor has)."""
    q_rows = layer.num_heads * layer.head_size
    kv_rows = layer.num_kv_heads * layer.head_size
    if shard == "q":
        return 0, q_rows, layer.total_num_heads // layer.num_heads
    v_rows = layer.num_kv_heads * getattr(layer, "v_head_size", layer.head_size)
    count = max(1, layer.total_num_kv_heads // layer.num_kv_heads)
    return (q_rows, kv_rows, count) if shard == "k" else (q_rows + kv_rows, v_rows, count)


def _which_shard(layer: Any, param: Any, loaded_weight: Any, shard: str) -> int | None:
    """Which shard of the checkpoint tensor `loaded_weight` the parameter's `shard` rows now equal."""
    import torch

    offset, rows, count = _shard_geometry(layer, shard)
    data = getattr(param, "data", param)
    if data.dim() < 1 or data.shape[0] < offset + rows or loaded_weight.shape[0] < rows * count:
        return None
    held = data.narrow(0, offset, rows)
    for index in range(count):
        candidate = loaded_weight.narrow(0, index * rows, rows).to(held.dtype)
        if candidate.shape == held.shape and torch.equal(candidate, held):
            return index
    return None


def _head_sums(layer: Any, param: Any, shard: str) -> list[str]:
    offset, rows, _ = _shard_geometry(layer, shard)
    data = getattr(param, "data", param)
    head = rows // max(1, layer.num_kv_heads)
    return [hashlib.sha256(data.narrow(0, offset + j * head, head).detach().float().contiguous().numpy().tobytes())
            .hexdigest() for j in range(layer.num_kv_heads)]


def _recording(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def loader(self: Any, param: Any, loaded_weight: Any, loaded_shard_id: Any = None, *args: Any,
               **kwargs: Any) -> Any:
        out = load(self, param, loaded_weight, loaded_shard_id, *args, **kwargs)
        if loaded_shard_id in ("q", "k", "v") and getattr(param, "output_dim", 0) == 0:
            try:
                _LOADED.setdefault(id(self), {})[loaded_shard_id] = _which_shard(self, param, loaded_weight,
                                                                                 loaded_shard_id)
                if loaded_shard_id in ("k", "v"):
                    _SUMS.setdefault(id(self), {})[loaded_shard_id] = _head_sums(self, param, loaded_shard_id)
            except Exception:  # the probe never breaks a load
                _LOADED.setdefault(id(self), {})[loaded_shard_id] = None
        return out

    loader.__harness_probe__ = True  # type: ignore[attr-defined]
    return loader


def _ids(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def _layer_report(name: str, qkv: Any, attn: Any) -> dict[str, Any]:
    """What one attention layer holds: global Q / KV head ids from its shard parameters, and as loaded."""
    replicas = max(1, int(getattr(qkv, "num_kv_head_replicas", 1)))
    # Q heads: the attention's (a gated attention's QKV projection also holds each head's gate rows: Qwen3-Next)
    nq, nkv = int(getattr(attn, "num_heads", qkv.num_heads)), int(qkv.num_kv_heads)
    claimed_q = _ids(qkv.tp_rank * nq, nq)
    claimed_kv = _ids((qkv.tp_rank // replicas) * nkv, nkv)
    loaded = _LOADED.get(id(qkv), {})
    q_shard, k_shard, v_shard = loaded.get("q"), loaded.get("k"), loaded.get("v")
    return {
        "layer": name, "tp_rank": int(qkv.tp_rank), "num_heads": nq, "num_kv_heads": nkv,
        "num_kv_head_replicas": replicas, "head_size": int(qkv.head_size),
        "attn_num_heads": int(getattr(attn, "num_heads", nq)),
        "attn_num_kv_heads": int(getattr(attn, "num_kv_heads", nkv)),
        "claimed_q_heads": claimed_q, "claimed_kv_heads": claimed_kv,
        "q_heads": _ids(q_shard * nq, nq) if q_shard is not None else None,
        "k_heads": _ids(k_shard * nkv, nkv) if k_shard is not None else None,
        "v_heads": _ids(v_shard * nkv, nkv) if v_shard is not None else None,
    }


def _kv_checksums(layers: list[tuple[str, Any, Any]], kv_ids: list[int]) -> dict[str, str]:
    """sha256 over every layer (in layer order) of each held KV head's K and V weight rows as loaded."""
    sums = {kv: hashlib.sha256() for kv in kv_ids}
    for _, qkv, _ in layers:
        loaded = _SUMS.get(id(qkv), {})
        for j, kv in enumerate(kv_ids[:qkv.num_kv_heads]):
            for shard in ("k", "v"):
                sums[kv].update((loaded.get(shard) or ["not-recorded"] * (j + 1))[j].encode())
    return {str(kv): h.hexdigest() for kv, h in sums.items()}


def _kv_tensor_bytes(attn_layers: list[Any]) -> int:
    import torch

    seen, total = set(), 0
    for attn in attn_layers:
        caches = attn.kv_cache if isinstance(attn.kv_cache, (list, tuple)) else [attn.kv_cache]
        for t in caches:
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def report(worker: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The layout self-report of one worker after its KV cache is allocated."""
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.linear import QKVParallelLinear

    model = worker.model_runner.get_model()
    mla_found = mla.mla_layers(model)
    layers = []
    for name, module in model.named_modules():
        qkv, attn = getattr(module, "qkv_proj", None), getattr(module, "attn", None)
        if isinstance(qkv, QKVParallelLinear) and isinstance(attn, Attention):
            layers.append((name, qkv, attn))
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    dcp = ps.get_dcp_group()
    # the attention layers' group(s): a hybrid model's state groups (Gated DeltaNet) hold no K/V heads, and vLLM pads
    # their attention pages to the state page size (the unpadded page is what a token's K/V take)
    groups = [g for g in kv_cache_config.kv_cache_groups if hasattr(g.kv_cache_spec, "num_kv_heads")] or list(
        kv_cache_config.kv_cache_groups)
    spec = groups[0].kv_cache_spec if groups else None
    block_size = int(spec.block_size) if spec is not None else None
    per_layer_page = int(getattr(spec, "unpadded_page_size_bytes", spec.page_size_bytes)) if spec is not None else 0
    attn_layers = sum(len(g.layer_names) for g in groups)
    reports = [_layer_report(name, qkv, attn) for name, qkv, attn in layers]
    mla_reports = [mla.layer_report(name, w, tp_rank) for name, w in mla_found]
    extra = mla.rank_record(mla_found, mla_reports) if mla_reports else {}
    experts = moe.experts_record(model)
    if experts is not None:
        extra["experts"] = experts
    bound = ([w.mla_attn for _, w in mla_found] if mla_found else [a for _, _, a in layers])
    gdn_found = gdn.gdn_layers(model)
    if gdn_found:
        extra["hybrid"] = _hybrid_record(gdn_found, model, tp_rank, kv_cache_config, bound)
    return {
        "schema_version": SCHEMA, "pid": os.getpid(),
        "tp_rank": tp_rank, "tp_size": tp_size, "dcp_rank": dcp.rank_in_group, "dcp_size": dcp.world_size,
        "dcp_members": list(dcp.ranks), "layers": reports + mla_reports,
        "kv_weight_checksums": _kv_checksums(layers, next((r["k_heads"] for r in reports if r["k_heads"]),
                                                        reports[0]["claimed_kv_heads"] if reports else [])),
        **extra,
        "kv_cache": {"num_blocks": int(kv_cache_config.num_blocks), "block_size": block_size,
                     "bytes_per_token": per_layer_page * attn_layers // block_size if block_size else None,
                     "tensor_bytes": sum(int(t.size) for t in kv_cache_config.kv_cache_tensors),
                     "bound_bytes": _kv_tensor_bytes(bound),
                     "budget_bytes": getattr(worker, "_harness_kv_budget", None),
                     "sizing": "blocks",  # vLLM allocates floor(budget / page bytes) blocks, not whole sequences
                     "max_model_len": int(worker.model_config.max_model_len)},
    }


def _hybrid_record(gdn_found: list[tuple[str, Any]], model: Any, tp_rank: int, kv_cache_config: Any,
                   bound: list[Any]) -> dict[str, Any]:
    """The rank's hybrid record: linear attention and its state, experts, and the cache groups as vLLM allocated
    them (one block count shared by the attention pages and the state slots)."""
    linear, slots = gdn.linear_record(gdn_found, tp_rank)
    state_bytes = sum(int(t.numel() * t.element_size()) for _, m in gdn_found for t in m.kv_cache[:2])
    blocks = int(kv_cache_config.num_blocks)
    groups = {"slots": slots, "attention_blocks": blocks, "attention_blocks_per_seq": 1, "state_slots": slots,
              "state_bytes": state_bytes, "attention_bytes": _kv_tensor_bytes(bound)}
    return {"linear": linear, "moe": gdn.moe_record(model), "cache_groups": groups}


def _write(folder: Path, data: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{data['tp_rank']}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def register() -> None:
    """vLLM calls this in every process (API server, engine core, workers) before the model is built."""
    folder = os.environ.get(PROBE_ENV)
    if not folder:
        return
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
    from vllm.v1.worker.gpu_worker import Worker

    from harness_vllm_probe import capture

    capture.register(folder)
    moe.register()
    for cls, attrs in ((ColumnParallelLinear, ("weight_loader", "weight_loader_v2")),
                       (ReplicatedLinear, ("weight_loader",))):
        for attr in attrs:
            current = vars(cls).get(attr)
            if current is not None and not getattr(current, "__harness_probe__", False):
                if cls is ReplicatedLinear:  # an MoE router (replicated): its weight as loaded, for its checksum
                    current = mla.recording(current, moe.is_router, moe.ROUTER_SHARDS, moe.ROUTER_ROWS)
                setattr(cls, attr, mla.recording(current))
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    for attr in ("weight_loader", "weight_loader_v2"):
        current = vars(MergedColumnParallelLinear).get(attr)
        if current is not None and not getattr(current, "__harness_probe__", False):
            setattr(MergedColumnParallelLinear, attr, gdn.recording_merged(current))
    try:  # Qwen3-Next's conv1d loader (vLLM's mamba sharded loader, looked up in its module when a layer is built)
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qgdn
    except Exception:  # a build without it
        qgdn = None
    if qgdn is not None and not getattr(qgdn.mamba_v2_sharded_weight_loader, "__harness_probe__", False):
        qgdn.mamba_v2_sharded_weight_loader = gdn.recording_conv_loader(qgdn.mamba_v2_sharded_weight_loader)
    for attr in ("weight_loader", "weight_loader_v2"):
        current = getattr(QKVParallelLinear, attr)
        if not getattr(current, "__harness_probe__", False):
            setattr(QKVParallelLinear, attr, _recording(current))
    if getattr(Worker.initialize_from_config, "__harness_probe__", False):
        return
    allocate, available = Worker.initialize_from_config, Worker.determine_available_memory

    @functools.wraps(available)
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        budget = available(self, *args, **kwargs)
        self._harness_kv_budget = int(budget)  # what vLLM sizes the KV cache from (bytes per rank)
        return budget

    @functools.wraps(allocate)
    def initialize_from_config(self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        out = allocate(self, kv_cache_config, *args, **kwargs)
        try:
            data = report(self, kv_cache_config)
        except Exception as exc:  # a report that says why, never a crashed worker
            import traceback

            data = {"schema_version": SCHEMA, "tp_rank": getattr(self, "rank", 0), "error": repr(exc),
                    "traceback": traceback.format_exc()}
        _write(Path(folder), data)
        return out

    initialize_from_config.__harness_probe__ = True  # type: ignore[attr-defined]
    Worker.initialize_from_config = initialize_from_config
    Worker.determine_available_memory = determine_available_memory
    # CPUWorker defines its own determine_available_memory: wrap it too
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except Exception:  # not the CPU build
        return
    if "determine_available_memory" in vars(CPUWorker):
        cpu_available = CPUWorker.determine_available_memory

        @functools.wraps(cpu_available)
        def cpu_determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
            budget = cpu_available(self, *args, **kwargs)
            self._harness_kv_budget = int(budget)
            return budget

        CPUWorker.determine_available_memory = cpu_determine_available_memory
