"""Localization on constructed hidden/attn tensors: layer, heads, ranks, KV heads; clean is None."""

from __future__ import annotations

import json

import pytest
import torch

from harness.compare.localize import localize, relative_error
from harness.compare.settings import LocalizationSettings
from harness.layout import plan_layout
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
