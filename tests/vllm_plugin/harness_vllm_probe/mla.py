"""The layout probe's multi-head latent attention part (DeepSeek-V2/V3 in vLLM: MultiHeadLatentAttentionWrapper).

At load time the column-parallel Q projection (q_proj, or q_b_proj with a Q LoRA) and kv_b_proj of each MLA layer
are matched against the checkpoint tensor's row shards (which heads' rows a rank really loaded), and their rows and
the replicated latent projection (kv_a_proj_with_mqa) are kept as loaded (the CPU backend repacks weights afterwards).
Per rank the report then says: the Q heads whose Q weights it holds (q_proj rows and kv_b's w_kc rows: the heads a
loader cut from the checkpoint, or the shard parameters' own where no shard matched), a checksum of each such head
over every layer, the latent row width and bytes per token of the cache as allocated, and the latent projection's
checksum as the one "KV head" every rank holds (the latent is duplicated on every TP rank).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable

# id(linear) -> the checkpoint row shard its weight equals (None: none) and its rows as loaded
_SHARD: dict[int, int | None] = {}
_ROWS: dict[int, Any] = {}
MLA_PROJECTIONS = ("q_proj", "q_b_proj", "kv_b_proj", "kv_a_proj_with_mqa")


def which_shard(param: Any, loaded_weight: Any) -> int | None:
    """The index of the checkpoint row shard (of `param`'s row count) that `param` now equals, or None."""
    import torch

    data = getattr(param, "data", param)
    rows = int(data.shape[0])
    if rows == 0 or loaded_weight.dim() != data.dim() or loaded_weight.shape[0] % rows:
        return None
    for index in range(loaded_weight.shape[0] // rows):
        if torch.equal(loaded_weight.narrow(0, index * rows, rows).to(data.dtype), data):
            return index
    return None


def is_projection(prefix: str) -> bool:
    """Whether the linear at `prefix` is one of an MLA layer's projections (MLA_PROJECTIONS)."""
    return prefix.rsplit(".", 1)[-1] in MLA_PROJECTIONS


def recording(load: Callable[..., Any], matches: Callable[[str], bool] = is_projection,
              shards: dict[int, int | None] = _SHARD, rows: dict[int, Any] = _ROWS) -> Callable[..., Any]:
    """Wrap a column-parallel (or replicated) linear's weight loader: the weight of a linear whose prefix `matches`
    keeps, by the linear's id, the checkpoint row shard it equals (which_shard; None: none) in `shards` and its rows
    as loaded in `rows`. MLA's projections by default; the GDN in_proj_qkvz (gdn.py) through the same wrapper."""

    @functools.wraps(load)
    def loader(self: Any, param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
        out = load(self, param, loaded_weight, *args, **kwargs)
        if matches(str(getattr(self, "prefix", ""))) and param is getattr(self, "weight", None):
            try:
                shards[id(self)] = which_shard(param, loaded_weight)
                rows[id(self)] = param.data.detach().float().clone()
            except Exception:  # the probe never breaks a load
                shards[id(self)] = None
        return out

    loader.__harness_probe__ = True  # type: ignore[attr-defined]
    return loader


def mla_layers(model: Any) -> list[tuple[str, Any]]:
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ == "MultiHeadLatentAttentionWrapper"]


def _digest(parts: list[Any]) -> str:
    h = hashlib.sha256()
    for t in parts:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _cache(attn: Any) -> Any:
    caches = attn.kv_cache if isinstance(attn.kv_cache, (list, tuple)) else [attn.kv_cache]
    return next((t for t in caches if hasattr(t, "numel") and t.numel()), None)


def layer_report(name: str, wrapper: Any, tp_rank: int) -> dict[str, Any]:
    """One MLA layer: local heads, the heads its Q projection and kv_b_proj hold as loaded, the latent width."""
    q_layer = wrapper.q_proj if wrapper.q_proj is not None else wrapper.q_b_proj
    n = int(wrapper.num_heads)
    claimed = list(range(tp_rank * n, tp_rank * n + n))
    held = {}
    for key, layer in (("q_heads", q_layer), ("kv_b_heads", wrapper.kv_b_proj)):
        shard = _SHARD.get(id(layer))
        held[key] = list(range(shard * n, shard * n + n)) if shard is not None else None
    cache = _cache(wrapper.mla_attn)
    return {"layer": name, "kind": "mla", "tp_rank": tp_rank, "num_heads": n, "num_kv_heads": 1,
            "num_kv_head_replicas": int(getattr(wrapper.kv_b_proj, "tp_size", 1)), "head_size": int(wrapper.v_head_dim),
            "claimed_q_heads": claimed, "claimed_kv_heads": [0], **held, "k_heads": [0], "v_heads": [0],
            "latent_dim": int(cache.shape[-1]) if cache is not None else None,
            "cache_bytes": int(cache.numel() * cache.element_size()) if cache is not None else 0}


def rank_record(layers: list[tuple[str, Any]], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank's MLA record and latent checksum over every layer: the Q-weight heads it holds (a layer whose
    q_proj or kv_b_proj rows are another shard's wins, as the loader cut them), each head's q rows and w_kc rows."""
    off = [r[k] for r in reports for k in ("q_heads", "kv_b_heads")
           if r[k] is not None and r[k] != r["claimed_q_heads"]]
    heads = off[0] if off else reports[0]["claimed_q_heads"]
    sums: dict[str, Any] = {str(h): hashlib.sha256() for h in heads}
    latent = hashlib.sha256()
    for (_, w), r in zip(layers, reports):
        q_layer = w.q_proj if w.q_proj is not None else w.q_b_proj
        q_rows, kv_b = _ROWS.get(id(q_layer)), _ROWS.get(id(w.kv_b_proj))
        qk, nope, v = int(w.qk_nope_head_dim + w.qk_rope_head_dim), int(w.qk_nope_head_dim), int(w.v_head_dim)
        for j, head in enumerate(heads):
            parts = []
            if q_rows is not None:
                parts.append(q_rows[j * qk:(j + 1) * qk])  # head j's q rows [qk, in]
            if kv_b is not None:
                parts.append(kv_b[j * (nope + v): j * (nope + v) + nope])  # head j's w_kc rows [nope, kv_lora]
            sums[str(head)].update(_digest(parts).encode() if parts else b"not-recorded")
        kv_a = _ROWS.get(id(w.kv_a_proj_with_mqa))
        latent.update(_digest([kv_a]).encode() if kv_a is not None else b"not-recorded")
    record = {"q_mode": "split", "q_weight_heads": heads, "latent_dim": reports[0]["latent_dim"],
              "q_weight_checksums": {h: s.hexdigest() for h, s in sums.items()}}
    return {"mla": record, "kv_weight_checksums": {"0": latent.hexdigest()}}
