"""Localization on constructed hidden/attn tensors: layer, heads, ranks, KV heads; clean is None."""

from __future__ import annotations

import json

import pytest
import torch

from harness.compare.parity.localize import localize, onset, output_head, relative_error
from harness.compare.settings import LocalizationSettings
from harness.partition.layout import plan_layout
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

PLAN = plan_layout(GQA, 4, 2)  # heads 8 / kv 2: rank r owns Q heads 2r, 2r+1; DCP groups {0,1}, {2,3}


@pytest.fixture(scope="module")
def runs():
    return synthetic_runs(PLAN, n_cases=2)


def perturb(run, layer: int, heads: list[int] | None, case: int = 1, size: float = 0.3):
    """Corrupt `heads` of attention layer `layer` (None: none, only the residual) and the residual
    stream from that layer's output on, in one prompt."""
    g = torch.Generator().manual_seed(3)
    attn = run.tensors[f"attn.{case}"].clone()
    hidden = run.tensors[f"hidden.{case}"].clone()
    if heads:
        attn[layer, :, heads] += size * torch.randn(attn[layer, :, heads].shape, generator=g, dtype=attn.dtype)
        attn[layer + 1:] += size * torch.randn(attn[layer + 1:].shape, generator=g, dtype=attn.dtype)
    hidden[layer + 1:] += size * torch.randn(hidden[layer + 1:].shape, generator=g, dtype=hidden.dtype)
    return with_tensors(run, **{f"attn_{case}": attn, f"hidden_{case}": hidden})


def test_clean_runs_localize_nothing(runs) -> None:
    ref, noise, par = runs
    loc, details = localize(ref, par, noise, PLAN, ref.cases, LocalizationSettings())
    assert loc is None
    errors = details["layer_errors"]
    assert len(errors["error"]) == GQA.layers + 1 and len(errors["threshold"]) == GQA.layers + 1
    assert all(e <= t for e, t in zip(errors["error"], errors["threshold"]))
    assert len(details["head_errors"]["error"]) == GQA.layers
    assert details["head_errors"]["owner_ranks"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert details["head_errors"]["kv_heads"] == [0, 0, 0, 0, 1, 1, 1, 1]
    json.dumps(details, allow_nan=False)


def test_layer_1_heads_2_to_5_are_named_with_ranks_and_kv_heads(runs) -> None:
    ref, noise, par = runs
    loc, details = localize(ref, perturb(par, layer=1, heads=[2, 3, 4, 5]), noise, PLAN, ref.cases,
                            LocalizationSettings())
    assert loc is not None
    assert (loc.layer, loc.heads, loc.ranks, loc.kv_heads) == (1, (2, 3, 4, 5), (1, 2), (0, 1))
    assert loc.summary == "layer 1 attention: heads 2-5 on ranks 1-2 (DCP groups 0-1) diverge; reads KV heads 0-1"
    layer_err = details["layer_errors"]["error"]
    assert layer_err[2] > details["layer_errors"]["threshold"][2] and layer_err[1] < 1e-4


def test_one_dcp_group_and_tp_only_plans(runs) -> None:
    ref, noise, par = runs
    loc, _ = localize(ref, perturb(par, layer=0, heads=[0, 1, 2]), noise, PLAN, ref.cases, LocalizationSettings())
    assert loc is not None and loc.summary == ("layer 0 attention: heads 0-2 on ranks 0-1 (DCP group 0) diverge; "
                                               "reads KV head 0")
    tp_plan = plan_layout(GQA, 4)
    loc, _ = localize(ref, perturb(par, layer=0, heads=[6]), noise, tp_plan, ref.cases, LocalizationSettings())
    assert loc is not None and loc.summary == "layer 0 attention: heads 6 on rank 3 diverge; reads KV head 1"


def test_residual_divergence_with_clean_attention_points_past_attention(runs) -> None:
    ref, noise, par = runs
    loc, _ = localize(ref, perturb(par, layer=1, heads=None), noise, PLAN, ref.cases, LocalizationSettings())
    assert loc is not None and loc.layer == 1 and loc.heads == ()
    assert "MLP" in loc.summary


# the layout check's metrics "params_off" (compare/layout/params.py), as an o_proj offset and a norm taken from
# another layer leave them
O_PROJ_OFF = [{"rank": r, "param": "layers.1.o.weight", "layer": 1, "block": "attention output projection",
               "used_in": [1]} for r in range(4)]
NORM_OFF = [{"rank": 1, "param": "layers.0.mlp_norm.weight", "layer": 0, "block": "MLP input norm", "used_in": [1]},
            {"rank": 1, "param": "layers.1.mlp_norm.weight", "layer": 1, "block": "MLP input norm", "used_in": [0]}]


def test_a_residual_divergence_names_the_sub_block_whose_tensors_are_off_the_plan(runs) -> None:
    """Heads within noise, residual diverging: the attention output projection (o_proj shards off the
    plan) and the MLP's norm are told apart; tensors of other layers do not move the verdict."""
    ref, noise, par = runs
    bad = perturb(par, layer=1, heads=None)
    loc, _ = localize(ref, bad, noise, PLAN, ref.cases, LocalizationSettings(), held_off=O_PROJ_OFF)
    assert loc is not None and loc.layer == 1 and loc.ranks == (0, 1, 2, 3)
    assert "the attention output projection: layers.1.o.weight held off the plan on ranks 0-3" in loc.summary
    assert "MLP" not in loc.summary
    loc, _ = localize(ref, bad, noise, PLAN, ref.cases, LocalizationSettings(), held_off=NORM_OFF)
    assert loc is not None and "the MLP input norm: layers.0.mlp_norm.weight held off the plan on rank 1" in loc.summary
    # negative: off-plan tensors of another layer only, or none, leave the generic wording
    loc, _ = localize(ref, bad, noise, PLAN, ref.cases, LocalizationSettings(), held_off=O_PROJ_OFF[:0] + [
        {**O_PROJ_OFF[0], "param": "layers.0.o.weight", "layer": 0, "used_in": [0]}])
    assert loc is not None and loc.summary.endswith("MLP, norm or residual") and loc.ranks == ()
    clean, _ = localize(ref, par, noise, PLAN, ref.cases, LocalizationSettings(), held_off=O_PROJ_OFF)
    assert clean is None


def test_no_diverging_layer_is_a_cache_route_unless_the_prefill_or_the_output_head_is_off() -> None:
    """Every layer within bounds: the output head when the prefill logits FAIL or its tensors are off the
    plan, a cache route when only what is read back from the cache diverges."""
    errors = {"error": [1e-7, 2e-7, 3e-7], "threshold": [1e-6, 1e-6, 1e-6]}
    route = output_head(errors, ["generation", "logits_decode"])
    assert route.summary.startswith("a cache route:") and "not the output head" in route.summary
    assert "generation, logits_decode diverge" in route.summary
    head = output_head(errors, ["logits_prefill", "logits_decode"])
    assert head.summary.startswith("output head:") and "0.30x" in head.summary
    off = output_head(errors, ["logits_decode"], [{"rank": 2, "param": "lm_head.weight", "layer": None,
                                                   "block": "output head", "used_in": []}])
    assert off.summary.startswith("output head:") and "lm_head.weight held off the plan on rank 2" in off.summary


def test_embedding_divergence_is_layer_minus_one(runs) -> None:
    ref, noise, par = runs
    loc, _ = localize(ref, perturb(par, layer=-1, heads=None), noise, PLAN, ref.cases, LocalizationSettings())
    assert loc is not None and loc.layer == -1 and loc.summary.startswith("embeddings:")


def test_noise_floor_scales_the_layer_threshold(runs) -> None:
    ref, noise, par = runs
    small = perturb(par, layer=0, heads=[4], size=1e-3)
    settings = LocalizationSettings(rel_floor=1e-6)
    assert localize(ref, small, noise, PLAN, ref.cases, settings)[0] is not None
    # a noise run as far from the reference as the perturbation hides it
    loud = perturb(noise, layer=0, heads=[4], size=1e-3)
    assert localize(ref, small, loud, PLAN, ref.cases, settings)[0] is None


def test_nan_hidden_states_localize_and_stay_json_safe(runs) -> None:
    ref, noise, par = runs
    hidden = par.tensors["hidden.0"].clone()
    hidden[1, 0, 0] = float("nan")
    attn = par.tensors["attn.0"].clone()
    attn[0, 0, 7, 0] = float("nan")
    loc, details = localize(ref, with_tensors(par, hidden_0=hidden, attn_0=attn), noise, PLAN, ref.cases,
                            LocalizationSettings())
    assert loc is not None and loc.layer == 0 and loc.heads == (7,) and loc.ranks == (3,)
    assert details["layer_errors"]["error"][1] is None
    json.dumps(details, allow_nan=False)


def test_missing_tensors_give_no_localization_and_a_note(runs) -> None:
    ref, noise, par = runs
    bare = with_tensors(par)
    del bare.tensors["hidden.0"]
    loc, details = localize(ref, bare, noise, PLAN, ref.cases, LocalizationSettings())
    assert loc is None and "hidden" in details["note"]


def test_relative_error_shape_and_zero_reference() -> None:
    ref = torch.zeros(2, 3, 4)
    assert relative_error(ref, ref).shape == (2, 3) and float(relative_error(ref, ref).max()) == 0.0


# (errors, noise, crossed, onset): hidden-index errors where the bound (20x noise) is first crossed at
# index `crossed`; the divergence began at the earliest index of the run above 5x its own noise
ONSETS = [
    ([0.0, 4.4e-2, 7.3e-2], [0.0, 2.3e-3, 3.3e-3], 2, 1),   # 19x noise at layer 0, under its bound: layer 0
    ([0.0, 2.5e-3, 7.3e-2], [0.0, 2.3e-3, 3.3e-3], 2, 2),   # layer 0 at 1x its noise: the crossing layer
    ([0.0, 4.4e-2, 2.5e-3, 7.3e-2], [0.0, 2.3e-3, 2.3e-3, 3.3e-3], 3, 3),  # the run is broken at layer 1
    ([1e-3, 4.4e-2, 7.3e-2], None, 2, 2),                   # no noise run: the bound's own crossing
]


@pytest.mark.parametrize(("errors", "noise", "crossed", "expected"), ONSETS)
def test_divergence_onset_is_where_the_error_leaves_its_noise(errors, noise, crossed, expected) -> None:
    assert onset(errors, noise, crossed, LocalizationSettings()) == expected


def test_localization_names_the_onset_layer_and_by_how_much_it_missed_its_bound(runs) -> None:
    """Positive control: a divergence entering at layer 0 under that layer's bound and crossing it only at
    layer 1 is placed at layer 0, and the summary says how far layer 0 was from its bound."""
    ref, noise, par = runs
    settings = LocalizationSettings()
    _, clean = localize(ref, par, noise, PLAN, ref.cases, settings)
    limits, noises = clean["layer_errors"]["threshold"], clean["layer_errors"]["noise"]
    hidden = par.tensors["hidden.1"].clone()  # [L+1, P, H]
    ref_hidden = ref.tensors["hidden.1"].to(torch.float64)
    direction = torch.randn(hidden.shape[1:], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for index, share in ((1, 0.8), (2, 3.0)):  # 0.8 of layer 0's bound (far above 5x noise), then 3x layer 1's
        scale = (share * limits[index] * ref_hidden[index].norm(dim=-1, keepdim=True)
                 / direction.norm(dim=-1, keepdim=True))
        hidden[index] = (ref_hidden[index] + scale * direction).to(hidden.dtype)
    assert limits[1] * 0.8 > 5 * noises[1]
    loc, _ = localize(ref, with_tensors(par, hidden_1=hidden), noise, PLAN, ref.cases, settings)
    assert loc is not None and loc.layer == 0, loc
    assert "of its bound" in loc.summary and "first crossed at layer 1" in loc.summary, loc.summary
