"""Layout invariants of a hybrid model: the full-attention layers as layout_check does, plus what each
rank reports under "hybrid" in layout.json against harness/hybrid_layout.py:

  {"linear": {v_heads, k_heads, out_v_heads, conv_rows [[lo, hi), ...], weight_checksum,
              state_digests (sha256 of the recurrent state the last finished sequences left)},
   "moe": {experts, expert_ffn_shard, expert_columns, shared_columns, router_checksum} | null,
   "cache_groups": {slots, attention_blocks, attention_blocks_per_seq, state_slots, state_bytes, attention_bytes}}

Invariants: linear heads and packed q|k|v rows per component as planned; identical linear weights and
identical recurrent states across each DCP group; each V head's output added by exactly one rank; experts
placed as planned, each expert's columns held once, the router replicated; the shared expert counted once
(its columns over all ranks sum to its width); every cache group sized from one slot count.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from harness.compare.layout_check import check_layout
from harness.errors import ConfigError
from harness.fmt import id_ranges
from harness.hybrid_layout import HybridPlan, grouped_capacity, hybrid_cache_groups
from harness.layout import LayoutPlan
from harness.verdict import CheckResult, Verdict


def _linear_problems(plan: HybridPlan, by_rank: Mapping[int, Mapping[str, Any]]) -> list[str]:
    out: list[str] = []
    for planned in plan.linear.ranks:
        got = by_rank.get(planned.rank, {}).get("linear")
        if got is None:
            continue
        r = planned.rank
        for key, want in (("v_heads", planned.v_heads), ("k_heads", planned.k_heads)):
            if tuple(got[key]) != want:
                out.append(f"rank {r} holds linear-attention {key.replace('_', ' ')} {id_ranges(got[key])}, "
                           f"planned {id_ranges(want)}")
        rows = [tuple(x) for x in got["conv_rows"]]
        if rows != list(planned.conv_rows):
            out.append(f"rank {r} loads packed in_proj/conv rows {_ranges(rows)}, planned per component "
                       f"(q|k|v) {_ranges(planned.conv_rows)}")
    for members in dict.fromkeys(r.dcp_members for r in plan.linear.ranks):
        sums = {m: by_rank[m]["linear"]["weight_checksum"] for m in members if m in by_rank}
        if len(set(sums.values())) > 1:
            out.append(f"linear-attention weights (and so the recurrent state) differ inside DCP group "
                       f"{id_ranges(members)}: " + ", ".join(f"rank {m} {s[:12]}" for m, s in sums.items()))
        states = {m: tuple(by_rank[m]["linear"].get("state_digests", ())) for m in members if m in by_rank}
        if len(set(states.values())) > 1:
            out.append(f"recurrent states of the last finished sequences differ inside DCP group {id_ranges(members)}: "
                       "the state must be kept whole (every token) on every rank of the group")
    adders: dict[int, list[int]] = defaultdict(list)
    for r, got in sorted(by_rank.items()):
        for v in got["linear"]["out_v_heads"]:
            adders[v].append(r)
    for v in range(len(plan.linear.v_replicas)):
        if len(adders[v]) != 1:
            out.append(f"linear-attention V head {v}'s output is added by {len(adders[v])} ranks "
                       f"({id_ranges(adders[v]) or 'none'}), planned exactly one")
    return out


def _moe_problems(plan: HybridPlan, by_rank: Mapping[int, Mapping[str, Any]]) -> list[str]:
    if plan.moe is None:
        return []
    out: list[str] = []
    holders: dict[int, list[int]] = defaultdict(list)
    shared = 0
    for planned in plan.moe.ranks:
        got = by_rank.get(planned.rank, {}).get("moe")
        if got is None:
            out.append(f"rank {planned.rank} reports no MoE layout")
            continue
        r = planned.rank
        if tuple(got["experts"]) != planned.experts:
            out.append(f"rank {r} routes to its experts as ids {id_ranges(got['experts'])}, planned experts "
                       f"{id_ranges(planned.experts)} (EP rank {planned.ep_rank})")
        lo, hi = planned.expert_ffn_shard
        if got["expert_columns"] != hi - lo:
            out.append(f"rank {r} holds {got['expert_columns']} columns per expert, planned {hi - lo}")
        s_lo, s_hi = planned.shared_ffn_shard
        if got["shared_columns"] != s_hi - s_lo:
            out.append(f"rank {r} holds {got['shared_columns']} shared-expert columns, planned {s_hi - s_lo}")
        shared += got["shared_columns"]
        for e in got["experts"]:
            holders[e].append(r)
    if plan.moe.shared_ffn and shared != plan.moe.shared_ffn:
        out.append(f"the shared expert is counted {shared / plan.moe.shared_ffn:.2g} times: its columns over all "
                   f"ranks sum to {shared}, its width is {plan.moe.shared_ffn}")
    for e in range(plan.moe.experts):
        if len(holders[e]) != plan.moe.etp:
            out.append(f"expert {e} held by ranks {id_ranges(holders[e]) or 'none'}, planned {plan.moe.etp} "
                       f"(its expert-TP group)")
    routers = {got["moe"]["router_checksum"] for got in by_rank.values() if got.get("moe")}
    if len(routers) > 1:
        out.append(f"router weights differ between ranks ({len(routers)} versions); the router is replicated")
    return out


def _cache_problems(plan: HybridPlan, by_rank: Mapping[int, Mapping[str, Any]], pool: Mapping[str, Any],
                    speculator: LayoutPlan | None) -> list[str]:
    groups = hybrid_cache_groups(plan.attention, plan.linear, speculator, int(pool["max_seq_len"]),
                                 int(pool["block_size"]))
    try:
        want = grouped_capacity(groups, int(pool["budget_bytes"]))
    except ConfigError as exc:
        return [f"cache groups: {exc}"]
    out: list[str] = []
    for r, got in sorted(by_rank.items()):
        cg = got["cache_groups"]
        held = {"attention": cg["attention_blocks"] // max(1, cg["attention_blocks_per_seq"]),
                "recurrent": cg["state_slots"]}
        if len(set(held.values())) > 1 or cg["attention_blocks"] % max(1, cg["attention_blocks_per_seq"]):
            out.append(f"rank {r}'s cache groups hold different numbers of sequences (attention "
                       f"{cg['attention_blocks']} blocks / {cg['attention_blocks_per_seq']} per sequence, "
                       f"recurrent {cg['state_slots']} slots): not sized from one slot count")
        if cg["attention_blocks"] != want.blocks("attention") or cg["state_slots"] != want.slots:
            out.append(f"rank {r} has {cg['attention_blocks']} attention blocks and {cg['state_slots']} state slots, "
                       f"planned {want.blocks('attention')} and {want.slots} ({want.slots} slots of the budget)")
    return out


def _ranges(rows: Any) -> str:
    return ", ".join(f"{lo}-{hi - 1}" for lo, hi in rows)


def check_hybrid_layout(plan: HybridPlan, actual: Mapping[str, Any], name: str = "layout",
                        check_pool: bool = True, check_checksums: bool = True,
                        speculator: LayoutPlan | None = None) -> CheckResult:
    """The full-attention layout (layout_check.check_layout, its pool replaced by the grouped capacity,
    whose groups include the speculator's KV pages when it runs) and the hybrid invariants above."""
    base = check_layout(plan.attention, actual, None, name, check_checksums)
    if base.verdict is Verdict.ERROR:
        return base
    by_rank = {int(e["rank"]): e["hybrid"] for e in actual["ranks"] if isinstance(e.get("hybrid"), Mapping)}
    missing = sorted({int(e["rank"]) for e in actual["ranks"]} - set(by_rank))
    if missing:
        return CheckResult(name, Verdict.ERROR, f"layout ranks {id_ranges(missing)} report no 'hybrid' entry")
    try:
        problems = _linear_problems(plan, by_rank) + _moe_problems(plan, by_rank)
        if check_pool:
            problems += _cache_problems(plan, by_rank, actual["pool"], speculator)
    except (KeyError, TypeError) as exc:
        return CheckResult(name, Verdict.ERROR, f"malformed 'hybrid' layout entry ({exc!r})")
    problems += base.metrics["problems"]
    metrics = {**base.metrics, "problems": problems, "hybrid": plan.to_dict()}
    if problems:
        extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name, Verdict.FAIL, problems[0] + extra, metrics)
    moe = f", {plan.moe.experts} experts over ep={plan.moe.ep}" if plan.moe else ""
    return CheckResult(name, Verdict.PASS, f"{base.reason}; {plan.linear.layers} linear-attention layers as planned"
                       f"{moe}; cache groups from one slot count", metrics)
