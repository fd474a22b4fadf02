"""A hybrid model's linear-attention state through disaggregated prefill/decode: the state plan against a
global state split by both sides' own shard rules (every decode slice equals the global state's at that
head, for every pair of layouts), the digest per slice, the transfer check naming a wrong slice, and the
pd-state-conv-shift fault's scope."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.arch.model import model_of
from harness.compare.pd_transfer import check_transfer
from harness.core.verdict import Verdict
from harness.engine.fault_scope import inert_reason
from harness.engine.pd.state import assemble, state_digests
from harness.formats.locate import load_model
from harness.partition.hybrid_layout import HybridShape, LinearRank, plan_hybrid
from harness.partition.layout import AttentionShape
from harness.partition.pd_layout import plan_pd, plan_pd_state
from harness.partition.pd_state import plan_state_moves, same_rank_moves
from harness.specs.topology import parse_topology_name

SHAPE = AttentionShape(heads=12, kv_heads=2, head_dim=4, layers=8, dtype_bytes=4)
HYB = HybridShape(linear_k_heads=2, linear_v_heads=6, linear_k_dim=4, linear_v_dim=3, conv_kernel=4)
LAYOUTS = [(1, 1), (2, 1), (4, 1), (3, 1), (6, 1), (4, 2), (2, 2)]  # (tp, dcp)
LAYERS = 3


def _global_state() -> tuple[torch.Tensor, torch.Tensor]:
    """A state with every element distinct: conv [Ll, C, K - 1], recurrent [Ll, Hv, Dk, Dv]."""
    channels = 2 * HYB.linear_k_heads * HYB.linear_k_dim + HYB.linear_v_heads * HYB.linear_v_dim
    conv = torch.arange(LAYERS * channels * (HYB.conv_kernel - 1), dtype=torch.float32).view(LAYERS, channels, -1)
    rec = -torch.arange(LAYERS * HYB.linear_v_heads * HYB.linear_k_dim * HYB.linear_v_dim,
                        dtype=torch.float32).view(LAYERS, HYB.linear_v_heads, HYB.linear_k_dim, HYB.linear_v_dim)
    return conv, rec


def _local(lin: LinearRank, conv: torch.Tensor, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank `lin` holds of the global state: its packed q|k|v rows and its V heads (the engine's shard rule)."""
    rows = [g for lo, hi in lin.conv_rows for g in range(lo, hi)]
    return conv[:, rows], rec[:, list(lin.v_heads)]


@pytest.mark.parametrize(("pre", "dec"), list(itertools.product(LAYOUTS, LAYOUTS)))
def test_every_decode_state_slice_is_the_global_state_at_its_heads(pre: tuple[int, int], dec: tuple[int, int]) -> None:
    p, d = plan_hybrid(SHAPE, HYB, *pre).linear, plan_hybrid(SHAPE, HYB, *dec).linear
    plan = plan_state_moves(HYB, p, d, plan_pd_state(p, d))
    conv, rec = _global_state()
    sources = {r.rank: _local(r, conv, rec) for r in p.ranks}
    for lin in d.ranks:
        want = _local(lin, conv, rec)
        got = assemble(sources, plan.prefill, plan.decode[lin.rank], plan.moves[lin.rank], want[0], want[1])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (pre, dec, lin.rank)
        # every element of the rank's state is in exactly one slice or shared by a K head's V heads
        covered = {r for rows in plan.decode[lin.rank].conv for r in rows}
        assert covered == set(range(want[0].shape[1]))


def _cell(tamper: str = "") -> tuple[dict, dict[str, torch.Tensor], object, object]:
    """A tp4 -> tp2 transfer of one request's state (3 tokens), digests as the worker leaves them."""
    p, d = plan_hybrid(SHAPE, HYB, 4).linear, plan_hybrid(SHAPE, HYB, 2).linear
    plan = plan_state_moves(HYB, p, d, plan_pd_state(p, d))
    pd = plan_pd(plan_hybrid(SHAPE, HYB, 4).attention, plan_hybrid(SHAPE, HYB, 2).attention)
    conv, rec = _global_state()
    tensors: dict[str, torch.Tensor] = {}
    for r in p.ranks:
        tensors[f"sent_state.0.p{r.rank}.n3"] = state_digests(*_local(r, conv, rec), plan.prefill[r.rank])
        tensors[f"sent.0.p{r.rank}"] = torch.zeros((1, 1, 0), dtype=torch.long)
        tensors[f"sent.0.p{r.rank}.pos"] = torch.zeros(0, dtype=torch.long)
    sources = {r.rank: _local(r, conv, rec) for r in p.ranks}
    for r in d.ranks:
        held_conv, held_rec = _local(r, conv, rec)
        if tamper == "rank":  # the pd-state-same-rank fault's moves: decode rank 1 reads prefill rank 1 (heads 0-2)
            held_conv, held_rec = assemble(sources, plan.prefill, plan.decode[r.rank], same_rank_moves(plan, r.rank),
                                           held_conv, held_rec)
        tensors[f"held_state.decode_path.0.d{r.rank}"] = state_digests(held_conv, held_rec, plan.decode[r.rank])
        tensors[f"held.decode_path.0.d{r.rank}"] = torch.zeros((1, 1, 0), dtype=torch.long)
        tensors[f"held.decode_path.0.d{r.rank}.pos"] = torch.zeros(0, dtype=torch.long)
    load = {"request": 0, "route": "decode_path", "tokens": 3, "state": "loaded", "resume_offset": 0}
    record = {"prefill": {"requests": [{"index": 0, "tokens": 0}]}, "block_size": 16,
              "decode": [{"rank": r.rank, "loads": [load]} for r in d.ranks]}
    return record, tensors, pd, plan


def test_the_transfer_check_passes_a_clean_state_and_names_a_slice_from_the_wrong_rank() -> None:
    record, tensors, pd, plan = _cell()
    clean = check_transfer(pd, record, tensors, plan)
    assert clean.verdict == Verdict.PASS and clean.metrics["state_slices_checked"] == 2 * 4 * LAYERS
    record, tensors, pd, plan = _cell("rank")
    bad = check_transfer(pd, record, tensors, plan)
    assert bad.verdict == Verdict.FAIL
    assert ("request 0 (decode_path) linear layer 0 state of V head 3, V head 4, V head 5, K head 1 on decode rank 1: "
            "differs from what prefill ranks 2 sent (the state after 3 tokens)") in bad.reason
    assert bad.metrics["mismatches"] == LAYERS  # one per linear layer; decode rank 0's state (prefill rank 0's) right


def test_the_same_rank_moves_differ_only_where_the_prefill_rank_of_that_number_holds_other_heads() -> None:
    for pre, dec, differs in ((4, 2, {1}), (2, 2, set()), (2, 1, set()), (1, 2, set()), (2, 4, {1})):
        p, d = plan_hybrid(SHAPE, HYB, pre).linear, plan_hybrid(SHAPE, HYB, dec).linear
        plan = plan_state_moves(HYB, p, d, plan_pd_state(p, d))
        assert {r for r in range(dec) if same_rank_moves(plan, r) != plan.moves[r]} == differs, (pre, dec)


def test_the_conv_shift_fault_acts_on_linear_attention_only() -> None:
    topo = parse_topology_name("tp4>tp2")
    assert "inert on tiny-gqa" in (inert_reason("pd-state-conv-shift", load_model("tiny-gqa"), topo) or "")
    assert "inert on tiny-mla" in (inert_reason("pd-state-conv-shift", load_model("tiny-mla"), topo) or "")
    assert inert_reason("pd-state-conv-shift", load_model("tiny-hybrid"), topo) is None
    assert model_of(load_model("tiny-hybrid")).hybrid_shape().linear_v_heads == 6
