"""HarnessKVConnector: a vLLM KV connector (KVConnectorBase_V1) that moves a prompt's KV between a prefill and a decode
server of any TP sizes through the harness's KV store (harness_vllm_kv/store.py), and leaves per-rank records the
harness's pd_transfer / pd_load checks read.

    --kv-transfer-config '{"kv_connector": "HarnessKVConnector", "kv_connector_module_path": "harness_vllm_kv",
                           "kv_role": "kv_producer" | "kv_consumer", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store_root": ROOT}}'

A completion carrying kv_transfer_params {"namespace": NS, "requests": [index per prompt]} (what the harness's client
sends, harness/backends/http/pd.py) is a P/D request; prompt j of the completion is request requests[j] (vLLM numbers a
completion's prompts in their request ids: cmpl-<id>-<j>-<suffix>).

- Producer (prefill server): once a request's whole prompt is in the paged cache (the step that scheduled its last
  prompt token), each TP rank writes every prompt row of the KV heads it holds, with its layout (tp rank and size, the
  global KV head ids in slot order) and a digest per row, to ROOT/NS/req{i}/p{rank}.safetensors, then the commit marker.
- Consumer (decode server): a request whose entry has committed files is promised the prompt but its last token
  (get_num_new_matched_tokens; vLLM computes the last token, which picks the first new token); in that step, before
  the forward, each rank reads the KV heads it holds from the lowest committed prefill rank holding each (a tp1 rank
  reads both tp2 ranks' halves; a tp2 rank its half of a tp1 rank's heads), checks every row against its stored
  digest, writes the rows into its paged cache, and digests what its cache then holds. Any failure (a missing,
  uncommitted, cut or corrupt file, another prompt's entry, a load past its deadline) leaves the rows unused: the load
  is recorded failed and the request's blocks reported invalid (get_block_ids_with_load_errors), which vLLM answers
  with kv_load_failure_policy "recompute" by computing the prompt from position 0. A request without a committed
  entry is not promised at all (recorded failed, computed). Each rank's record of each step's loads goes to
  ROOT/NS/decode/d{rank}.b{n}.json (+ .safetensors with the held digests).

The KV cache read and written is vLLM CPU attention's ([blocks, kv_heads, block_size, 2 * head_size], each block's
and head's rows packed as its ISA's kernel packs them: harness_vllm_kv/layout.py); another layout is refused at the
first load or store (a recompute on the decode side, no entry on the prefill side).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index

from harness_vllm_kv import layout, store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
DEADLINE_S = 60.0  # a load that took longer is not used (its request is recomputed)


@dataclass
class Transfer:
    """One request's load (consumer) or store (producer) in one engine step."""

    req_id: str
    namespace: str
    index: int
    prompt: list[int]
    block_ids: list[int]
    tokens: int = 0          # a load: the rows to load (the prompt but its last token)
    error: str = ""          # a load the scheduler already knows cannot happen (no committed entry)


@dataclass
class HarnessKVMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


def request_index(req_id: str, params: dict[str, Any] | None) -> tuple[str, int] | None:
    """(namespace, store request index) of a P/D request, or None for another request."""
    if not params or "namespace" not in params or "requests" not in params:
        return None
    requests = list(params["requests"])
    try:
        position = int(req_id.rsplit("-", 2)[1]) if len(requests) > 1 else 0
    except (IndexError, ValueError):
        logger.warning("harness KV connector: request id %s names no prompt position; not a P/D request", req_id)
        return None
    if position >= len(requests):
        return None
    return str(params["namespace"]), int(requests[position])


def global_kv_heads(total: int, tp: int, rank: int) -> list[int]:
    """The global KV head ids TP rank `rank` of `tp` holds (vLLM's split: consecutive heads, or one head replicated
    over tp / total ranks when tp exceeds the KV heads)."""
    if tp <= total:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * total // tp]


class HarnessKVConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        self._root = Path(config.get_from_extra_config("store_root", ""))
        if not str(self._root):
            raise ValueError("HarnessKVConnector needs kv_connector_extra_config.store_root (the KV store folder)")
        self._producer = config.is_kv_producer
        self._consumer = config.is_kv_consumer
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._tagged: dict[str, tuple[str, int]] = {}
        self._need_load: dict[str, Transfer] = {}
        self._failed: dict[str, Transfer] = {}
        self._storing: dict[str, Transfer] = {}
        # worker side
        self._total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._layers: dict[str, torch.Tensor] = {}
        self._invalid: set[int] = set()
        self._steps = 0

    # -- scheduler side -------------------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        found = request_index(request.request_id, request.kv_transfer_params)
        if found is not None:
            self._tagged[request.request_id] = found

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if not self._consumer or rid not in self._tagged:
            return 0, False
        namespace, index = self._tagged[rid]
        prompt = list(request.prompt_token_ids or [])
        n = len(prompt) - 1
        error = ""
        if n <= 0:
            return 0, False
        if num_computed_tokens:
            error = f"the decode server holds {num_computed_tokens} of its tokens in its own prefix cache"
        elif not store.committed_ranks(self._root / namespace, index):
            error = f"no committed entry of request {index} in {self._root / namespace}"
        if error:
            self._failed[rid] = Transfer(rid, namespace, index, prompt, [], n, error)
            return 0, False
        self._failed.pop(rid, None)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens > 0 and rid in self._tagged:
            namespace, index = self._tagged[rid]
            self._need_load[rid] = Transfer(rid, namespace, index, list(request.prompt_token_ids or []), [],
                                            num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = HarnessKVMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            if rid in self._need_load:
                load = self._need_load.pop(rid)
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
            elif rid in self._failed:
                meta.loads.append(self._failed.pop(rid))
            if self._producer and rid in self._tagged:
                namespace, index = self._tagged[rid]
                self._storing[rid] = Transfer(rid, namespace, index, list(new.prompt_token_ids or []),
                                              list(new.block_ids[0]))
                if new.num_computed_tokens + scheduled.get(rid, 0) >= len(self._storing[rid].prompt):
                    meta.stores.append(self._storing.pop(rid))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._storing:
                continue
            job = self._storing[rid]
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                job.block_ids = (list(blocks[0]) if rid in cached.resumed_req_ids else job.block_ids + list(blocks[0]))
            if cached.num_computed_tokens[i] + scheduled.get(rid, 0) >= len(job.prompt):
                meta.stores.append(self._storing.pop(rid))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for table in (self._tagged, self._need_load, self._failed, self._storing):
            table.pop(rid, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------------------

    def _isa(self, layer_name: str) -> str:
        """The ISA CPU attention packs this layer's KV cache for (set on the layer by its metadata builder)."""
        layer = self._vllm_config.compilation_config.static_forward_context[layer_name]
        return str(getattr(layer, "isa", "vec"))

    def _attention_layers(self, forward_context: "ForwardContext") -> list[tuple[str, torch.Tensor]]:
        """The attention layers' paged KV caches, in model order."""
        out = []
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, list):
                kv = kv[0] if kv else None
            if isinstance(kv, torch.Tensor) and kv.numel():
                out.append((name, kv))
        return sorted(out, key=lambda item: extract_layer_index(item[0]))

    def _slots(self, kv: torch.Tensor, block_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel blocks and offsets of positions 0..n-1 of a request with `block_ids`, in vLLM CPU attention's
        cache [blocks, kv_heads, kernel block_size, 2 * head_size]."""
        if kv.dim() != 4 or kv.shape[1] != len(self._heads()):
            raise RuntimeError(f"the KV cache layout {tuple(kv.shape)} is not CPU attention's [blocks, "
                               f"{len(self._heads())} KV heads, block_size, 2 * head_size]")
        kernel = kv.shape[2]
        t = torch.arange(n)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        slot = blocks[t // self._block_size] * self._block_size + t % self._block_size
        return slot // kernel, slot % kernel

    def _rows(self, name: str, kv: torch.Tensor, block_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows [n, kv_heads, head_size] of positions 0..n-1."""
        return layout.read_rows(kv, self._isa(name), *self._slots(kv, block_ids, n))

    def _heads(self) -> list[int]:
        return global_kv_heads(self._total_kv_heads, get_tensor_model_parallel_world_size(),
                               get_tensor_model_parallel_rank())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HarnessKVMetadata)
        if not meta.loads:
            return
        self._steps += 1
        by_namespace: dict[str, tuple[list[dict[str, Any]], dict[str, torch.Tensor]]] = {}
        for load in meta.loads:
            records, tensors = by_namespace.setdefault(load.namespace, ([], {}))
            records.append(self._load(forward_context, load, tensors))
        rank = get_tensor_model_parallel_rank()
        for namespace, (records, tensors) in by_namespace.items():
            record = {"rank": rank, "loads": records, "pool": {"free_start": None, "free_end": None},
                      "policy": {"max_attempts": 1, "deadline_s": DEADLINE_S, "backoff_s": 0.0,
                                 "on_failure": "recompute"},
                      "block_size": self._block_size}
            try:
                store.write_decode_record(self._root / namespace, rank, self._steps, record, tensors)
            except OSError as exc:
                logger.error("harness KV connector: cannot write the load record into %s: %s", namespace, exc)

    def _load(self, forward_context: "ForwardContext", load: Transfer,
              tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One request's load on this rank: its record (loaded, or failed and its blocks reported invalid)."""
        start = time.monotonic()
        rank = get_tensor_model_parallel_rank()
        record = {"route": store.ROUTE, "request": load.index, "tokens": load.tokens, "state": "failed",
                  "attempts": [], "outcome": "recomputed", "resume_offset": 0, "blocks_held": len(load.block_ids),
                  "waited_s": 0.0}
        error = load.error
        if not error:
            try:
                held = self._place(forward_context, load)
                waited = time.monotonic() - start
                if waited > DEADLINE_S:
                    raise store.EntryError(f"the load took {waited:.1f} s, past its {DEADLINE_S:g} s deadline")
                key = f"held.{store.ROUTE}.{load.index}.d{rank}"
                tensors[key] = held
                tensors[f"{key}.pos"] = torch.arange(load.tokens, dtype=torch.int64)
                record.update(state="loaded", attempts=["ok"], outcome="loaded")
            except Exception as exc:  # every failure is a recompute, never the engine's death
                error = str(exc) if isinstance(exc, store.EntryError) else f"{type(exc).__name__}: {exc}"
                self._invalid.update(load.block_ids)
        if error:
            record["attempts"] = [error]
            logger.warning("harness KV connector: request %d (%s) not loaded on rank %d, recomputed: %s",
                           load.index, load.req_id, rank, error)
        else:
            logger.info("harness KV connector: request %d loaded %d tokens on rank %d", load.index, load.tokens, rank)
        record["waited_s"] = round(time.monotonic() - start, 4)
        return record

    def _place(self, forward_context: "ForwardContext", load: Transfer) -> torch.Tensor:
        """Read this rank's KV heads of `load` from the store, write them into its blocks, and return the digests
        [L, kv_local, n] of what the blocks then hold."""
        ns, n, heads = self._root / load.namespace, load.tokens, self._heads()
        found: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for source in store.committed_ranks(ns, load.index):  # the lowest committed prefill rank holding each head
            missing = [h for h in heads if h not in found]
            if not missing:
                break
            found.update(store.read_heads(ns, load.index, source, missing, n, load.prompt))
        if len(found) < len(heads):
            raise store.EntryError(f"no committed entry of request {load.index} holds KV heads "
                                   f"{[h for h in heads if h not in found]}")
        layers = self._attention_layers(forward_context)
        if len(found[heads[0]][0]) != len(layers):
            raise store.EntryError(f"the entry holds {len(found[heads[0]][0])} layers, the model {len(layers)}")
        held_k, held_v = [], []
        for i, (name, kv) in enumerate(layers):
            layout.write_rows(kv, self._isa(name), *self._slots(kv, load.block_ids, n),
                              torch.stack([found[h][0][i] for h in heads], dim=1),
                              torch.stack([found[h][1][i] for h in heads], dim=1))
            k, v = self._rows(name, kv, load.block_ids, n)
            held_k.append(k)
            held_v.append(v)
        return store.layer_digests(held_k, held_v)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, HarnessKVMetadata) and meta.stores:
            self._layers[layer_name] = kv_layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, HarnessKVMetadata) or not meta.stores:
            return
        rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        layers = sorted(self._layers.items(), key=lambda item: extract_layer_index(item[0]))
        self._layers = {}
        rank_layout = {"tp_rank": rank, "tp_size": tp, "kv_heads": self._heads(), "layers": len(layers),
                  "layer_names": [name for name, _ in layers]}
        for job in meta.stores:
            try:
                rows = [self._rows(name, kv, job.block_ids, len(job.prompt)) for name, kv in layers]
                store.write_entry(self._root / job.namespace, job.index, rank, [k for k, _ in rows],
                                  [v for _, v in rows], job.prompt, rank_layout)
            except Exception as exc:  # the decode side finds no committed entry and computes the prompt
                logger.error("harness KV connector: request %d (%s) not stored on rank %d: %s: %s", job.index,
                             job.req_id, rank, type(exc).__name__, exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid
