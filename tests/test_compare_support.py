"""Builders of in-memory runs for the compare tests (real tensors and RunArtifacts, no mocks),
and self-checks of the builders."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from harness.partition.layout import AttentionShape, LayoutPlan, naive_local_kv_index, plan_layout, pool_capacity
from harness.records.artifacts import Case, RunArtifacts
from harness.records.contract import COLLECTIVE_SITES

GQA = AttentionShape(heads=8, kv_heads=2, head_dim=4, layers=2, dtype_bytes=4)
BUDGET, MAX_SEQ, BLOCK = 1 << 20, 64, 16
EPS = 1e-6  # relative size of the simulated rounding noise


def layout_entry(plan: LayoutPlan, q_map: str = "global", checksums: dict[int, str] | None = None,
                 pool_plan: LayoutPlan | None = None, budget_bytes: int = BUDGET) -> dict[str, Any]:
    """layout.json's "target" entry as a correct engine would write it for `plan`.

    q_map "naive" maps Q heads with the buggy local repeat_interleave; `pool_plan` sizes the pool
    from another plan (an engine that sized its pool from the wrong layout)."""
    pool = pool_capacity(pool_plan or plan, budget_bytes, MAX_SEQ, BLOCK)
    ranks = []
    for r in plan.ranks:
        own = naive_local_kv_index(len(r.q_heads), len(r.kv_heads)) if q_map == "naive" else r.q_to_local_kv
        group = (naive_local_kv_index(len(r.group_q_heads), len(r.kv_heads)) if q_map == "naive"
                 else r.group_q_to_local_kv)
        sums = checksums or {}
        ranks.append({
            "rank": r.rank, "q_heads": list(r.q_heads), "kv_heads": list(r.kv_heads), "dcp_group": r.dcp_group,
            "dcp_rank": r.dcp_rank, "dcp_members": list(r.dcp_members), "kv_tp_rank": r.kv_tp_rank,
            "q_to_kv": [r.kv_heads[i] for i in own], "group_q_heads": list(r.group_q_heads),
            "group_q_to_kv": [r.kv_heads[i] for i in group], "kv_pool_bytes": pool.pool_bytes,
            "kv_pool_blocks": pool.blocks,
            "kv_weight_checksums": {str(kv): sums.get(kv, f"{kv * 2654435761 % 2**32:08x}") for kv in r.kv_heads}})
    return {"ranks": ranks, "pool": {"budget_bytes": budget_bytes, "block_size": BLOCK, "max_seq_len": MAX_SEQ}}


def make_run(name: str, tensors: dict[str, torch.Tensor], cases: list[Case],
             layout: dict[str, Any] | None = None) -> RunArtifacts:
    return RunArtifacts(path=Path(name), manifest={"status": "ok", "dtype": "float32"},
                        layout={"target": layout} if layout else {}, cases=cases, tensors=tensors)


def with_tensors(run: RunArtifacts, **updates: torch.Tensor) -> RunArtifacts:
    """A copy of `run` with tensors replaced, keys given as prefill_logits_0 for prefill_logits.0."""
    tensors = dict(run.tensors)
    for key, value in updates.items():
        kind, index = key.rsplit("_", 1)
        tensors[f"{kind}.{index}"] = value
    return replace(run, tensors=tensors)


def synthetic_runs(plan: LayoutPlan, n_cases: int = 2, seq: int = 8, decode_start: int = 4, vocab: int = 32,
                   probes: int = 3, hidden: int = 16, gen: int = 6, k: int = 4,
                   seed: int = 0) -> tuple[RunArtifacts, RunArtifacts, RunArtifacts]:
    """(reference, noise, clean parallel) runs: the noise run is the exact value, the reference and
    the parallel run each carry independent rounding-sized noise (EPS) around it."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    shape = plan.shape
    exact: dict[str, torch.Tensor] = {}
    cases = []
    for i in range(n_cases):
        exact[f"prefill_logits.{i}"] = 3 * randn(seq, vocab)
        exact[f"decode_logits.{i}"] = exact[f"prefill_logits.{i}"][decode_start:]
        exact[f"hidden.{i}"] = randn(shape.layers + 1, probes, hidden)
        exact[f"attn.{i}"] = randn(shape.layers, probes, shape.heads, shape.head_dim)
        tokens = torch.randint(0, vocab, (gen,), generator=g)
        ids = torch.stack([torch.roll(torch.arange(vocab), -int(t))[:k] for t in tokens])  # [gen, k]
        exact[f"gen_tokens.{i}"] = tokens
        exact[f"gen_topk_ids.{i}"] = ids
        exact[f"gen_topk_logprobs.{i}"] = -torch.arange(k, dtype=torch.float64).repeat(gen, 1) - 0.1  # gaps of 1
        cases.append(Case(index=i, prompt=f"prompt <{i}>", prompt_ids=tuple(range(decode_start)),
                          sequence_ids=tuple(range(seq)), decode_start=decode_start,
                          probe_positions=tuple(range(decode_start, decode_start + probes)),
                          generated_ids=tuple(tokens.tolist()), generated_text=f"text {i}"))

    def jitter(t: torch.Tensor) -> torch.Tensor:
        return t if not t.is_floating_point() else t + EPS * t.abs().mean() * randn(*t.shape)

    ref = make_run("ref", {k_: jitter(v) for k_, v in exact.items()}, cases, layout_entry(plan_layout(shape, 1)))
    # the parallel run's collectives, each within half a rounding of an exact recompute as real runs measure
    sites = {f"collectives.{i}": 0.5 * torch.rand(plan.tp, shape.layers, probes, len(COLLECTIVE_SITES), generator=g,
                                                  dtype=torch.float64) for i in range(n_cases)}
    par = make_run("par", {**{k_: jitter(v) for k_, v in exact.items()}, **sites}, cases, layout_entry(plan))
    noise = make_run("noise", dict(exact), cases)
    return ref, noise, par


def test_layout_entry_follows_the_plan() -> None:
    plan = plan_layout(GQA, 4, 2)
    entry = layout_entry(plan)
    assert [r["kv_heads"] for r in entry["ranks"]] == [list(r.kv_heads) for r in plan.ranks]
    assert [r["q_to_kv"] for r in entry["ranks"]] == [list(r.q_to_kv) for r in plan.ranks]


def test_synthetic_runs_differ_only_by_rounding_noise() -> None:
    ref, noise, par = synthetic_runs(plan_layout(GQA, 4, 2))
    diff = (ref.tensors["prefill_logits.0"] - par.tensors["prefill_logits.0"]).abs().max()
    assert 0 < float(diff) < 1e-4
    assert torch.equal(ref.tensors["gen_tokens.1"], noise.tensors["gen_tokens.1"])
