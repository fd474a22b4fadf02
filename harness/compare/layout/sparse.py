"""The sparse-attention part of the layout check: each rank's indexer (its heads, their weight checksums
against the reference's, the replicated key projection), its cache groups (one slot count, slot-aligned,
the KV and indexer-key rows of its DCP share) and its selected token sets, per layer and query, against the
reference's (a mismatch names the query, the layer and the rank: the divergence starts at the indexer's
selection). A selection that differs only where the reference's own scores were a near tie (relative margin
between its last selected and first unselected token below a bound: a floor, or a multiple of the largest
margin at which the noise run's own selection moved) is not a mismatch."""

from __future__ import annotations

from typing import Any, Mapping

from harness.compare.layout.attention import check_layout, reports_by_rank
from harness.core.errors import ConfigError
from harness.core.fmt import id_ranges
from harness.core.verdict import CheckResult, Verdict
from harness.partition.cache_groups import GroupedCapacity, grouped_capacity, unaligned_groups
from harness.partition.layout import LayoutPlan
from harness.partition.sparse_layout import INDEX_GROUP, SparsePlan, kv_pool_of, sparse_cache_groups
from harness.records.rankreport import LayoutSchemaError, SparseReport

SHOWN = 3  # selection mismatches spelled out in the problems (the rest counted)


def _capacity(plan: LayoutPlan, indexer: SparsePlan, pool: Mapping[str, Any]) -> GroupedCapacity:
    groups = sparse_cache_groups(plan, indexer, int(pool["max_seq_len"]), int(pool["block_size"]))
    return grouped_capacity(groups, int(pool["budget_bytes"]))


def indexer_problems(indexer: SparsePlan, by_rank: Mapping[int, SparseReport],
                     ref: SparseReport | None) -> list[str]:
    """Indexer heads per rank as planned, their weights the reference's, one key projection everywhere."""
    out = []
    for planned in indexer.ranks:
        got = by_rank.get(planned.rank)
        if got is None:
            out.append(f"rank {planned.rank} reports no sparse (indexer) record")
            continue
        if got.index_heads != planned.index_heads:
            out.append(f"rank {planned.rank} holds indexer heads {id_ranges(got.index_heads)}, planned "
                       f"{id_ranges(planned.index_heads)}")
        for head, digest in sorted(got.index_weight_checksums.items()) if ref is not None else ():
            want = ref.index_weight_checksums.get(head)
            if want is not None and want != digest:
                out.append(f"rank {planned.rank}'s indexer head {head} weights differ from the reference's "
                           f"(checksum {digest} vs {want})")
    keys = {r.index_key_checksum for r in by_rank.values()} | ({ref.index_key_checksum} if ref else set())
    if len(keys) > 1:
        out.append(f"the indexer key projection differs between ranks / the reference ({len(keys)} versions); it "
                   f"is replicated")
    return out


def group_problems(grouped: GroupedCapacity, by_rank: Mapping[int, SparseReport]) -> list[str]:
    """Every rank's cache groups hold the planned slot-aligned blocks (its DCP share of rows per slot)."""
    out = []
    for r, got in sorted(by_rank.items()):
        out += [f"rank {r}: {p}" for p in unaligned_groups(grouped, got.cache_group_blocks)]
        rows = got.cache_group_blocks.get(INDEX_GROUP, 0) * got.block_size
        want = grouped.blocks(INDEX_GROUP) * got.block_size
        if rows != want and not any(INDEX_GROUP in p for p in out):
            out.append(f"rank {r} holds {rows} indexer key rows, planned {want}")
    return out


def near_tie_bound(ref: SparseReport, noise: SparseReport | None, floor: float, factor: float) -> float:
    """The reference margin below which a selection may differ: `floor`, or `factor` x the largest margin at
    which the noise run (a correct engine, another reduction order) selected differently, capped at 1."""
    flipped = [ref.margins[layer][query] for layer, (mine, theirs) in
               enumerate(zip(noise.selected, ref.selected) if noise is not None else ())
               for query, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    return min(1.0, max([floor, *(factor * m for m in flipped)]))


SELECTION_KEY = "selection_diverges"  # the layout metrics' first selection mismatch (localization reads it)


def selection_problems(ref: SparseReport, by_rank: Mapping[int, SparseReport],
                       tie: float) -> tuple[list[str], dict[str, Any] | None]:
    """Each rank's selected token sets against the reference's, layer by layer, query by query; and the
    first mismatch in (layer, query, rank) order, {layer, query, rank, summary}, or None."""
    mismatches: list[str] = []
    first: tuple[int, int, int, str] | None = None
    for r, got in sorted(by_rank.items()):
        if len(got.selected) != len(ref.selected):
            mismatches.append(f"rank {r} traced {len(got.selected)} layers of selections, the reference "
                              f"{len(ref.selected)}")
            continue
        for layer, (mine, theirs) in enumerate(zip(got.selected, ref.selected)):
            if len(mine) != len(theirs):
                mismatches.append(f"rank {r} layer {layer}: {len(mine)} queries traced, the reference {len(theirs)}")
                continue
            for query, (a, b) in enumerate(zip(mine, theirs)):
                if a == b or ref.margins[layer][query] < tie:
                    continue
                extra, missing = sorted(set(a) - set(b)), sorted(set(b) - set(a))
                line = (f"query {query} layer {layer} rank {r}: selected tokens differ from the reference's "
                        f"(reads {extra or 'none'} it does not, misses {missing or 'none'})")
                mismatches.append(line)
                if first is None or (layer, query, r) < first[:3]:
                    first = (layer, query, r, line)
    if not mismatches or first is None:
        return mismatches, None
    head = [first[3], *(m for m in mismatches if m != first[3])][:SHOWN]
    more = f" (and {len(mismatches) - SHOWN} more query/layer/rank selections)" if len(mismatches) > SHOWN else ""
    return ([f"divergence starts at the indexer's top-k selection: {head[0]}{more}", *head[1:]],
            {"layer": first[0], "query": first[1], "rank": first[2], "summary": first[3]})


def _first_sparse(entry: Mapping[str, Any] | None) -> SparseReport | None:
    """Rank 0's sparse record of a layout.json target entry (every rank of a reference traces alike)."""
    if entry is None:
        return None
    return next((report.sparse for report in reports_by_rank(entry).values()), None)


def check_sparse_layout(plan: LayoutPlan, indexer: SparsePlan, actual: Mapping[str, Any],
                        ref_actual: Mapping[str, Any] | None, name: str = "layout", check_pool: bool = True,
                        check_checksums: bool = True, tie: float = 1e-6,
                        noise_actual: Mapping[str, Any] | None = None, tie_factor: float = 4.0) -> CheckResult:
    """The attention layout (its pool the KV group of the grouped capacity), the indexer, the cache groups
    and the selection trace against the reference run's (`ref_actual`, its layout.json target entry), near
    ties bounded by the noise run's (`noise_actual`, near_tie_bound)."""
    grouped = None
    problems: list[str] = []
    if check_pool:
        try:
            grouped = _capacity(plan, indexer, actual["pool"])
        except ConfigError as exc:
            problems.append(f"cache groups: {exc}")
        except (KeyError, TypeError, ValueError) as exc:
            return CheckResult(name, Verdict.ERROR, f"layout entry has no usable 'pool' ({exc!r})")
    pool = kv_pool_of(grouped, int(actual["pool"]["block_size"])) if grouped is not None else None
    base = check_layout(plan, actual, pool, name, check_checksums, indexer=indexer)
    if base.verdict is Verdict.ERROR:
        return base
    reports = reports_by_rank(actual)
    by_rank = {r: report.sparse for r, report in reports.items() if report.sparse is not None}
    try:
        ref, noise = _first_sparse(ref_actual), _first_sparse(noise_actual)
    except LayoutSchemaError as exc:
        return CheckResult(name, Verdict.ERROR, f"reference or noise run: {exc}")
    problems += indexer_problems(indexer, by_rank, ref)
    if grouped is not None:
        problems += group_problems(grouped, by_rank)
    traced = ""
    diverges = None
    bound = tie
    if ref is not None:
        bound = near_tie_bound(ref, noise, tie, tie_factor)
        selection, diverges = selection_problems(ref, by_rank, bound)
        problems = selection + problems  # where the divergence starts, first
        traced = (f"; selected token sets of {sum(len(layer) for layer in ref.selected)} query/layer pairs match "
                  f"the reference's on every rank (near ties excused: reference margin below {bound:.1e})")
    problems += base.metrics["problems"]
    metrics = {**base.metrics, "problems": problems, "indexer": indexer.to_dict(),
               "cache_groups": grouped.to_dict() if grouped is not None else None, SELECTION_KEY: diverges,
               "selection_tie": bound}
    if problems:
        extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(name, Verdict.FAIL, problems[0] + extra, metrics)
    slots = f"; cache groups kv + index_keys from one count of {grouped.slots} slots" if grouped else ""
    return CheckResult(name, Verdict.PASS, f"{base.reason}; indexer heads as planned{slots}{traced}", metrics)
