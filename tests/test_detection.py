"""Detection-power pieces on constructed data: collective localization, inert faults, ragged decode
starts, the noise run selection."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.cases import ragged_decode_start
from harness.compare.parity.collectives import check_collectives
from harness.compare.parity.localize import localize
from harness.compare.settings import CollectiveSettings, LocalizationSettings
from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.engine.fault_scope import inert_reason
from harness.engine.faults import FAULTS, PERTURBATIONS, fault_flags
from harness.engine.layers.dense import COLLECTIVE_SITES
from harness.flow.runner import noise_run
from harness.formats.locate import load_model
from harness.partition.layout import plan_layout
from harness.specs.topology import parse_topology_name
from tests.test_compare_support import GQA, synthetic_runs, with_tensors


def _collectives(tp: int, layers: int, probes: int, broken: tuple[int, str, list[int]] | None,
                 error: float = 100.0) -> torch.Tensor:
    """[tp, L, P, sites] errors in unit roundoffs as a correct run has them (half a rounding), one
    (layer, site, ranks) raised to `error`."""
    t = torch.full((tp, layers, probes, len(COLLECTIVE_SITES)), 0.5)
    if broken is not None:
        layer, site, ranks = broken
        t[ranks, layer, :, COLLECTIVE_SITES.index(site)] = error
    return t


def _layers_off(t: torch.Tensor) -> torch.Tensor:
    """hidden [L+1, P, H] with every layer's output (not the embedding) 10% off."""
    out = t.clone()
    out[1:] *= 1.1
    return out


def test_a_broken_collective_is_named_with_its_ranks_before_the_layer_rule() -> None:
    plan = plan_layout(GQA, 4, 2)
    ref, noise, par = synthetic_runs(plan)
    settings = LocalizationSettings()
    layers = GQA.layers
    # the parallel run's layer 0 output diverges, and its attention all-reduce is wrong on ranks 2, 3
    bad = with_tensors(par, **{f"hidden_{i}": _layers_off(par.tensors[f"hidden.{i}"]) for i in range(2)},
                       **{f"collectives_{i}": _collectives(4, layers, 3, (0, "attn-allreduce", [2, 3]))
                          for i in range(2)})
    loc, details = localize(ref, bad, noise, plan, ref.cases, settings)
    assert loc is not None and loc.layer == 0 and loc.ranks == (2, 3), loc
    assert "TP all-reduce of the attention output projection is wrong on ranks 2-3" in loc.summary
    assert details["collectives"]["bounds"] == [CollectiveSettings().bound(site, 4) for site in COLLECTIVE_SITES]
    # an earlier site in execution order wins: the LSE merge runs before the all-reduce
    both = _collectives(4, layers, 3, (0, "attn-allreduce", [2, 3]))
    both[:, 0, :, COLLECTIVE_SITES.index("dcp-lse-merge")] = 1e3
    loc2, _ = localize(ref, with_tensors(bad, collectives_0=both), noise, plan, ref.cases, settings)
    assert loc2 is not None and "DCP LSE merge" in loc2.summary and loc2.ranks == (0, 1, 2, 3)


def test_exact_collectives_leave_the_layer_rule_in_charge() -> None:
    plan = plan_layout(GQA, 4, 2)
    ref, noise, par = synthetic_runs(plan)
    clean = {f"collectives_{i}": _collectives(4, GQA.layers, 3, None) for i in range(2)}
    assert localize(ref, with_tensors(par, **clean), noise, plan, ref.cases, LocalizationSettings())[0] is None
    mlp = with_tensors(par, **clean, **{f"hidden_{i}": _layers_off(par.tensors[f"hidden.{i}"]) for i in range(2)})
    loc, _ = localize(ref, mlp, noise, plan, ref.cases, LocalizationSettings())
    assert loc is not None and "all-reduce" not in loc.summary


def test_collective_bounds_come_from_rounding_analysis() -> None:
    s = CollectiveSettings()
    # a correct all-reduce of tp partials rounds at most tp - 1 times: the bound (in u x sum|partials|) is tp
    assert [s.bound("attn-allreduce", tp) for tp in (1, 2, 8)] == [1.0, 2.0, 8.0]
    assert s.bound("dcp-lse-merge", 4) == 4 * s.bound("dcp-lse-merge", 1) > s.bound("mlp-allreduce", 4)


def test_collectives_check_fails_on_the_first_broken_site_and_passes_within_rounding() -> None:
    plan = plan_layout(GQA, 2, 1)
    ref, _, par = synthetic_runs(plan)
    settings = CollectiveSettings()
    clean = with_tensors(par, **{f"collectives_{i}": _collectives(2, GQA.layers, 3, None) for i in range(2)})
    ok = check_collectives(clean, ref.cases, 2, 1, settings)
    assert ok.verdict is Verdict.PASS and "largest 0.25 of its bound" in ok.reason, ok.reason
    # a bf16 all-reduce in a float16 model: ~8 float16 roundings per partial, on both ranks, from layer 1 on
    low = _collectives(2, GQA.layers, 3, None)
    low[:, 1:, :, COLLECTIVE_SITES.index("mlp-allreduce")] = 7.9
    bad = check_collectives(with_tensors(clean, collectives_1=low), ref.cases, 2, 1, settings)
    assert bad.verdict is Verdict.FAIL, bad.reason
    assert bad.reason.startswith("layer 1: TP all-reduce of the MLP down projection is wrong on ranks 0-1"), bad.reason
    assert bad.metrics["first_broken"]["error"] == pytest.approx(7.9)
    # no collectives to check at tp1; a run that recorded none (a stored run) is a SKIP too
    assert check_collectives(clean, ref.cases, 1, 1, settings).verdict is Verdict.SKIP
    stored = replace(par, tensors={k: v for k, v in par.tensors.items() if not k.startswith("collectives.")})
    assert check_collectives(stored, ref.cases, 2, 1, settings).verdict is Verdict.SKIP


def test_inert_faults_are_named_and_acting_ones_are_not() -> None:
    kv6, gqa = load_model("tiny-kv6"), load_model("tiny-gqa")
    topo = parse_topology_name
    assert inert_reason("gcd-naive-gqa", kv6, topo("tp4")) is None  # GCD-duplicated KV heads: acts
    reason = inert_reason("gcd-naive-gqa", kv6, topo("tp2"))
    assert reason is not None and "inert on tiny-kv6 at tp2" in reason
    assert inert_reason("dcp-tp-kv-layout", gqa, topo("tp4dcp4")) is None
    assert inert_reason("dcp-tp-kv-layout", gqa, topo("tp4dcp2")) is not None  # kv=2: both layouts agree
    assert inert_reason("dcp-lse-merge", gqa, topo("tp4dcp2")) is None  # not decidable from the layout
    # uneven splits: the floor-division faults act only where tp does not divide vocab / FFN width
    fp16 = load_model("tiny-fp16-big")  # vocab 383, ffn 290
    assert inert_reason("vocab-shard-offset", fp16, topo("tp2")) is None
    assert inert_reason("ffn-floor-split", fp16, topo("tp4")) is None
    reason = inert_reason("ffn-floor-split", fp16, topo("tp2"))  # 290 / 2 = 145
    assert reason is not None and "ffn=290" in reason
    assert inert_reason("vocab-shard-offset", gqa, topo("tp4")) is not None  # 384 / 4
    # precision faults: a float16 all-reduce cannot change a float16 model; a bfloat16 one can
    reason = inert_reason("fp16-attn-allreduce", fp16, topo("tp2"))
    assert reason is not None and "already the model's dtype" in reason
    assert inert_reason("bf16-allreduce", fp16, topo("tp2")) is None
    assert inert_reason("fp16-attn-allreduce", gqa, topo("tp2")) is None


def test_new_faults_need_their_topology_and_perturbations_are_not_faults() -> None:
    for name in ("bf16-allreduce", "fp16-attn-allreduce", "dcp-store-padding"):
        assert name in FAULTS
    assert fault_flags("bf16-allreduce", parse_topology_name("tp2")).reduce_dtype == "bfloat16"
    flags = fault_flags("fp16-attn-allreduce", parse_topology_name("tp2"))
    assert flags.reduce_dtype == "float16" and flags.reduce_attn_only
    assert fault_flags("dcp-store-padding", parse_topology_name("tp2dcp2")).store_padding
    assert fault_flags("dcp-rope-local-pos", parse_topology_name("tp2dcp2")).rope_local_positions
    with pytest.raises(ConfigError, match="needs a DCP topology"):
        fault_flags("dcp-rope-local-pos", parse_topology_name("tp2"))
    with pytest.raises(ConfigError, match="needs a tensor-parallel topology"):
        fault_flags("vocab-shard-offset", parse_topology_name("tp1"))
    assert not set(PERTURBATIONS) & set(FAULTS)
    # every model's noise run is in its own dtype, under a perturbation of the reduction order
    for name in ("tiny-gqa", "tiny-bf16-big", "tiny-fp16-big"):
        model = load_model(name)
        dtype, perturbation = noise_run(model)
        assert dtype == model.dtype and perturbation in PERTURBATIONS


def test_decode_starts_are_ragged_within_the_prompt() -> None:
    starts = [ragged_decode_start(i, 4, 10) for i in range(6)]
    assert starts == [4, 3, 2, 4, 3, 2]
    assert ragged_decode_start(1, 4, 2) == 2 and ragged_decode_start(2, 1, 5) == 1
