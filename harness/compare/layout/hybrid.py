"""Layout invariants of a hybrid model: the full-attention layers as layout_check does, plus each rank's
hybrid record (RankReport.hybrid, harness/records/rankreport.py: linear attention, experts, cache groups) against
harness/partition/hybrid_layout.py.

Invariants: linear heads and packed q|k|v rows per component as planned; identical linear weights and
identical recurrent states across each DCP group; each V head's output added by exactly one rank; experts
placed as planned, each expert's columns held once, the router replicated; the shared expert counted once
(its columns over all ranks sum to its width); every cache group sized from one slot count.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from harness.compare.layout.attention import check_layout, reports_by_rank
from harness.compare.layout.experts import expert_problems
from harness.core.errors import ConfigError
from harness.core.fmt import id_ranges
from harness.core.verdict import CheckResult, Verdict
from harness.partition.cache_groups import grouped_capacity
from harness.partition.hybrid_layout import HybridPlan, hybrid_cache_groups
from harness.partition.layout import LayoutPlan
from harness.records.rankreport import HybridReport


def _linear_problems(plan: HybridPlan, by_rank: Mapping[int, HybridReport]) -> list[str]:
    out: list[str] = []
    for planned in plan.linear.ranks:
        if planned.rank not in by_rank:
            continue
        got, r = by_rank[planned.rank].linear, planned.rank
        for label, held, want in (("v heads", got.v_heads, planned.v_heads), ("k heads", got.k_heads, planned.k_heads)):
            if held != want:
                out.append(f"rank {r} holds linear-attention {label} {id_ranges(held)}, planned {id_ranges(want)}")
        if got.conv_rows != tuple(planned.conv_rows):
            out.append(f"rank {r} loads packed in_proj/conv rows {_ranges(got.conv_rows)}, planned per component "
                       f"(q|k|v) {_ranges(planned.conv_rows)}")
        if got.recurrent_heads is not None and got.recurrent_heads != len(planned.v_heads):
            out.append(f"rank {r}'s recurrent state holds {got.recurrent_heads} V heads, planned "
                       f"{len(planned.v_heads)}")
        channels = sum(hi - lo for lo, hi in planned.conv_rows)
        if got.conv_channels is not None and got.conv_channels != channels:
            out.append(f"rank {r}'s conv state holds {got.conv_channels} channels, planned {channels}")
    for members in dict.fromkeys(r.dcp_members for r in plan.linear.ranks):
        sums = {m: by_rank[m].linear.weight_checksum for m in members if m in by_rank}
        if len(set(sums.values())) > 1:
            out.append(f"linear-attention weights (and so the recurrent state) differ inside DCP group "
                       f"{id_ranges(members)}: " + ", ".join(f"rank {m} {s[:12]}" for m, s in sums.items()))
        states = {m: by_rank[m].linear.state_digests for m in members if m in by_rank}
        if len(set(states.values())) > 1:
            out.append(f"recurrent states of the last finished sequences differ inside DCP group {id_ranges(members)}: "
                       "the state must be kept whole (every token) on every rank of the group")
    adders: dict[int, list[int]] = defaultdict(list)
    for r, hybrid in sorted(by_rank.items()):
        for v in hybrid.linear.out_v_heads:
            adders[v].append(r)
    want = plan.linear.dp  # one rank per DP rank (each adds it for its own requests)
    for v in range(len(plan.linear.v_replicas)):
        if len(adders[v]) != want:
            out.append(f"linear-attention V head {v}'s output is added by {len(adders[v])} ranks "
                       f"({id_ranges(adders[v]) or 'none'}), planned exactly one"
                       + (f" per DP rank ({want})" if want > 1 else ""))
    return out


def _moe_problems(plan: HybridPlan, by_rank: Mapping[int, HybridReport]) -> list[str]:
    if plan.moe is None:
        return []
    return expert_problems(plan.moe, {r: hybrid.moe for r, hybrid in by_rank.items()})


def _cache_problems(plan: HybridPlan, by_rank: Mapping[int, HybridReport], pool: Mapping[str, Any],
                    speculator: LayoutPlan | None) -> list[str]:
    groups = hybrid_cache_groups(plan.attention, plan.linear, speculator, int(pool["max_seq_len"]),
                                 int(pool["block_size"]))
    try:
        want = grouped_capacity(groups, int(pool["budget_bytes"]))
    except ConfigError as exc:
        return [f"cache groups: {exc}"]
    out: list[str] = []
    for r, hybrid in sorted(by_rank.items()):
        cg = hybrid.cache_groups
        per_seq = max(1, cg.attention_blocks_per_seq)
        held = {"attention": cg.attention_blocks // per_seq, "recurrent": cg.state_slots}
        if len(set(held.values())) > 1 or cg.attention_blocks % per_seq:
            out.append(f"rank {r}'s cache groups hold different numbers of sequences (attention "
                       f"{cg.attention_blocks} blocks / {cg.attention_blocks_per_seq} per sequence, "
                       f"recurrent {cg.state_slots} slots): not sized from one slot count")
        if cg.attention_blocks != want.blocks("attention") or cg.state_slots != want.slots:
            out.append(f"rank {r} has {cg.attention_blocks} attention blocks and {cg.state_slots} state slots, "
                       f"planned {want.blocks('attention')} and {want.slots} ({want.slots} slots of the budget)")
    return out


def _ranges(rows: Any) -> str:
    return ", ".join(f"{lo}-{hi - 1}" for lo, hi in rows)


def check_hybrid_layout(plan: HybridPlan, actual: Mapping[str, Any], name: str = "layout",
                        check_pool: bool = True, check_checksums: bool = True,
                        speculator: LayoutPlan | None = None) -> CheckResult:
    """The full-attention layout (layout_check.check_layout, its pool replaced by the grouped capacity,
    whose groups include the speculator's KV pages when it runs) and the hybrid invariants above."""
    base = check_layout(plan.attention, actual, None, name, check_checksums, plan)
    if base.verdict is Verdict.ERROR:
        return base
    reports = reports_by_rank(actual)  # check_layout has read them: no schema error here
    by_rank = {r: report.hybrid for r, report in reports.items() if report.hybrid is not None}
    missing = sorted(set(reports) - set(by_rank))
    if missing:
        return CheckResult(name, Verdict.ERROR, f"layout ranks {id_ranges(missing)} report no 'hybrid' entry")
    problems = _linear_problems(plan, by_rank) + _moe_problems(plan, by_rank)
    block_sized = isinstance(actual.get("pool"), Mapping) and actual["pool"].get("sizing") == "blocks"
    if check_pool and not block_sized:  # an engine that sizes its pool in blocks (vLLM) has no slot count to check
        try:
            problems += _cache_problems(plan, by_rank, actual["pool"], speculator)
        except (KeyError, TypeError, ValueError) as exc:
            return CheckResult(name, Verdict.ERROR, f"layout entry has no usable 'pool' ({exc!r})")
    problems += base.metrics["problems"]
    metrics = {**base.metrics, "problems": problems, "hybrid": plan.to_dict()}
    if problems:
        extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name, Verdict.FAIL, problems[0] + extra, metrics)
    moe = f", {plan.moe.experts} experts over ep={plan.moe.ep}" if plan.moe else ""
    groups = ("cache groups in blocks (the engine's sizing; state heads and channels as planned)" if block_sized
              else "cache groups from one slot count")
    return CheckResult(name, Verdict.PASS, f"{base.reason}; {plan.linear.layers} linear-attention layers as planned"
                       f"{moe}; {groups}", metrics)
