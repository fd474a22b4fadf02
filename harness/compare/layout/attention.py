"""Layout invariants: what each rank actually holds (layout.json) against the planner.

`actual` is layout.json's "target" (or "speculator") entry, {"ranks": [RankReport JSON], "pool":
{budget_bytes, block_size, max_seq_len}}; its ranks are read into RankReports (harness/records/rankreport.py,
the schema) before any check looks at them. Every problem found is collected; the verdict is FAIL when
there is any, ERROR when the entry breaks the schema (the error names the rank and the field), PASS
otherwise.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

from harness.compare.layout.capacity import pool_problems
from harness.compare.layout.experts import expert_problems
from harness.compare.layout.params import param_problems
from harness.compare.layout.placement import placement_problems, q_weight_problems
from harness.core.errors import ConfigError
from harness.core.fmt import id_ranges
from harness.core.verdict import CheckResult, Verdict
from harness.partition.hybrid_layout import HybridPlan, MoePlan
from harness.partition.layout import (
    POOL_SIZINGS,
    LayoutPlan,
    PoolCapacity,
    RankLayout,
    kv_of_q,
    pool_capacity,
    slot_pool,
)
from harness.partition.sparse_layout import SparsePlan
from harness.records.rankreport import LayoutSchemaError, RankReport, read_ranks

ENTRY = "layout entry"  # how a schema error names the entry it is in


def expected_pool(plan: LayoutPlan, actual: Mapping[str, Any]) -> PoolCapacity:
    """The planner's pool for the budget the run reports, sized as the engine sizes it (the entry's pool "sizing":
    whole sequence slots by default, whole blocks for vLLM); raises ConfigError (shortfall) or KeyError (no pool
    entry, or a sizing the planner does not know)."""
    pool = actual["pool"]
    size = POOL_SIZINGS[pool.get("sizing", "slots")]
    return size(plan, int(pool["budget_bytes"]), int(pool["max_seq_len"]), int(pool["block_size"]))


def _rank_problems(planned: RankLayout, got: RankReport) -> list[str]:
    r = planned.rank
    out = []
    for label, held, want in (("q heads", got.q_heads, planned.q_heads), ("kv heads", got.kv_heads, planned.kv_heads),
                              ("group q heads", got.group_q_heads, planned.group_q_heads)):
        if held != want:
            out.append(f"rank {r} holds {label} {id_ranges(held)}, planned {id_ranges(want)}")
    for key, value, want_value in (("dcp_group", got.dcp_group, planned.dcp_group),
                                   ("dcp_rank", got.dcp_rank, planned.dcp_rank),
                                   ("kv_tp_rank", got.kv_tp_rank, planned.kv_tp_rank)):
        if value != want_value:
            out.append(f"rank {r} has {key} {value}, planned {want_value}")
    if got.dcp_members != planned.dcp_members:
        out.append(f"rank {r} has DCP members {id_ranges(got.dcp_members)}, "
                   f"planned {id_ranges(planned.dcp_members)}")
    for label, shard, want in (("vocab rows (token ids)", got.vocab_shard, planned.vocab_shard),
                               ("FFN columns", got.ffn_shard, planned.ffn_shard)):
        if shard is not None and shard != want:  # [lo, hi): reported by engines that split them
            lo, hi = shard
            out.append(f"rank {r} holds {label} {lo}-{hi - 1}, planned {want[0]}-{want[1] - 1}")
    return out


def _mapping_problems(plan: LayoutPlan, got: RankReport, heads: Sequence[int], reads: Sequence[int],
                      label: str) -> list[str]:
    """Each Q head must read kv_of_q (global index), and that KV head must be held by the rank."""
    r, held = got.rank, set(got.kv_heads)
    if len(heads) != len(reads):
        return [f"rank {r} maps {len(reads)} {label}s to KV heads but holds {len(heads)}"]
    wrong = [(q, kv) for q, kv in zip(heads, reads) if kv != kv_of_q(plan.shape, q)]
    out = []
    if wrong:
        out.append(f"rank {r} {label}s {id_ranges(q for q, _ in wrong)} read KV heads "
                   f"{','.join(str(kv) for _, kv in wrong)}, should read "
                   f"{','.join(str(kv_of_q(plan.shape, q)) for q, _ in wrong)}")
    not_held = sorted({kv for kv in reads if kv not in held})
    if not_held:
        out.append(f"rank {r} {label}s read KV heads {id_ranges(not_held)} it does not hold "
                   f"(holds {id_ranges(held)})")
    return out


def _group_problems(plan: LayoutPlan, by_rank: Mapping[int, RankReport]) -> tuple[list[str], list[int]]:
    """KV head ids identical on every rank of each planned DCP group."""
    out, groups = [], []
    for members in plan.dcp_groups:
        held = {m: by_rank[m].kv_heads for m in members if m in by_rank}
        if len(set(held.values())) > 1:
            group = plan.ranks[members[0]].dcp_group
            groups.append(group)
            out.append(f"KV head ids differ inside DCP group {group}: "
                       + ", ".join(f"rank {m} holds {id_ranges(kv)}" for m, kv in held.items()))
    return out, groups


def _checksum_problems(by_rank: Mapping[int, RankReport]) -> list[str]:
    """One K/V weight checksum per KV head across every rank holding it."""
    out = []
    seen: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, got in sorted(by_rank.items()):
        sums = got.kv_weight_checksums
        extra = sorted(set(sums) - {str(kv) for kv in got.kv_heads})
        if extra:
            out.append(f"rank {r} reports K/V weight checksums of KV heads {','.join(extra)} it does not hold")
        for kv in got.kv_heads:
            if str(kv) not in sums:
                out.append(f"rank {r} reports no K/V weight checksum for KV head {kv}")
            else:
                seen[kv][sums[str(kv)]].append(r)
    for kv, by_sum in sorted(seen.items()):
        if len(by_sum) > 1:
            out.append(f"K/V weights of KV head {kv} differ between ranks holding it: "
                       + " vs ".join(f"ranks {id_ranges(rs)} ({s[:12]})" for s, rs in by_sum.items()))
    return out


def _replication_problems(plan: LayoutPlan, by_rank: Mapping[int, RankReport]) -> list[str]:
    counts = [sum(kv in got.kv_heads for got in by_rank.values()) for kv in range(plan.shape.kv_heads)]
    return [f"KV head {kv} held by {n} rank(s), planned {want}"
            for kv, (n, want) in enumerate(zip(counts, plan.kv_replicas)) if n != want]


def _pool_problems(pool: PoolCapacity, by_rank: Mapping[int, RankReport]) -> list[str]:
    out = []
    for label, want, held in (("kv pool bytes", pool.pool_bytes, {r: g.kv_pool_bytes for r, g in by_rank.items()}),
                              ("kv pool blocks", pool.blocks, {r: g.kv_pool_blocks for r, g in by_rank.items()})):
        off: dict[int, list[int]] = defaultdict(list)
        for r, value in sorted(held.items()):
            if value != want:
                off[value].append(r)
        out += [f"ranks {id_ranges(rs)} have {label} {value}, planned {want}"
                + (f" ({value / want:.2f}x)" if want else "") for value, rs in off.items()]
    return out


def reports_by_rank(actual: Mapping[str, Any]) -> dict[int, RankReport]:
    """The entry's rank reports by rank; LayoutSchemaError when the entry breaks the schema."""
    return {r.rank: r for r in read_ranks(actual, ENTRY)}


def check_layout(plan: LayoutPlan, actual: Mapping[str, Any], pool_expected: PoolCapacity | None,
                 name: str = "layout", check_checksums: bool = True, hybrid: HybridPlan | None = None,
                 indexer: SparsePlan | None = None, moe: MoePlan | None = None) -> CheckResult:
    """Compare one model's actual per-rank layout with `plan`; `pool_expected` None skips the pool. With
    `check_checksums`, every checkpoint tensor each rank holds against its planned slice (param_check.py;
    `hybrid`: the linear-attention and MoE plan of a hybrid model; `indexer`: a sparse-attention model's).
    `moe`: the experts of an MLA model, each rank's `experts` record against it (expert_check.py)."""
    try:
        by_rank = reports_by_rank(actual)
    except LayoutSchemaError as exc:
        return CheckResult(name, Verdict.ERROR, str(exc), {"problems": [str(exc)]})
    problems: list[str] = []
    planned_ranks = {r.rank for r in plan.ranks}
    if set(by_rank) != planned_ranks:
        problems.append(f"layout reports ranks {id_ranges(by_rank)}, planned {id_ranges(planned_ranks)}")
    for planned in plan.ranks:
        if planned.rank in by_rank:
            problems += _rank_problems(planned, by_rank[planned.rank])
    stored = defaultdict(list)  # KV bytes per stored token, where the engine reports it (vLLM's probe)
    for r, got in sorted(by_rank.items()):
        if got.kv_bytes_per_token not in (None, plan.kv_bytes_per_token_per_rank):
            stored[got.kv_bytes_per_token].append(r)
    problems += [f"ranks {id_ranges(rs)} store {value} KV bytes per token, planned {plan.kv_bytes_per_token_per_rank}"
                 for value, rs in stored.items()]
    group_problems, groups = _group_problems(plan, by_rank)
    problems = group_problems + problems  # the most telling problem first
    for got in by_rank.values():
        problems += _mapping_problems(plan, got, got.q_heads, got.q_to_kv, "Q head")
        if (got.group_q_heads, got.group_q_to_kv) != (got.q_heads, got.q_to_kv):
            problems += _mapping_problems(plan, got, got.group_q_heads, got.group_q_to_kv, "group Q head")
    held_off = param_problems(plan, by_rank, hybrid, indexer=indexer, moe=moe) if check_checksums else []
    if moe is not None:
        problems += expert_problems(moe, {r: got.experts for r, got in by_rank.items()})
    if check_checksums:
        problems += _checksum_problems(by_rank) + [p.text for p in held_off]
    problems += _replication_problems(plan, by_rank)
    problems += placement_problems(plan, by_rank) + q_weight_problems(plan, by_rank)
    if pool_expected is not None:
        problems += _pool_problems(pool_expected, by_rank)
    metrics: dict[str, Any] = {"problems": problems, "kv_ids_differ_in_groups": groups,
                               "params_off": [p.to_dict() for p in held_off],
                               "tp": plan.tp, "dcp": plan.dcp, "kv_replicas": list(plan.kv_replicas),
                               "pool_expected": pool_expected.to_dict() if pool_expected else None}
    if problems:
        extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name, Verdict.FAIL, problems[0] + extra, metrics)
    first = plan.ranks[0]
    pool = (f"; KV pool {pool_expected.blocks} blocks ({pool_expected.pool_bytes} bytes) per rank"
            if pool_expected else "")
    reason = (f"{len(plan.ranks)} ranks as planned: {len(first.q_heads)} Q / {len(first.kv_heads)} KV heads "
              f"per rank, KV replicas {id_ranges(set(plan.kv_replicas))}, {len(plan.dcp_groups)} DCP group(s){pool}"
              + (f"; {plan.storage_note}" if plan.storage_note else ""))
    return CheckResult(name, Verdict.PASS, reason, metrics)


def check_layout_with_pool(plan: LayoutPlan, actual: Mapping[str, Any], name: str = "layout",
                           check_pool: bool = True, check_checksums: bool = True,
                           moe: MoePlan | None = None) -> CheckResult:
    """check_layout with the expected pool sized from the budget the run reports; a budget the
    planner cannot fit one slot into is itself a problem (the run should have failed loudly)."""
    pool_note: str | None = None
    pool: PoolCapacity | None = None
    if check_pool:
        try:
            pool = expected_pool(plan, actual)
        except ConfigError as exc:
            pool_note = f"KV pool: {exc}"
        except (KeyError, TypeError, ValueError) as exc:
            return CheckResult(name, Verdict.ERROR, f"layout entry has no usable 'pool' ({exc!r})")
    result = check_layout(plan, actual, pool, name, check_checksums, moe=moe)
    if result.verdict is Verdict.ERROR:
        return result
    # the planner's pool is the function the engine sized its pool with: the pool is held to first principles too
    oracle = (pool_problems(plan.shape, plan.dcp, plan.placement, actual["pool"], reports_by_rank(actual))
              if pool is not None else [])
    if pool_note is None and not oracle:
        return result
    problems = [*([pool_note] if pool_note else []), *result.metrics["problems"],
                *(p for p in oracle if p not in result.metrics["problems"])]
    extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckResult(name, Verdict.FAIL, problems[0] + extra, {**result.metrics, "problems": problems,
                                                                  "pool_first_principles": oracle})


def kv_groups_differ(result: CheckResult) -> Sequence[int]:
    """DCP groups whose ranks hold different KV head ids, as found by check_layout."""
    return tuple(result.metrics.get("kv_ids_differ_in_groups", ()))


# ---- KV capacity an engine logs (HTTP engines: no per-rank layout report) ----------------------------------

KV_SERVERS: tuple[tuple[str, str], ...] = (("kv_capacity", "plain"), ("kv_capacity_speculative", "speculative"))


def predicted_kv_capacity(plan: LayoutPlan, pool: Mapping[str, Any],
                          speculator_plan: LayoutPlan | None) -> dict[str, int]:
    """What a server given `pool`'s budget should log (one rank): tokens a sequence pool holds (blocks x
    block_size x dcp, vLLM's count under DCP), the target pool's blocks, and the bytes of every KV pool
    of the rank: the target's plus, with a speculator, its pool of as many slots in the plain TP layout.
    Raises ConfigError when the budget cannot hold one slot."""

    cap = pool_capacity(plan, int(pool["budget_bytes"]), int(pool["max_seq_len"]), int(pool["block_size"]))
    spec_bytes = (slot_pool(speculator_plan, cap.slots, int(pool["max_seq_len"]), cap.block_size).pool_bytes
                  if speculator_plan is not None else 0)
    return {"tokens": cap.blocks * cap.block_size * plan.dcp, "blocks": cap.blocks,
            "bytes": cap.pool_bytes + spec_bytes, "target_bytes": cap.pool_bytes, "speculator_bytes": spec_bytes}


def check_kv_capacity(plan: LayoutPlan, actual: Mapping[str, Any], speculator_plan: LayoutPlan | None,
                      name: str = "layout") -> CheckResult:
    """The KV capacity each server logged (layout.json target "kv_capacity", and "kv_capacity_speculative"
    for the -draft / -mtp server) against the planner's prediction for the budget the server was given.
    Every logged quantity (tokens, blocks, bytes) must equal the prediction; a speculator pool sized from
    another layout (e.g. split like the target's DCP group) shows in the bytes."""
    logged = {server: actual.get(key) for key, server in KV_SERVERS if actual.get(key) is not None}
    if not logged:
        return CheckResult(name, Verdict.ERROR, "the server logged no KV capacity (the engine template's "
                                                "kv_capacity_pattern matched no line of its log)")
    if not actual.get("kv_budget_given"):
        return CheckResult(name, Verdict.SKIP, f"the engine is not given the harness's KV budget (no {{kv_budget_mib}} "
                                               f"in its template): logged KV capacity {logged} recorded, not compared",
                           {"logged": logged})
    problems: list[str] = []
    predicted: dict[str, dict[str, int]] = {}
    for server, got in logged.items():
        try:
            want = predicted_kv_capacity(plan, actual["pool"], speculator_plan if server == "speculative" else None)
        except ConfigError as exc:
            problems.append(f"{server} server: KV pool: {exc}")
            continue
        except (KeyError, TypeError, ValueError) as exc:
            return CheckResult(name, Verdict.ERROR, f"layout entry has no usable 'pool' ({exc!r})")
        predicted[server] = want
        for key, value in sorted(got.items()):
            if key in want and value != want[key]:
                split = (f" (target {want['target_bytes']} + speculator {want['speculator_bytes']})"
                         if key == "bytes" and want["speculator_bytes"] else "")
                problems.append(f"{server} server logged KV cache {key}={value} per rank, the planner predicts "
                                f"{want[key]}{split} for the same budget"
                                + (f" ({value / want[key]:.2f}x)" if want[key] else ""))
    metrics: dict[str, Any] = {"problems": problems, "logged": logged, "predicted": predicted}
    if problems:
        extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name, Verdict.FAIL, problems[0] + extra, metrics)
    shown = "; ".join(f"{server} server " + ", ".join(f"{k}={v}" for k, v in sorted(got.items()))
                      for server, got in logged.items())
    return CheckResult(name, Verdict.PASS, f"logged KV capacity as planned for the budget: {shown}", metrics)
