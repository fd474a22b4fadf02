"""The experts a rank holds against the MoE plan (hybrid models' hybrid.moe, MLA models' experts): shared by the
hybrid layout check and the attention layout check."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from harness.core.fmt import id_ranges
from harness.partition.hybrid_layout import MoePlan
from harness.records.rankreport import ExpertsReport


def expert_problems(moe: MoePlan, by_rank: Mapping[int, ExpertsReport | None]) -> list[str]:
    """Each rank's experts (ids, columns, the logical expert each slot loaded), shared-expert columns and router
    against the MoE plan; every slot held by its expert-TP group, replicas holding the same weights."""
    out: list[str] = []
    holders: dict[int, list[int]] = defaultdict(list)
    shared = 0
    for planned in moe.ranks:
        got = by_rank.get(planned.rank)
        if got is None:
            out.append(f"rank {planned.rank} reports no MoE layout")
            continue
        r = planned.rank
        if got.experts != planned.experts:
            out.append(f"rank {r} routes to its experts as ids {id_ranges(got.experts)}, planned experts "
                       f"{id_ranges(planned.experts)} (EP rank {planned.ep_rank})")
        lo, hi = planned.expert_ffn_shard
        if got.expert_columns != hi - lo:
            out.append(f"rank {r} holds {got.expert_columns} columns per expert, planned {hi - lo}")
        s_lo, s_hi = planned.shared_ffn_shard
        if got.shared_columns != s_hi - s_lo:
            out.append(f"rank {r} holds {got.shared_columns} shared-expert columns, planned {s_hi - s_lo}")
        shared += got.shared_columns
        for e in got.experts:
            holders[e].append(r)
        want = planned.logical or planned.experts  # without replicas each slot loads its own expert
        if got.logical and got.logical != want:
            plans = "the expert map plans" if moe.expert_map is not None else "planned"
            out.append(f"rank {r} loads logical experts {list(got.logical)} into its physical slots "
                       f"{id_ranges(got.experts)}, {plans} {list(want)}")
    if moe.shared_ffn and shared != moe.shared_ffn:
        out.append(f"the shared expert is counted {shared / moe.shared_ffn:.2g} times: its columns over all "
                   f"ranks sum to {shared}, its width is {moe.shared_ffn}")
    slot = "physical expert slot" if moe.expert_map is not None else "expert"
    for e in range(moe.physical):
        if len(holders[e]) != moe.etp:
            out.append(f"{slot} {e} held by ranks {id_ranges(holders[e]) or 'none'}, planned {moe.etp} "
                       f"(its expert-TP group)")
    out += _replica_problems(by_rank)
    routers = {got.router_checksum for got in by_rank.values() if got is not None}
    if len(routers) > 1:
        out.append(f"router weights differ between ranks ({len(routers)} versions); the router is replicated")
    return out


def _replica_problems(by_rank: Mapping[int, ExpertsReport | None]) -> list[str]:
    """Every physical replica of one logical expert holds the same weights (per expert-TP column shard)."""
    sums: dict[tuple[int, tuple[int, int]], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r, got in sorted(by_rank.items()):
        if got is None or len(got.slot_checksums) != len(got.experts) or len(got.logical) != len(got.experts):
            continue
        for p, logical, digest in zip(got.experts, got.logical, got.slot_checksums):
            sums[(logical, got.expert_ffn_shard)][digest].append(f"rank {r} slot {p}")
    out = []
    for (logical, (lo, hi)), versions in sorted(sums.items()):
        if len(versions) > 1:
            out.append(f"the replicas of logical expert {logical} (columns {lo}-{hi - 1}) hold different weights: "
                       + "; ".join(f"{', '.join(where)}: {d[:12]}" for d, where in versions.items()))
    return out
