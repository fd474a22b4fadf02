"""One cell end to end on in-memory runs: clean passes; a DCP layout bug fails with localization."""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from harness.checks.cell import compare_cell
from harness.checks.settings import CheckSettings
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout, plan_speculator
from tests.test_compare_support import GQA, layout_entry, synthetic_runs, with_tensors

PLAN = plan_layout(GQA, 4, 4)


def test_clean_cell_passes_every_check_without_localization() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    checks, loc, details = compare_cell(ref, par, noise, PLAN, CheckSettings())
    assert [c.name for c in checks] == ["inputs", "layout", "features_on", "logits_prefill", "logits_decode",
                                        "generation", "collectives", "reference_baseline"]
    # no reference recorded (harness baseline update): its check is a SKIP saying so, every other one PASSes
    assert all(c.verdict is (Verdict.SKIP if c.name == "reference_baseline" else Verdict.PASS) for c in checks), \
        [c.reason for c in checks]
    assert loc is None
    assert details["layout"]["planned"]["dcp"] == 4 and details["layout"]["actual"] == par.layout["target"]
    assert [p["index"] for p in details["prompts"]] == [0, 1]
    assert set(details["prompts"][0]) == {"index", "prompt", "prefill", "decode", "generation"}
    assert "layer_errors" in details and "head_errors" in details
    json.dumps(details, allow_nan=False)


def test_dcp_tp_kv_layout_bug_fails_and_localizes_with_the_group() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    g = torch.Generator().manual_seed(5)
    rand = lambda t: t + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype)  # noqa: E731
    bad = with_tensors(par, **{f"decode_logits_{i}": rand(par.tensors[f"decode_logits.{i}"]) for i in range(2)})
    attn = bad.tensors["attn.0"].clone()
    attn[0] = rand(attn[0])  # every head of layer 0
    hidden = bad.tensors["hidden.0"].clone()
    hidden[1:] = rand(hidden[1:])
    bad = with_tensors(bad, attn_0=attn, hidden_0=hidden)
    bad = replace(bad, layout={"target": layout_entry(plan_layout(GQA, 4, 4, kv_dcp=1), pool_plan=PLAN)})
    checks, loc, details = compare_cell(ref, bad, noise, PLAN, CheckSettings())
    verdicts = {c.name: c.verdict for c in checks}
    assert verdicts == {"inputs": Verdict.PASS, "layout": Verdict.FAIL, "features_on": Verdict.PASS,
                        "logits_prefill": Verdict.PASS,
                        "logits_decode": Verdict.FAIL, "generation": Verdict.PASS, "collectives": Verdict.PASS,
                        "reference_baseline": Verdict.SKIP}
    assert loc is not None and loc.layer == 0 and loc.heads == tuple(range(8)) and loc.ranks == (0, 1, 2, 3)
    # ranks of the group read different KV heads for the same Q head: the summary says so
    assert loc.summary == ("layer 0 attention: heads 0-7 on ranks 0-3 (DCP group 0) diverge; "
                           "heads 0-7 read the wrong KV heads (e.g. head 0 reads 0-1, planned 0); "
                           "wrong reads of KV heads 0-1; KV head ids differ inside DCP group 0")
    assert details["prompts"][0]["decode"]["first_diverging_position"] == ref.cases[0].decode_start
    json.dumps(details, allow_nan=False)


def test_speculator_layout_is_checked_against_the_tp_plan() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    spec_plan = plan_speculator(GQA, 4)
    good = replace(par, layout={**par.layout, "speculator": layout_entry(spec_plan)})
    checks, _, details = compare_cell(ref, good, noise, PLAN, CheckSettings(), speculator_plan=spec_plan)
    by_name = {c.name: c for c in checks}
    assert [c.name for c in checks][1:3] == ["layout", "speculator_layout"]
    assert by_name["speculator_layout"].verdict is Verdict.PASS and details["speculator_layout"]["planned"]["dcp"] == 1
    dcp_aware = replace(par, layout={**par.layout, "speculator": layout_entry(PLAN)})  # the draft reused DCP layout
    checks, _, _ = compare_cell(ref, dcp_aware, noise, PLAN, CheckSettings(), speculator_plan=spec_plan)
    assert {c.name: c for c in checks}["speculator_layout"].verdict is Verdict.FAIL
    missing, _, _ = compare_cell(ref, par, noise, PLAN, CheckSettings(), speculator_plan=spec_plan)
    spec = {c.name: c for c in missing}["speculator_layout"]
    assert spec.verdict is Verdict.ERROR and "'speculator'" in spec.reason


def test_failed_parallel_run_gives_error_checks() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    crashed = replace(par, manifest={"status": "error", "error": "rank 2 exited with code 137"})
    checks, loc, details = compare_cell(ref, crashed, noise, PLAN, CheckSettings())
    assert {c.verdict for c in checks} == {Verdict.ERROR} and loc is None and details == {}
    assert checks[0].reason == "parallel run failed: rank 2 exited with code 137"
    assert [c.name for c in checks] == ["inputs", "layout", "features_on", "logits_prefill", "logits_decode",
                                        "generation", "collectives", "localization", "reference_baseline"]


def test_missing_noise_run_still_compares_on_floors() -> None:
    ref, _, par = synthetic_runs(PLAN)
    checks, _, details = compare_cell(ref, par, None, PLAN, CheckSettings())
    assert all(c.verdict is Verdict.PASS for c in checks if c.name != "reference_baseline")
    assert details["layer_errors"]["noise"] is None
