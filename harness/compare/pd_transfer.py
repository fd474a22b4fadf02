"""The checks of a disaggregated run's KV transfer, as pure functions over its record (pd.json), its
digests (pd.safetensors) and the transfer plan (harness/partition/pd_layout.py):

- transfer: every row a decode rank holds after placement against the digest the prefill side took when it
  computed that row. Which rows a rank must hold comes from the plan alone (its KV heads, the decode
  placement's token rows); which prefill rank's digest it must equal, too (the head's source group, the
  prefill placement's owner). A mismatch names the request, route, block, layer, KV heads, the decode
  rank and the prefill ranks.
- load: the load path's robustness: attempts within the policy's bound, no load that falls back (fails or
  recomputes) where the store was not damaged (its entry committed, not lost: P/D silently off), no load
  reported loaded without a successful attempt, a recompute after a failed load from position 0, every load
  ended (loaded or failed), no wait past the deadline, every rank took the same decisions, and every pool (prefill and
  decode ranks) ends with the free blocks it started with.
- consistency: the prefill world's own first new token (prefill-only) against the decode world's first
  generated token (prefill -> decode), without a reference: top-1 equal except at a near tie, top-1
  log-probabilities within CONSISTENCY_NATS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.core.fmt import id_ranges
from harness.core.verdict import CheckResult, Verdict
from harness.partition.layout import token_owner
from harness.partition.pd_layout import PDPlan
from harness.partition.pd_state import PDStatePlan

MAX_NAMED = 4             # mismatches named in a reason (the metrics hold them all, up to MAX_LISTED)
MAX_LISTED = 50
CONSISTENCY_NATS = 0.05   # prefill-only vs prefill->decode top-1 log-probability (vLLM's P/D test gates 1.5)
NEAR_TIE_NATS = 0.05      # a top-1 / top-2 gap below this: a different first token is no finding
DEADLINE_SLACK_S = 2.0    # a wait past deadline_s by more than this is a load that outlived its deadline


@dataclass
class _Mismatches:
    items: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0

    def add(self, item: dict[str, Any]) -> None:
        self.count += 1
        if len(self.items) < MAX_LISTED:
            self.items.append(item)


Sent = dict[int, tuple[torch.Tensor, dict[int, int]]]  # prefill rank -> (digests [L, kv_local, n], position -> row)


def _sent_map(plan: PDPlan, tensors: dict[str, torch.Tensor], request: int) -> Sent:
    """Per prefill rank that committed request `request`: its digests [L, kv_local, n] and position -> row."""
    out = {}
    for r in range(plan.prefill.tp):
        key = f"sent.{request}.p{r}"
        if key in tensors:
            out[r] = (tensors[key], {int(t): i for i, t in enumerate(tensors[f"{key}.pos"].tolist())})
    return out


def _describe(m: dict[str, Any]) -> str:
    where = (f"request {m['request']} ({m['route']}) block {m['block']} layer {m['layer']} KV heads "
             f"{id_ranges(m['heads'])} on decode rank {m['rank']}")
    if m["kind"] == "positions":
        return (f"request {m['request']} ({m['route']}) decode rank {m['rank']} holds positions "
                f"{id_ranges(m['held'])}, the plan gives it {id_ranges(m['planned'])}")
    if m["kind"] in ("state", "state-unsent"):
        ranks = f"prefill ranks {id_ranges(m['prefill_ranks'])}"
        what = f"differs from what {ranks} sent" if m["kind"] == "state" else f"never sent by {ranks}"
        return (f"request {m['request']} ({m['route']}) linear layer {m['layer']} state of {', '.join(m['slices'])} "
                f"on decode rank {m['rank']}: {what} (the state after {m['tokens']} tokens)")
    if m["kind"] == "unsent":
        return f"{where}: rows the prefill side never sent (prefill ranks {id_ranges(m['prefill_ranks'])})"
    return (f"{where}: digest differs from what prefill ranks {id_ranges(m['prefill_ranks'])} sent "
            f"(positions {id_ranges(m['positions'])})")


def _check_state(state: PDStatePlan, rank: int, load: dict[str, Any], tensors: dict[str, torch.Tensor],
                 found: _Mismatches) -> int:
    """A placed load's linear-attention state slices on decode rank `rank` against the digests the prefill
    ranks the state plan names took of them; returns the number of slices compared."""
    req, route, n = int(load["request"]), load["route"], int(load["tokens"])
    held = tensors[f"held_state.{route}.{req}.d{rank}"]  # [Ll, slices]
    names = state.decode[rank].names
    bad: dict[tuple[int, str], dict[str, Any]] = {}
    compared = 0
    for move in state.moves[rank]:
        sent = tensors.get(f"sent_state.{req}.p{move.src_rank}.n{n}")
        for layer in range(held.shape[0]):
            compared += 1
            if sent is None:
                kind = "state-unsent"
            elif int(sent[layer, move.src]) != int(held[layer, move.dest]):
                kind = "state"
            else:
                continue
            m = bad.setdefault((layer, kind), {"kind": kind, "request": req, "route": route, "rank": rank,
                                               "layer": layer, "block": -1, "heads": [], "slices": [],
                                               "prefill_ranks": [], "tokens": n})
            m["slices"].append(names[move.dest])
            m["prefill_ranks"] = sorted(set(m["prefill_ranks"]) | {move.src_rank})
    for m in bad.values():
        found.add(m)
    return compared


def check_transfer(plan: PDPlan, record: dict[str, Any], tensors: dict[str, torch.Tensor],
                   state: PDStatePlan | None = None) -> CheckResult:
    """Every placed row of every load against the prefill side's digest (see the module docstring); with
    a `state` plan (a hybrid model) also every placed linear-attention state slice."""
    lengths = {int(r["index"]): int(r["tokens"]) for r in record["prefill"]["requests"]}
    block = int(record["block_size"])
    found = _Mismatches()
    rows = loads = slices = 0
    for rank_rec in record["decode"]:
        rank = int(rank_rec["rank"])
        kv_heads = plan.decode.ranks[rank].kv_heads
        heads = plan.ranks[rank].heads
        for load in rank_rec["loads"]:
            if load["state"] != "loaded" and load["resume_offset"] == 0:
                continue  # nothing placed: the request computed its prompt itself
            loads += 1
            req, route, n = int(load["request"]), load["route"], int(load["tokens"])
            key = f"held.{route}.{req}.d{rank}"
            held, held_pos = tensors[key], tensors[f"{key}.pos"].tolist()
            planned = [t for t in plan.owned_positions(rank, lengths[req]) if t < n]
            if held_pos != planned:
                found.add({"kind": "positions", "request": req, "route": route, "rank": rank, "held": held_pos,
                           "planned": planned, "block": -1, "layer": -1, "heads": []})
            sent = _sent_map(plan, tensors, req)
            bad: dict[tuple[int, int, str], dict[str, Any]] = {}
            for s, t in enumerate(held_pos):
                for slot, head in enumerate(heads):
                    owner = token_owner(t, plan.prefill.dcp, plan.prefill.placement, lengths[req])
                    src = head.sources[owner]
                    for layer in range(held.shape[0]):
                        rows += 1
                        entry = sent.get(src)
                        if entry is None or t not in entry[1]:
                            kind = "unsent"
                        elif int(entry[0][layer, head.src_slots[owner], entry[1][t]]) != int(held[layer, slot, s]):
                            kind = "digest"
                        else:
                            continue
                        m = bad.setdefault((t // block, layer, kind), {
                            "kind": kind, "request": req, "route": route, "rank": rank, "block": t // block,
                            "layer": layer, "heads": [], "prefill_ranks": [], "positions": []})
                        m["heads"] = sorted(set(m["heads"]) | {kv_heads[slot]})
                        m["prefill_ranks"] = sorted(set(m["prefill_ranks"]) | {src})
                        m["positions"] = sorted(set(m["positions"]) | {t})
            for m in bad.values():
                found.add(m)
            if state is not None:
                slices += _check_state(state, rank, load, tensors, found)
    metrics = {"loads_checked": loads, "rows_checked": rows, "mismatches": found.count,
               "first_mismatches": found.items, **({"state_slices_checked": slices} if state is not None else {})}
    if found.count:
        named = "; ".join(_describe(m) for m in found.items[:MAX_NAMED])
        return CheckResult("pd_transfer", Verdict.FAIL, f"{found.count} transferred block(s) or state slice(s) differ "
                           f"from what the prefill side sent: {named}", metrics)
    if not loads:
        return CheckResult("pd_transfer", Verdict.SKIP, "no load placed any row (every request computed its prompt)",
                           metrics)
    extra = f" and {slices} linear-attention state slices (each in each linear layer)" if state is not None else ""
    return CheckResult("pd_transfer", Verdict.PASS, f"{rows} rows{extra} of {loads} loads on {plan.decode.tp} "
                       f"decode rank(s) equal what the prefill side sent, each where the plan puts it", metrics)


def check_load(record: dict[str, Any], damage: str = "") -> CheckResult:
    """The load path's robustness and pool accounting (see the module docstring); `damage` names the store damage
    the run applied between its phases ('' without: then a load falls back only for an entry lost)."""
    policy = record["policy"]
    bound, deadline = int(policy["max_attempts"]), float(policy["deadline_s"])
    problems: list[str] = []
    by_key: dict[tuple[str, int], set[tuple[str, str, int]]] = {}
    retried = recomputed = total = 0
    for rank_rec in record["decode"]:
        rank = rank_rec["rank"]
        for load in rank_rec["loads"]:
            total += 1
            name = f"request {load['request']} ({load['route']}) on decode rank {rank}"
            attempts = load["attempts"]
            retried += len(attempts) > 1
            by_key.setdefault((load["route"], load["request"]), set()).add(
                (load["state"], load["outcome"], load["resume_offset"]))
            if len(attempts) > bound:
                problems.append(f"{name}: {len(attempts)} load attempts, the policy bounds them at {bound}; it held "
                                f"{load['blocks_held']} block(s) meanwhile")
            if load["state"] == "loaded" and "ok" not in attempts:
                problems.append(f"{name}: reported loaded though every attempt failed ({len(attempts)}: "
                                f"{attempts[-1] if attempts else 'none'}); decoded on blocks that never loaded")
            if load["state"] not in ("loaded", "failed"):
                problems.append(f"{name}: left in state {load['state']}")
            if load["outcome"] == "recomputed":
                recomputed += 1
                if load["resume_offset"] != 0:
                    problems.append(f"{name}: recomputed after a failed load from position {load['resume_offset']}, "
                                    f"not 0 (the {load['resume_offset']} tokens before it never loaded)")
            if load["waited_s"] > deadline + DEADLINE_SLACK_S:
                problems.append(f"{name}: waited {load['waited_s']:.1f} s, past its {deadline:g} s deadline")
    for (route, req), outcomes in by_key.items():
        if len(outcomes) > 1:
            problems.append(f"request {req} ({route}): the decode ranks ended its load differently: {sorted(outcomes)}")
    pools = [(side, rank, pool) for side, ranks in (("decode", [(r["rank"], r["pool"]) for r in record["decode"]]),
                                                     ("prefill", list(enumerate(record["prefill"]["ranks"]))))
             for rank, pool in ranks]
    unrecorded = sum(1 for _, _, pool in pools if pool["free_start"] is None or pool["free_end"] is None)
    for side, rank, pool in pools:
        if None not in (pool["free_start"], pool["free_end"]) and pool["free_end"] != pool["free_start"]:
            problems.append(f"{side} rank {rank}: its KV pool ends with {pool['free_end']} free blocks, it "
                            f"started with {pool['free_start']} ({pool['free_start'] - pool['free_end']} not "
                            f"returned)")
    balance = ("every pool balanced" if not unrecorded else
               "pools not checked: no rank record holds free-block counts (the engine's scheduler owns its pool)"
               if unrecorded == len(pools) else
               f"the recorded pools balanced ({unrecorded} of {len(pools)} rank records hold no free-block counts)")
    lost = sorted({i for r in record["prefill"]["ranks"] for i in r.get("lost", [])})
    # a load may fall back (fail, recompute) only where the store was damaged: every other fallback is P/D silently
    # off, whatever the outputs say (a recompute gives the right tokens)
    fallback = sorted({(load["request"], load["route"]) for rank_rec in record["decode"] for load in rank_rec["loads"]
                       if (load["state"] == "failed" or load["outcome"] != "loaded") and load["request"] not in lost
                       and not damage})
    if fallback:
        problems.insert(0, f"{len(fallback)} of {len(by_key)} loads fell back on an undamaged store (requests "
                           f"{id_ranges({r for r, _ in fallback})}: their entries were committed, none lost): P/D "
                           f"was silently off; a fallback is legitimate only under store damage")
    metrics = {"loads": total, "retried": retried, "recomputed": recomputed, "lost_entries": lost,
               "fallback_undamaged": [list(f) for f in fallback],
               "policy": policy, "problems": problems[:MAX_LISTED]}
    if problems:
        return CheckResult("pd_load", Verdict.FAIL, f"{len(problems)} load-path problem(s): "
                           + "; ".join(problems[:MAX_NAMED]), metrics)
    return CheckResult("pd_load", Verdict.PASS, f"{total} loads: {retried} retried, {recomputed} recomputed from 0 "
                       f"(policy {policy['on_failure']}, at most {bound} attempts)"
                       + (f", stored entries lost: requests {id_ranges(lost)}" if lost else "")
                       + f"; {balance}", metrics)


def check_consistency(prefill_only: list[tuple[torch.Tensor, torch.Tensor]],
                      decoded: list[tuple[torch.Tensor, torch.Tensor]]) -> CheckResult:
    """Per request (top-k ids, logprobs) of the first new token: the prefill world's vs the decode world's."""
    problems = []
    worst = 0.0
    for i, ((pid, plp), (did, dlp)) in enumerate(zip(prefill_only, decoded)):
        if did.numel() == 0:
            problems.append(f"request {i}: the decode world generated nothing")
            continue
        delta = abs(float(plp[0]) - float(dlp[0]))
        worst = max(worst, delta)
        gap = float(plp[0] - plp[1]) if plp.numel() > 1 else float("inf")
        if int(pid[0]) != int(did[0]) and gap >= NEAR_TIE_NATS:
            problems.append(f"request {i}: first token {int(did[0])} after the transfer, {int(pid[0])} on the prefill "
                            f"side (top-1/top-2 gap {gap:.3f} nats)")
        elif delta > CONSISTENCY_NATS and int(pid[0]) == int(did[0]):
            problems.append(f"request {i}: top-1 log-probability {float(dlp[0]):.4f} after the transfer, "
                            f"{float(plp[0]):.4f} on the prefill side (delta {delta:.4f} > {CONSISTENCY_NATS})")
    metrics = {"requests": len(decoded), "max_top1_logprob_delta": worst, "tolerance_nats": CONSISTENCY_NATS}
    if problems:
        return CheckResult("pd_consistency", Verdict.FAIL, "; ".join(problems[:MAX_NAMED]), metrics)
    return CheckResult("pd_consistency", Verdict.PASS, f"{len(decoded)} requests: the first token after the transfer "
                       f"equals the prefill side's, top-1 logprob delta at most {worst:.2e} nats", metrics)
