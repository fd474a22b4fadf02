"""Noise only where plausible (compare/parity/step_rounding.py, bounds.ReductionFloor): a noise measurement beyond
what rounding in the dtype explains is a finding, never a wider tolerance; a missing or zero noise measurement
holds a half-precision cell to its dtype's rounding over the topology, not to float32-like floors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.compare.parity.bounds import NoiseLimit, ReductionFloor
from harness.compare.parity.generation import check_generation
from harness.compare.parity.logits import check_logits
from harness.compare.parity.schedule import Steps, compare_consistency, grade
from harness.compare.parity.step_rounding import StepRounding, discontinuity, step_rounding
from harness.compare.settings import ConsistencySettings, GenerationSettings, LogitsSettings
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout
from harness.records.results import results_cells
from tests.test_compare_generation import diverge_at
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

FLOAT32 = StepRounding(NoiseLimit("float32", 10.0))
ROUTED = StepRounding(NoiseLimit("float32", 10.0), "top-k expert routing")
BF16 = StepRounding(NoiseLimit("bfloat16", 10.0))


def _steps(n: int, shift: dict[int, float] | None = None) -> Steps:
    """n greedy steps, top-4 ids 10t.., logprobs -0.1, -1.1, ...; `shift` moves a step's top-1 logprob."""
    ids = torch.tensor([[10 * t + j for j in range(4)] for t in range(n)])  # [n, 4]
    lps = torch.tensor([[-0.1 - j for j in range(4)] for _ in range(n)], dtype=torch.float64)  # [n, 4]
    for step, delta in (shift or {}).items():
        lps[step, 0] += delta
    return Steps(ids[:, 0].tolist(), ids, lps)


def _consistency(shift: dict[int, float]) -> list:
    return [compare_consistency(0, _steps(8, shift), _steps(8))]


def test_a_float32_noise_of_0_67_nats_is_a_finding_naming_the_check_and_steps() -> None:
    """Positive control: the reference's decode disagrees with its re-prefill by 0.67 nats at step 5 (a recompute
    that repeats a token); so does the checked run. Before, the bound was 20 x 0.67 and both passed."""
    checked, noise = _consistency({5: -0.67}), [_consistency({5: -0.67})]
    unbounded = grade("decode_consistency", checked, noise, ConsistencySettings(), "decode vs re-prefill")
    assert unbounded.verdict is Verdict.PASS  # what a noise-scaled bound alone makes of it
    found = grade("decode_consistency", checked, noise, ConsistencySettings(), "decode vs re-prefill",
                  rounding=FLOAT32)
    assert found.verdict is Verdict.FAIL
    assert found.name == "decode_consistency"
    assert found.reason.startswith("the reference disagrees with itself beyond rounding (decode vs re-prefill")
    assert "logprob difference 6.7e-01 > 1.2e-03" in found.reason and "at prompt 0 step 5" in found.reason
    assert [b[:2] for b in found.metrics["noise_beyond_rounding"]] == [[0, 5]]


def test_rounding_sized_noise_still_scales_the_bound() -> None:
    """Negative control: a float32 noise of 1e-5 nats is rounding; a checked run 1e-4 off passes on 20 x it."""
    result = grade("decode_consistency", _consistency({2: 1e-4}), [_consistency({2: -1e-5})], ConsistencySettings(),
                   "decode vs re-prefill", rounding=FLOAT32)
    assert result.verdict is Verdict.PASS, result.reason
    assert result.metrics["logprob_bound"]["noise"] == pytest.approx(1e-5)
    # the same 0.67 nats are rounding in bfloat16 (2^10 u x 10 x 2 = 80 nats), so there they are noise
    assert grade("decode_consistency", _consistency({5: -0.67}), [_consistency({5: -0.67})], ConsistencySettings(),
                 "decode vs re-prefill", rounding=BF16).verdict is Verdict.PASS


def test_a_discontinuous_model_leaves_the_step_out_of_the_noise_never_widening_the_bound() -> None:
    """With top-k routing the reference's beyond-rounding step is not a FAIL of its own, but not noise either: the
    checked run's 0.67 nats are held to the rounding-sized noise of the other steps (FAIL)."""
    noise = [_consistency({5: -0.67, 2: 1e-6})]
    result = grade("decode_consistency", _consistency({5: -0.67}), noise, ConsistencySettings(),
                   "decode vs re-prefill", rounding=ROUTED)
    assert result.verdict is Verdict.FAIL and "logprob difference" in result.reason, result.reason
    assert result.metrics["logprob_bound"]["limit"] < 1e-3


def test_discontinuity_and_rounding_come_from_the_manifest() -> None:
    assert discontinuity({"hybrid": {"experts": 8}}) == "top-k expert routing"
    assert discontinuity({"hybrid": {"experts": 0}}) == ""
    assert discontinuity({"sparse": {"index_topk": 4}}) == "top-k sparse-attention selection"
    ref, _, _ = synthetic_runs(plan_layout(GQA, 2))
    rounding = step_rounding(ref)
    assert rounding is not None and rounding.rounding.dtype == "float32" and not rounding.discontinuous
    assert rounding.rounding.magnitude == float(max(ref.tensors[f"prefill_logits.{i}"].abs().max() for i in range(2)))
    assert step_rounding(replace(ref, manifest={**ref.manifest, "dtype": "int8"})) is None


def _bf16(run, ranks: int = 2):
    return replace(run, manifest={**run.manifest, "dtype": "bfloat16", "topology": {"tp": ranks, "dcp": 1}})


def test_a_bf16_cell_without_noise_is_held_to_bf16_rounding_over_its_topology() -> None:
    """Negative control: a bfloat16 tp2 run off by a few bf16 roundings with no noise run (or one measuring zero)
    PASSes on the reduction floor, not the float32-like 1e-4 KL floor; positive control: a corruption far beyond
    bf16 rounding still FAILs."""
    ref, _, _ = synthetic_runs(plan_layout(GQA, 2))
    ref = _bf16(ref)
    g = torch.Generator().manual_seed(1)
    off = {f"prefill_logits_{i}": ref.tensors[f"prefill_logits.{i}"]
           + 0.05 * torch.randn(ref.tensors[f"prefill_logits.{i}"].shape, generator=g, dtype=torch.float64)
           for i in range(2)}
    par = _bf16(with_tensors(ref, **off))
    settings = LogitsSettings(kl_floor=1e-4, abs_floor=1.5e-1)  # the bfloat16 DTYPE_DEFAULTS
    assert check_logits("prefill", replace(ref, manifest={**ref.manifest, "dtype": "float64"}), par, None,
                        settings)[0].verdict is Verdict.FAIL  # what those floors alone make of it
    for noise in (None, ref):  # no noise run; a bit-identical twin that measures zero
        result, _ = check_logits("prefill", ref, par, noise, settings)
        assert result.verdict is Verdict.PASS, result.reason
        assert "rounding in bfloat16 over 2 ranks" in result.reason
    corrupt = _bf16(with_tensors(ref, prefill_logits_0=ref.tensors["prefill_logits.0"].roll(1, dims=-1)))
    assert check_logits("prefill", ref, corrupt, None, settings)[0].verdict is Verdict.FAIL
    # a float32 cell keeps its own floors
    f32, _ = check_logits("prefill", replace(ref, manifest={**ref.manifest, "dtype": "float32"}), par, None,
                          LogitsSettings())
    assert f32.verdict is Verdict.FAIL and "rounding in" not in f32.reason


def test_the_reduction_floor_grows_with_the_ranks() -> None:
    one, sixty_four = ReductionFloor("bfloat16", 10.0, 1), ReductionFloor("bfloat16", 10.0, 64)
    assert sixty_four.abs_limit == 7 * one.abs_limit
    assert one.abs_limit == 16 * 2.0 ** -8 * 10.0


def test_a_half_precision_step_check_without_noise_is_held_to_its_dtype_not_float32_floors() -> None:
    """Negative control: a bfloat16 decode 0.05 nats off its re-prefill, the noise comparisons measuring zero (a
    deterministic engine's twins), passes on bf16 rounding; the same in float32 FAILs the 1e-4 floor (positive)."""
    checked, silent = _consistency({3: -0.05}), [_consistency({})]
    bf16 = grade("decode_consistency", checked, silent, ConsistencySettings(), "decode vs re-prefill", rounding=BF16)
    assert bf16.verdict is Verdict.PASS, bf16.reason
    assert "noise measured zero: 2 x rounding in bfloat16 over 1 rank" in bf16.reason
    f32 = grade("decode_consistency", checked, silent, ConsistencySettings(), "decode vs re-prefill", rounding=FLOAT32)
    assert f32.verdict is Verdict.FAIL and "logprob difference" in f32.reason


def test_a_bf16_generation_without_noise_takes_its_near_tie_bound_from_rounding_over_the_topology() -> None:
    """A bf16 tp8dcp4 run diverging where the reference's top-2 gap is 0.19 (no noise run): a near tie of bf16
    rounding over 32 ranks, not a FAIL against the 1e-3 floor; in float32 the same divergence FAILs."""
    run, _, _ = synthetic_runs(plan_layout(GQA, 2), n_cases=1)
    ref, par = diverge_at(run, step=2, gap=0.19)
    bf16_ref, bf16_par = _bf16(ref, 32), _bf16(par, 32)
    result, _ = check_generation(bf16_ref, bf16_par, GenerationSettings())
    assert result.verdict is Verdict.PASS, result.reason
    assert "no noise run: 2 x rounding in bfloat16 over 32 ranks" in result.reason
    f32, _ = check_generation(ref, par, GenerationSettings())
    assert f32.verdict is Verdict.FAIL, f32.reason


def test_a_preemption_bug_the_reference_shares_fails_on_the_rounding_limit(tmp_path: Path) -> None:
    """Positive control with a fault the tp1 reference carries too (preempt-resume-shared): the reference's own
    preempted-vs-uninterrupted comparison differs by ~1 nat in float32, which scaled a 20-nat bound before; now
    the preemption and decode_consistency checks FAIL naming the steps."""
    out = tmp_path / "out"
    code = main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--workload", "preemption",
                 "--fault", "preempt-resume-shared", "--seed", "0", "--out", str(out), "--cache-dir",
                 str(tmp_path / "cache")])
    assert code == 1
    checks = {ch["name"]: ch for c in results_cells(out) for ch in c["checks"]}
    for name in ("preemption", "decode_consistency"):
        assert checks[name]["verdict"] == "FAIL", checks[name]["reason"]
        assert checks[name]["reason"].startswith("the reference disagrees with itself beyond rounding")
        assert "for float32) at prompt 3 step" in checks[name]["reason"]
