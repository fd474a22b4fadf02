"""Layout invariants of the DCP token placement and of MLA's Q weights, on layout.json's rank reports
(harness/records/rankreport.py).

- placement: what each rank stored of the engine's probe sequence (RankReport.stored_positions) must be
  exactly the placement's share (layout.local_positions), so every token's K/V or latent row sits on its
  owner and on no other rank of its DCP group;
- Q weights (an MLA rank's RankReport.mla: q_weight_heads, q_weight_checksums): each rank holds the Q weights
  of the heads the plan gives it (its own, or its DCP group's when Q is replicated), and every copy of
  a head's Q weights is the same (a replicated copy equals the owner's).
Pure functions returning problem sentences; check_layout collects them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from harness.core.fmt import id_ranges
from harness.partition.layout import LayoutPlan, local_positions
from harness.partition.mla_layout import q_weight_heads
from harness.records.rankreport import RankReport


def placement_problems(plan: LayoutPlan, by_rank: Mapping[int, RankReport]) -> list[str]:
    """Stored probe positions against the placement's owner map, per rank and per DCP group."""
    out: list[str] = []
    for members in plan.dcp_groups:
        holders: dict[int, list[int]] = defaultdict(list)
        length = 0
        for m in members:
            got = by_rank[m].stored_positions if m in by_rank else None
            if got is None:
                continue
            length = max(length, got.length)
            planned = plan.ranks[m]
            want = local_positions(got.length, planned.dcp_rank, plan.dcp, plan.placement, got.prompt_len)
            stored = list(got.positions)
            for p in stored:
                holders[p].append(m)
            if stored != want:
                out.append(f"rank {m} stores tokens {id_ranges(stored) or '-'} of a {got.length}-token "
                           f"sequence, the {plan.placement.label} placement gives it {id_ranges(want) or '-'}")
        if holders and plan.dcp > 1:
            group = plan.ranks[members[0]].dcp_group
            twice = sorted(p for p, ranks in holders.items() if len(ranks) > 1)
            never = [p for p in range(length) if p not in holders]
            if twice:
                out.append(f"tokens {id_ranges(twice)} are stored on several ranks of DCP group {group} "
                           f"(token {twice[0]}: ranks {id_ranges(holders[twice[0]])})")
            if never:
                out.append(f"tokens {id_ranges(never)} are stored on no rank of DCP group {group}")
    return out


def q_weight_problems(plan: LayoutPlan, by_rank: Mapping[int, RankReport]) -> list[str]:
    """Held Q-weight heads as planned, and one checksum per head across every rank holding it."""
    out: list[str] = []
    seen: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, report in sorted(by_rank.items()):
        got = report.mla
        if got is None or r >= len(plan.ranks):
            continue
        want = q_weight_heads(plan.ranks[r], plan.q_replicated)
        if got.q_weight_heads != want:
            mode = "replicated in the DCP group" if plan.q_replicated else "split by tp"
            out.append(f"rank {r} holds Q weights (q_b_proj, w_kc) of heads {id_ranges(got.q_weight_heads)}, planned "
                       f"{id_ranges(want)} (Q {mode})")
        for head, digest in got.q_weight_checksums.items():
            seen[int(head)][digest].append(r)
    for head, by_sum in sorted(seen.items()):
        if len(by_sum) > 1:
            out.append(f"Q weights (q_b_proj, w_kc) of head {head} differ between ranks holding it: "
                       + " vs ".join(f"ranks {id_ranges(rs)} ({s[:12]})" for s, rs in by_sum.items()))
    return out
