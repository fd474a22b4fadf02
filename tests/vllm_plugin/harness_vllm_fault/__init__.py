"""A vLLM general plugin that gives vLLM a known tensor-parallel layout bug, for the harness's
positive control on a real third-party engine.

With HARNESS_VLLM_FAULT=kv-shard in the server's environment, tensor-parallel rank 1 loads the K and
V weight shard that belongs to another rank (rank (1 + 1) % tp) into its QKV projection. Nothing
crashes and every shape is right; attention on rank 1 silently uses the wrong KV heads.

With HARNESS_VLLM_FAULT=mla-kv-b-shard (an MLA model: DeepSeek-V2/V3), tensor-parallel rank 1 loads
kv_b_proj's rows of rank (1 + 1) % tp: its heads absorb another rank's w_kc / w_vc, so each of its Q heads scores
the latent with another head's key map and reads another head's values. Nothing crashes; shapes are right.
With HARNESS_VLLM_FAULT=moe-expert-map-offset (a model with routed experts: DeepSeek-V2/V3), tensor-parallel rank 1's
weight loader maps each global expert to the next local slot (its map offset by one) while its router uses the right
map: each of its slots holds the previous expert's weights, so its tokens reach the wrong experts' columns. Nothing
crashes; shapes are right.
With HARNESS_VLLM_FAULT=gdn-head-shard (a hybrid model: Qwen3-Next), tensor-parallel rank 1 loads
in_proj_qkvz's rows of rank (1 + 1) % tp: its Gated DeltaNet heads project q, k, v and the output gate z with
another rank's K-head group while its conv, decay, beta and output projection are its own. Nothing crashes.
With HARNESS_VLLM_FAULT=mtp-eh-proj-swap (a model with an MTP layer: DeepSeek-V3), the MTP module's loader swaps
eh_proj's two column blocks (the concat order of [enorm(embedding); hnorm(hidden)] mixed up): the MTP reads the token
embedding through the hidden state's weights and back. The target model is untouched (its output stays), only the
MTP's drafts change: a speculator bug that only acceptance sees.
Without the variable (or with any other value) the plugin changes nothing.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

FAULT_ENV = "HARNESS_VLLM_FAULT"
KV_SHARD = "kv-shard"
MLA_KV_B_SHARD = "mla-kv-b-shard"
MOE_EXPERT_MAP_OFFSET = "moe-expert-map-offset"
GDN_HEAD_SHARD = "gdn-head-shard"
MTP_EH_PROJ_SWAP = "mtp-eh-proj-swap"
FAULTY_RANK = 1


def _wrong_kv_shard(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a QKVParallelLinear weight loader: on the faulty rank, the k and v shards are cut at the next
    rank's offsets. The v1 loader picks the shard from the layer's tp_rank, the v2 loader from the
    parameter's (vLLM's BasevLLMParameter): both are shifted for the call."""

    @functools.wraps(load)
    def loader(self: Any, param: Any, loaded_weight: Any, loaded_shard_id: Any = None,
               *args: Any, **kwargs: Any) -> Any:
        rank, size = self.tp_rank, self.tp_size
        if loaded_shard_id not in ("k", "v") or size < 2 or rank != FAULTY_RANK:
            return load(self, param, loaded_weight, loaded_shard_id, *args, **kwargs)
        holders = [self] + ([param] if hasattr(param, "tp_rank") else [])
        for holder in holders:
            holder.tp_rank = (rank + 1) % size
        try:
            return load(self, param, loaded_weight, loaded_shard_id, *args, **kwargs)
        finally:
            for holder in holders:
                holder.tp_rank = rank

    return loader


def _wrong_kv_b_shard(load: Callable[..., Any], projection: str = "kv_b_proj") -> Callable[..., Any]:
    """Wrap a ColumnParallelLinear weight loader: on the faulty rank, the projection named `projection` (an MLA
    layer's kv_b_proj, Qwen3-Next's in_proj_qkvz) is cut at the next rank's offset (the v1 loader reads the layer's
    tp_rank, the v2 loader the parameter's)."""

    @functools.wraps(load)
    def loader(self: Any, param: Any, *args: Any, **kwargs: Any) -> Any:
        rank, size = getattr(self, "tp_rank", 0), getattr(self, "tp_size", 1)
        if not str(getattr(self, "prefix", "")).endswith(projection) or size < 2 or rank != FAULTY_RANK:
            return load(self, param, *args, **kwargs)
        holders = [self] + ([param] if hasattr(param, "tp_rank") else [])
        for holder in holders:
            holder.tp_rank = (rank + 1) % size
        try:
            return load(self, param, *args, **kwargs)
        finally:
            for holder in holders:
                holder.tp_rank = rank

    loader.__harness_fault__ = True  # type: ignore[attr-defined]
    return loader


def _patch(cls: Any, attr: str, wrap: Callable[[Any], Any]) -> None:
    """cls.attr replaced by wrap(cls.attr) once: a wrapper marked __harness_fault__ is not wrapped again."""
    current = vars(cls)[attr]
    if not getattr(current, "__harness_fault__", False):
        setattr(cls, attr, wrap(current))


def _register_mla_kv_b_shard() -> None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    for attr in ("weight_loader", "weight_loader_v2"):
        _patch(ColumnParallelLinear, attr, _wrong_kv_b_shard)
    print(f"harness_vllm_fault: {FAULT_ENV}={MLA_KV_B_SHARD}: TP rank {FAULTY_RANK} loads another rank's kv_b_proj "
          f"rows (MLA)", flush=True)


def _offset_map(to_local: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap RoutedExperts' global -> local expert id map of the weight loader: on the faulty TP rank, one slot on."""

    @functools.wraps(to_local)
    def mapped(self: Any, expert_id: int) -> int:
        from vllm.distributed import parallel_state as ps

        local = to_local(self, expert_id)
        if local < 0 or ps.get_tensor_model_parallel_world_size() < 2 or \
                ps.get_tensor_model_parallel_rank() != FAULTY_RANK:
            return local
        return (local + 1) % int(self.expert_map_manager.local_num_experts)

    mapped.__harness_fault__ = True  # type: ignore[attr-defined]
    return mapped


def _register_moe_expert_map_offset() -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    _patch(RoutedExperts, "_map_global_expert_id_to_local_expert_id", _offset_map)
    print(f"harness_vllm_fault: {FAULT_ENV}={MOE_EXPERT_MAP_OFFSET}: TP rank {FAULTY_RANK} loads each expert into the "
          f"next slot (its loader's expert map offset by one)", flush=True)


def _register_gdn_head_shard() -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    for attr in ("weight_loader", "weight_loader_v2"):
        _patch(MergedColumnParallelLinear, attr, lambda load: _wrong_kv_b_shard(load, "in_proj_qkvz"))
    print(f"harness_vllm_fault: {FAULT_ENV}={GDN_HEAD_SHARD}: TP rank {FAULTY_RANK} loads another rank's "
          f"in_proj_qkvz rows (Gated DeltaNet)", flush=True)


def _swapped_eh_proj(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap an MTP model's load_weights: each eh_proj.weight [H, 2H] arrives with its column halves swapped."""

    @functools.wraps(load)
    def loader(self: Any, weights: Any) -> Any:
        import torch

        def swapped() -> Any:
            for name, tensor in weights:
                if name.endswith("eh_proj.weight"):
                    half = tensor.shape[1] // 2
                    tensor = torch.cat([tensor[:, half:], tensor[:, :half]], dim=1)  # [H, 2H], halves swapped
                yield name, tensor

        return load(self, swapped())

    loader.__harness_fault__ = True  # type: ignore[attr-defined]
    return loader


def _register_mtp_eh_proj_swap() -> None:
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    _patch(DeepSeekMTP, "load_weights", _swapped_eh_proj)
    print(f"harness_vllm_fault: {FAULT_ENV}={MTP_EH_PROJ_SWAP}: the MTP layer's eh_proj is loaded with its "
          f"[embedding | hidden] column halves swapped", flush=True)


def register() -> None:
    """vLLM calls this in every process (API server and workers) before the model is built."""
    if os.environ.get(FAULT_ENV) == MLA_KV_B_SHARD:
        _register_mla_kv_b_shard()
    if os.environ.get(FAULT_ENV) == MOE_EXPERT_MAP_OFFSET:
        _register_moe_expert_map_offset()
    if os.environ.get(FAULT_ENV) == GDN_HEAD_SHARD:
        _register_gdn_head_shard()
    if os.environ.get(FAULT_ENV) == MTP_EH_PROJ_SWAP:
        _register_mtp_eh_proj_swap()
    if os.environ.get(FAULT_ENV) != KV_SHARD:
        return
    from vllm.model_executor.layers.linear import QKVParallelLinear

    if not hasattr(QKVParallelLinear.weight_loader, "__wrapped__"):
        QKVParallelLinear.weight_loader = _wrong_kv_shard(QKVParallelLinear.weight_loader)
        QKVParallelLinear.weight_loader_v2 = _wrong_kv_shard(QKVParallelLinear.weight_loader_v2)
        print(f"harness_vllm_fault: {FAULT_ENV}={KV_SHARD}: TP rank {FAULTY_RANK} loads another rank's K/V shard",
              flush=True)
