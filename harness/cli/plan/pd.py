"""The disaggregated part of `harness plan` (a PREFILL>DECODE topology): how each decode rank's KV blocks
are assembled from which prefill ranks, its token rows, and the bytes moved per request."""

from __future__ import annotations

from typing import Any, Sequence

from harness.core.fmt import human_bytes, id_ranges, table
from harness.partition.pd_layout import PDPlan, StateSource


def pd_section(plan: PDPlan, state: Sequence[StateSource], tokens: int, block_size: int) -> dict[str, Any]:
    """The `pd` section of the plan document: the transfer plan for a `tokens`-token prompt in
    `block_size`-token blocks (block b holds positions [b x block_size, (b + 1) x block_size))."""
    doc = plan.to_dict(tokens)
    doc["block_size"] = block_size
    doc["blocks_per_request"] = -(-tokens // block_size)
    for rank in doc["ranks"]:
        owned = plan.owned_positions(rank["rank"], tokens)
        rank["blocks"] = sorted({t // block_size for t in owned})
        rank["rows"] = [{"head": h.kv_head, "from": [
            {"position": t, "prefill_rank": src, "row": row} for t, (src, row) in zip(owned, plan.source_rows(
                h, owned, tokens))]} for h in plan.ranks[rank["rank"]].heads] if tokens <= 64 else []
    doc["state"] = [s.to_dict() for s in state]
    doc["state_bytes_per_request"] = sum(s.state_bytes for s in state)
    doc["bytes_per_request"] = doc["kv_bytes_per_request"] + doc["state_bytes_per_request"]
    return doc


def render_pd(pd: dict[str, Any], mla: bool) -> list[str]:
    """The table lines of the pd section."""
    pre, dec = pd["prefill"], pd["decode"]
    what = "MLA latent rows (one shared row per token)" if mla else "KV heads"
    rows = []
    for r in pd["ranks"]:
        heads = "; ".join(f"{'latent' if mla else 'h' + str(h['kv_head'])}<-p{','.join(map(str, h['sources']))}"
                          f"[slot {','.join(map(str, h['src_slots']))}]" for h in r["heads"])
        rows.append([str(r["rank"]), str(r["dcp_rank"]), id_ranges(r["kv_heads"]), id_ranges(r["prefill_ranks"]),
                     heads, str(r["token_rows"]), id_ranges(r["blocks"]), human_bytes(r["bytes"])])
    out = [f"disaggregated: prefill tp={pre['tp']} dcp={pre['dcp']} ({pre['placement']['label']}, KV gcd "
           f"{pre['kv_gcd']}, each KV head on x{pre['kv_duplication']} prefill ranks) -> decode tp={dec['tp']} "
           f"dcp={dec['dcp']} ({dec['placement']['label']}, KV gcd {dec['kv_gcd']}, x{dec['kv_duplication']}); "
           f"{what} per decode rank for a {pd['tokens']}-token prompt ({pd['blocks_per_request']} blocks of "
           f"{pd['block_size']} tokens):",
           table(["decode_rank", "dcp_rank", "kv_heads", "from_prefill", "head <- prefill ranks [their slice]",
                  "token_rows", "blocks", "bytes"], rows),
           "a token's row is read from the prefill DCP rank that stored it (prefill placement) and written only "
           "on the decode DCP rank that owns it (decode placement)"]
    if pd["state"]:
        out.append("linear-attention state at the end of the prompt (conv + recurrent, all linear layers): "
                   + ", ".join(f"d{s['rank']}: V heads {id_ranges(s['v_heads'])} <- p{id_ranges(s['prefill_ranks'])} "
                               f"({human_bytes(s['state_bytes'])})" for s in pd["state"]))
    out.append(f"bytes moved per request: {pd['bytes_per_request']} ({human_bytes(pd['bytes_per_request'])}: KV "
               f"{pd['kv_bytes_per_request']}" + (f", state {pd['state_bytes_per_request']}" if pd["state"] else "")
               + ")")
    return out
