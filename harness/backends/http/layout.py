"""The layout an HTTP engine's server reports about itself: the per-rank files its layout probe writes
(a vLLM general plugin, tests/vllm_plugin/harness_vllm_probe, told where through the template's
`layout_report_env`), turned into layout.json's "target" entry: one RankReport per rank
(harness/records/rankreport.py), the schema the embedded engine writes. The harness never imports the engine:
it reads JSON.

Per rank: its tensor-parallel and DCP ranks and DCP group, the global Q and KV head ids its attention
layers hold (as loaded: the checkpoint shard the probe found in each QKV projection's rows; the layer's
own shard parameters where no shard matched), Q->KV reads by the engine's grouping (local Q head i reads
local KV head i // (Q heads / KV heads)), K/V weight checksums, and the KV cache as the engine allocated
it (blocks, block size, bytes per token, bytes); the pool is the budget the engine sized it from. An MLA rank
(multi-head latent attention) also reports its MLA record: the heads whose Q weights it loaded, their checksums
and the latent row width of its cache; its one "KV head" is the latent every TP rank holds. A hybrid rank
(Qwen3-Next) reports its hybrid record as the embedded engine does: linear-attention heads and conv rows as
loaded, their state as allocated (heads, channels, bytes per slot), experts and shared-expert columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.core.errors import RunError
from harness.records.rankreport import ExpertsReport, MLAReport, ProbeLayer, RankReport, entry_json, hybrid_from_json

PROBE_SCHEMA = 1


def _held(layer: dict[str, Any], key: str, claimed: str) -> list[int]:
    value = layer.get(key)
    return [int(h) for h in (value if value is not None else layer[claimed])]


def _heads(layers: list[dict[str, Any]], key: str, claimed: str) -> tuple[list[int], list[str]]:
    """A rank's head ids over its layers: a layer holding other heads than its shard parameters say
    wins (the loader cut another shard); the layers that disagree with the chosen ids are named."""
    held = [_held(layer, key, claimed) for layer in layers]
    off = [h for h, layer in zip(held, layers) if h != [int(x) for x in layer[claimed]]]
    chosen = off[0] if off else held[0]
    return chosen, [str(layer["layer"]) for h, layer in zip(held, layers) if h != chosen]


def _reads(q_count: int, kv_heads: list[int]) -> list[int]:
    """Global KV head each of `q_count` local Q heads reads: vLLM's grouping, local i -> i // (q / kv)."""
    per = max(1, q_count // max(1, len(kv_heads)))
    return [kv_heads[min(i // per, len(kv_heads) - 1)] for i in range(q_count)]


def read_probe(folder: Path, tp: int) -> list[dict[str, Any]]:
    """The probe's rank<R>.json files for ranks 0..tp-1; a RunError naming what is missing or broken."""
    reports = []
    for rank in range(tp):
        path = folder / f"rank{rank}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RunError(f"the server's layout probe wrote no report for rank {rank} ({path}; is the probe plugin "
                           f"installed in the engine's environment?)") from None
        except (OSError, ValueError) as exc:
            raise RunError(f"layout probe report {path} cannot be read: {exc}") from exc
        if not isinstance(data, dict) or data.get("error"):
            why = data.get("error") if isinstance(data, dict) else data
            raise RunError(f"layout probe failed on rank {rank}: {why}")
        if data.get("schema_version") != PROBE_SCHEMA or not data.get("layers"):
            raise RunError(f"layout probe report {path} has schema {data.get('schema_version')!r} or no layers")
        reports.append(data)
    return reports


def _layer(layer: dict[str, Any]) -> ProbeLayer:
    ids = lambda key: None if layer.get(key) is None else tuple(int(h) for h in layer[key])  # noqa: E731
    return ProbeLayer(layer=str(layer["layer"]), q_heads=ids("q_heads"), k_heads=ids("k_heads"),
                      v_heads=ids("v_heads"), claimed_q_heads=tuple(int(h) for h in layer["claimed_q_heads"]),
                      claimed_kv_heads=tuple(int(h) for h in layer["claimed_kv_heads"]))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _mla(record: dict[str, Any] | None) -> MLAReport | None:
    if not record:
        return None
    return MLAReport(q_mode=str(record["q_mode"]), q_weight_heads=tuple(int(h) for h in record["q_weight_heads"]),
                     q_weight_checksums={str(k): str(v) for k, v in record["q_weight_checksums"].items()},
                     latent_dim=int(record["latent_dim"]))


def _experts(record: dict[str, Any] | None) -> ExpertsReport | None:
    """The probe's record of a rank's routed experts (vLLM's RoutedExperts; harness_vllm_probe/moe.py)."""
    if not record:
        return None
    lo, hi = record["expert_ffn_shard"]
    return ExpertsReport(experts=tuple(int(e) for e in record["experts"]), expert_ffn_shard=(int(lo), int(hi)),
                         expert_columns=int(record["expert_columns"]), shared_columns=int(record["shared_columns"]),
                         router_checksum=str(record["router_checksum"]),
                         logical=tuple(int(e) for e in record.get("logical") or ()))


def probe_ranks(reports: list[dict[str, Any]]) -> list[RankReport]:
    """Each rank's RankReport from the probe's reports (read_probe) of one server, in rank order."""
    q_of = {int(r["tp_rank"]): _heads(r["layers"], "q_heads", "claimed_q_heads")[0] for r in reports}
    groups = sorted({tuple(int(m) for m in r["dcp_members"]) for r in reports})
    ranks = []
    for r in reports:
        rank, layers = int(r["tp_rank"]), r["layers"]
        q_heads, q_off = _heads(layers, "q_heads", "claimed_q_heads")
        kv_heads, kv_off = _heads(layers, "k_heads", "claimed_kv_heads")
        v_heads, v_off = _heads(layers, "v_heads", "claimed_kv_heads")
        members = tuple(int(m) for m in r["dcp_members"])
        group_q = [q for m in members for q in q_of.get(m, [])]
        kv = r["kv_cache"]
        ranks.append(RankReport(
            rank=rank, q_heads=tuple(q_heads), kv_heads=tuple(kv_heads), v_heads=tuple(v_heads),
            dcp_group=groups.index(members), dcp_rank=int(r["dcp_rank"]), dcp_members=members,
            kv_tp_rank=rank // max(1, int(r["dcp_size"])), q_to_kv=tuple(_reads(len(q_heads), kv_heads)),
            group_q_heads=tuple(group_q), group_q_to_kv=tuple(_reads(len(group_q), kv_heads)),
            kv_pool_bytes=int(kv["bound_bytes"] or kv["tensor_bytes"]), kv_pool_blocks=int(kv["num_blocks"]),
            kv_block_size=_optional_int(kv["block_size"]), kv_bytes_per_token=_optional_int(kv["bytes_per_token"]),
            kv_weight_checksums={str(k): str(v) for k, v in r["kv_weight_checksums"].items()},
            layers=tuple(_layer(layer) for layer in layers), mla=_mla(r.get("mla")), experts=_experts(r.get("experts")),
            hybrid=hybrid_from_json(r["hybrid"], f"layout probe rank {rank}") if r.get("hybrid") else None,
            layers_differing=tuple(sorted(set(q_off + kv_off + v_off))) or None))
    return sorted(ranks, key=lambda e: e.rank)


def probe_layout(folder: Path, tp: int) -> dict[str, Any]:
    """layout.json's "target" entry (ranks and pool) from the probe's reports of a tp-rank server."""
    reports = read_probe(folder, tp)
    first = reports[0]["kv_cache"]
    budget = first.get("budget_bytes")
    sizing = {"sizing": str(first["sizing"])} if first.get("sizing") else {}  # how the engine sizes its pool
    pool = ({"budget_bytes": int(budget), "block_size": int(first["block_size"]),
             "max_seq_len": int(first["max_model_len"]), **sizing}
            if budget is not None and first.get("block_size") else None)
    return {**entry_json(probe_ranks(reports), pool), "source": "probe"}
