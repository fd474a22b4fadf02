"""The table lines of the sparse section of `harness plan`: the indexer's split, its selection rule and the
cache groups with their bytes per slot and the one slot count they share."""

from __future__ import annotations

from typing import Any

from harness.core.fmt import human_bytes, id_ranges, table


def render_sparse(s: dict[str, Any]) -> list[str]:
    """The table lines of a sparse section."""
    rows = [[str(r["rank"]), id_ranges(r["index_heads"]), id_ranges(r["group_index_heads"]), str(r["dcp_rank"])]
            for r in s["ranks"]]
    cap = s["capacity"]
    budget = (f"{human_bytes(cap['budget_bytes'])} per rank"
              + (" (the run's default pool; --budget-gib sets another)" if s["default_budget"] else ""))
    per_slot = {g["name"]: g["slot_bytes"] for g in s["cache_groups"]}
    groups = [[g["name"], str(g["blocks_per_seq"]), str(g["block_bytes"]), str(per_slot[g["name"]]), str(g["blocks"]),
               human_bytes(g["bytes"])] for g in cap["groups"]]
    return [f"sparse attention: indexer of {s['index_heads']} heads x {s['index_head_dim']} (one key per token), "
            f"index_topk={s['index_topk']}, index_sinks={s['index_sinks']}; indexer heads split over tp={s['tp']}, "
            f"gathered in each DCP group (dcp={s['dcp']})",
            table(["rank", "index_heads", "dcp_group_index_heads", "dcp_rank"], rows),
            f"selection: {s['selection_rule']}",
            f"cache groups (one slot count for all, slot-aligned; {s['max_seq_len']} tokens per slot, "
            f"blocks of {s['block_size']} tokens; indexer keys {s['key_bytes_per_token']} bytes per stored token):",
            table(["group", "blocks_per_slot", "block_bytes", "bytes_per_slot", "blocks", "bytes"], groups),
            f"capacity: {cap['slots']} slots of {human_bytes(cap['slot_bytes'])} from a budget of {budget}"]
