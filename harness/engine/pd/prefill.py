"""The prefill world of a disaggregated run: each request's prompt KV computed and sent to the store.

Requests are prefilled one after another. A request's KV rows are digested the moment its forward wrote
them (pd_store.row_digest: what the prefill side means to send); the send itself completes one request
later, as an asynchronous transfer does while the engine goes on, and reads the request's pool blocks by
their block ids then. A correct engine releases a request's blocks only after its send completed; under
the pd-early-release fault it releases them right after the forward, the next request is given the same
blocks, and the late send ships that request's KV under the first one's name (vLLM's NIXL KV-digest case:
"a request silently reads another request's KV").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from harness.core.errors import ConfigError
from harness.engine.fault import FaultFlags
from harness.engine.pd.state import capture, state_digests, state_keys
from harness.engine.pd.store import layer_rows, pool_rows, sequence_digests, write_entry
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.kvcache import PagedKVCache
from harness.engine.runtime.statecache import HybridCache
from harness.partition.pd_state import StateSlices


@dataclass
class _Sent:
    """A request whose KV is computed and not yet sent: its block ids and stored positions at compute time."""

    index: int
    seq_id: int
    blocks: list[int]
    positions: list[int]
    tokens: list[int]
    digests: torch.Tensor  # [layers, kv_local, n] int64
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # a hybrid model's state at its cuts (pd_state.py)
    released: bool = False


@dataclass
class PrefillRecord:
    """What one prefill rank did: its pool's free blocks before and after, the requests it sent and the
    first new token's top-k of each request (the prefill-only result)."""

    free_start: int
    free_end: int
    sent: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"free_start": self.free_start, "free_end": self.free_end, "sent": self.sent, "lost": self.lost}


def _send(cache: PagedKVCache, store: Path, rank: int, item: _Sent, lost: bool) -> None:
    """Write the request's rows as its block ids hold them now (a lost entry is never committed)."""
    if lost:
        return
    rows = pool_rows(cache, item.blocks, len(item.positions))
    tensors: dict[str, torch.Tensor] = {"pos": torch.tensor(item.positions, dtype=torch.long),
                                        "tokens": torch.tensor(item.tokens, dtype=torch.long),
                                        "digest": item.digests, **item.state}
    for layer in range(len(cache.k)):
        k, v = layer_rows(cache, layer, rows)
        tensors[f"k.{layer}"] = k
        if v is not None:
            tensors[f"v.{layer}"] = v
    write_entry(store, item.index, rank, tensors)


@torch.inference_mode()
def run_prefill(engine: Engine, prompts: Sequence[Sequence[int]], store: Path, top_k: int,
                flags: FaultFlags = FaultFlags(), cuts: Sequence[Sequence[int]] = (),
                slices: StateSlices | None = None, indices: Sequence[int] | None = None) -> PrefillRecord:
    """Prefill every prompt (in order) and send its KV to `store`; returns this rank's record. `flags`: the
    transfer faults (pd-early-release; a lost entry), not the model's. A model with linear-attention state
    (`slices`: this rank's state slices) is prefilled in chunks ending at each of cuts[i] (prompt lengths
    the decode side loads) and sends its state after each with its per-slice digests. `indices`: each prompt's
    request index in the store (default 0, 1, ...; a prefill server gets them from its requests)."""
    cache = engine.cache
    if engine.capacity.slots < 2:
        raise ConfigError(f"the prefill world needs a KV pool of at least 2 sequence slots (a request's blocks are "
                          f"held until its send completes while the next one prefills), got {engine.capacity.slots}")
    engine.check_lengths([len(p) for p in prompts])
    rank = engine.state.rank
    record = PrefillRecord(free_start=cache.free_blocks, free_end=-1)
    pending: _Sent | None = None
    for pos, (index, prompt) in enumerate(zip(indices if indices is not None else range(len(prompts)), prompts)):
        seq = cache.open(1)[0]
        lin_state: dict[str, torch.Tensor] = {}
        if slices is not None and isinstance(cache, HybridCache):
            logits, lin_state = _prefill_with_state(engine, cache, seq, list(prompt), cuts[pos], slices)
        else:
            logits, _ = engine.extend([seq], [list(prompt)], [0])  # [1, P, V]
        lp = torch.log_softmax(logits[0, -1].double(), dim=-1)  # [V]
        top = lp.topk(min(top_k, lp.shape[-1]))
        record.topk_ids.append(top.indices.cpu())
        record.topk_logprobs.append(top.values.float().cpu())
        state = cache.seqs[seq]
        item = _Sent(index, seq, list(state.blocks), list(state.positions), list(prompt),
                     sequence_digests(cache, seq), lin_state)  # digests [L, kv, n] at compute time
        if flags.pd_early_release:  # the fault: blocks back to the pool before their send completed
            cache.close([seq])
            item.released = True
        if pending is not None:
            _complete(cache, store, rank, pending, record, flags.pd_lost_request)
        pending = item
    if pending is not None:
        _complete(cache, store, rank, pending, record, flags.pd_lost_request)
    record.free_end = cache.free_blocks
    return record


def _complete(cache: PagedKVCache, store: Path, rank: int, item: _Sent, record: PrefillRecord, lost: int) -> None:
    """The send of `item` completes: its entry is written, then (a correct engine) its blocks released."""
    _send(cache, store, rank, item, item.index == lost)
    (record.lost if item.index == lost else record.sent).append(item.index)
    if not item.released:
        cache.close([item.seq_id])


def _prefill_with_state(engine: Engine, cache: HybridCache, seq: int, prompt: list[int], cuts: Sequence[int],
                        slices: StateSlices) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Prefill `prompt` in chunks ending at each cut (and its end), keeping the state after each cut with its
    digests; returns the last chunk's logits [1, S, V] and the state tensors."""
    ends = sorted({c for c in cuts if 0 < c < len(prompt)} | {len(prompt)})
    state: dict[str, torch.Tensor] = {}
    start = 0
    logits = torch.empty(0)
    for end in ends:
        logits, _ = engine.extend([seq], [prompt[start:end]], [start])  # [1, end - start, V]
        conv, rec = capture(cache, seq)
        conv_key, rec_key, digest_key = state_keys(end)
        state.update({conv_key: conv, rec_key: rec, digest_key: state_digests(conv, rec, slices)})
        start = end
    return logits, state
