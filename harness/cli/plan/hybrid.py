"""The table lines of the hybrid section of `harness plan`: linear-attention state, gated attention, experts
and cache groups."""

from __future__ import annotations

from typing import Any

from harness.core.fmt import human_bytes, id_ranges, table


def render_hybrid(h: dict[str, Any]) -> list[str]:
    """The table lines of a hybrid section."""
    kinds = h["layer_kinds"]
    lin = h["linear"]
    out = [f"layers: {''.join('L' if k == 'linear' else 'F' for k in kinds)} ({lin['layers']} linear attention, "
           f"{h['full_layers']} full attention{' with output gate' if h['output_gate'] else ''}); "
           f"KV bytes above are the full-attention layers'",
           f"linear attention (V heads over kv_tp_size={lin['kv_tp_size']}, gcd={lin['v_gcd']}, "
           f"ranks holding each V head: {lin['v_replicas']}; state kept whole under DCP):",
           table(["rank", "v_heads", "k_heads", "out_v_heads", "q_rows", "k_rows", "v_rows", "conv_state",
                  "recurrent_state"],
                 [[str(r["rank"]), id_ranges(r["v_heads"]), id_ranges(r["k_heads"]),
                   id_ranges(r["out_v_heads"]) or "-"] + [f"{lo}-{hi - 1}" for lo, hi in r["conv_rows"]]
                  + [human_bytes(r["conv_state_bytes"]), human_bytes(r["recurrent_state_bytes"])]
                  for r in lin["ranks"]]),
           "linear state per sequence per rank (all linear layers): "
           f"{human_bytes(lin['state_bytes_per_seq_per_rank'])}",
           "gated attention Q projection rows per rank (q and gate per head): "
           + ", ".join(f"r{r}:{rows[0][0]}-{rows[-1][1] - 1}" for r, rows in enumerate(h["q_proj_rows"]))]
    if h["moe"]:
        out += render_moe(h["moe"])
    out.append(f"cache groups per rank (one slot = one sequence of {h['max_seq_len']} tokens, "
               f"{h['block_size']}-token pages): "
               + "; ".join(f"{g['name']} {g['blocks_per_seq']} x {human_bytes(g['block_bytes'])}"
                           for g in h["cache_groups"]))
    cap = h["capacity"]
    if cap:
        out.append(f"grouped capacity per rank: {cap['slots']} slots ({human_bytes(cap['pool_bytes'])} of "
                   f"{human_bytes(cap['budget_bytes'])}): "
                   + ", ".join(f"{g['name']} {g['blocks']} blocks" for g in cap["groups"]))
    return out


def render_moe(moe: dict[str, Any]) -> list[str]:
    """The MoE lines (a hybrid model's or an MLA model's experts): attention data parallel, experts (physical
    slots) per rank, the expert map."""
    emap = moe.get("expert_map")
    dp = moe.get("dp", 1)
    out = []
    if dp > 1:
        out.append(f"attention data parallel: dp={dp}; DP rank d = rank d runs requests with seq_id % {dp} == d "
                   f"(their attention, KV cache and recurrent state on that rank only, whole attention weights); "
                   f"the MoE runs over all {moe['tp']} ranks")
        out.append(f"padding rule: {moe['padding_rule']}")
    slots = f" in {emap['physical']} physical slots ({emap['redundant']} redundant)" if emap else ""
    out += [f"MoE: {moe['experts']} experts{slots}, top-{moe['top_k']}, ep={moe['ep']} (EP rank = rank // etp), "
            f"etp={moe['etp']} (expert columns split over etp ranks)",
            table(["rank", "ep_rank", "etp_rank", "ep_group"] + (["slots", "logical"] if emap else ["experts"])
                  + ["expert_ffn", "shared_ffn"],
                  [[str(r["rank"]), str(r["ep_rank"]), str(r["etp_rank"]), id_ranges(r["ep_members"]),
                    id_ranges(r["experts"])] + ([",".join(map(str, r.get("logical", r["experts"])))] if emap else [])
                   + [_span(r["expert_ffn_shard"]), _span(r["shared_ffn_shard"])] for r in moe["ranks"]])]
    if emap:
        holder = {p: r["ep_rank"] for r in moe["ranks"] for p in r["experts"]}
        out.append("expert map (logical -> physical slots -> EP ranks): " + "; ".join(
            f"{lg} -> {','.join(map(str, reps))} -> {','.join(str(holder[p]) for p in reps)}"
            for lg, reps in emap["replicas"].items()))
        out.append(f"replica pick: {emap['pick']} (one replica per token: its output is summed once)")
    return out


def _span(bounds: list[int]) -> str:
    lo, hi = bounds
    return f"{lo}-{hi - 1}" if hi > lo else "-"
