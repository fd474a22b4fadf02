"""Where a cell's noise comes from (harness/compare/parity/noise_source.py), on in-memory runs: a noise run that
measures nothing (absent, failed, bit-identical to its reference: a deterministic HTTP engine's scheduling twin) is
detected, and a noise run measured against another engine's reference on the same checkpoint (CellContext.noise_ref)
sets the bounds, with the source named in every noise-scaled check's reason. Positive controls: a parallel run far
beyond the borrowed noise still FAILs, and a near tie read from the parallel side excuses nothing where the
reference's token is outside the parallel top-k too. On a real HTTP engine (harness-serve answering one prompt: its
scheduling twin is bit-identical) the runner borrows the embedded engine's pair, caches it, names it, a clean tp2
PASSes and a fault FAILs under it (2 runs, 3 server starts, about 45 s); on vLLM: tests/test_vllm_cpu.py (the
Qwen3-Next cells)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.checks.context import CellContext, CellInfo
from harness.checks.driver import run_checks
from harness.checks.settings import CheckSettings
from harness.cli import main
from harness.compare.parity.generation import check_generation
from harness.compare.parity.noise_source import measures_nothing
from harness.compare.parity.topk import check_topk
from harness.compare.settings import GenerationSettings, LogitsSettings
from harness.core.verdict import Verdict
from harness.partition.layout import plan_layout
from harness.records.contract import FULL_ARTIFACTS, Capabilities
from harness.records.results import results_cells
from tests.test_compare_support import GQA, synthetic_runs, with_tensors

PLAN = plan_layout(GQA, 4, 4)
SOURCE = "noise: the embedded engine's reduction-order noise run against its tp1 float32 run of the same checkpoint"


def _shifted(run, kind: str, by: float, seed: int = 1):  # type: ignore[no-untyped-def]
    """`run` with each `kind` tensor moved by `by` x a fixed random pattern (a run of another reduction order)."""
    g = torch.Generator().manual_seed(seed)
    return replace(run, tensors={k: (v + by * torch.randn(v.shape, generator=g, dtype=v.dtype)
                                     if k.startswith(kind) else v) for k, v in run.tensors.items()})


def test_a_noise_run_that_measures_nothing_is_named() -> None:
    ref, noise, _ = synthetic_runs(PLAN)
    assert measures_nothing(ref, None) == "absent"
    assert measures_nothing(ref, replace(noise, manifest={"status": "error"})) == "failed"
    twin = replace(ref, path=ref.path.with_name("twin"))  # what vLLM CPU's scheduling twin is: the same bits
    assert measures_nothing(ref, twin) == f"bit-identical to its reference in all {len(ref.tensors)} tensors both hold"
    nan = ref.tensors["prefill_logits.0"].clone()
    nan[0, 0] = float("nan")  # NaN at the same place in both: still the same bits
    assert measures_nothing(with_tensors(ref, prefill_logits_0=nan), with_tensors(twin, prefill_logits_0=nan.clone()))
    one_ulp = nan.clone()
    one_ulp[1, 1] = torch.nextafter(one_ulp[1, 1], torch.tensor(float("inf"), dtype=one_ulp.dtype))
    assert measures_nothing(with_tensors(ref, prefill_logits_0=nan), with_tensors(twin, prefill_logits_0=one_ulp)) \
        is None  # negative control: one ulp anywhere is noise measured
    assert measures_nothing(ref, noise) is None
    assert measures_nothing(ref, replace(noise, tensors={})) is None  # nothing shared: nothing to judge by


def test_the_noise_is_measured_against_the_run_the_source_names() -> None:
    """The reference and its twin agree to the bit (bounds at the floors); the borrowed pair (another engine's
    reference and noise run on the same weights) differs by 0.05 per logit, so the parallel run's 0.02 passes
    against it and the bounds are its multiples; a parallel run off by 10 still FAILs against the same noise."""
    ref, _, _ = synthetic_runs(PLAN)
    settings = LogitsSettings()
    moved = _shifted(ref, "prefill_logits", 0.02, seed=2)
    against, borrowed = _shifted(ref, "prefill_logits", 0.0), _shifted(ref, "prefill_logits", 0.05)
    floors, _ = check_topk("prefill", ref, moved, ref, settings, 4)
    assert floors.verdict is Verdict.FAIL and "(floor; noise 0.0e+00)" in floors.reason
    result, _ = check_topk("prefill", ref, moved, borrowed, settings, 4, noise_ref=against)
    assert result.verdict is Verdict.PASS, result.reason
    assert result.metrics["logprob_error_bound"]["noise"] > 0.05
    wrong = _shifted(ref, "prefill_logits", 10.0, seed=3)
    bad, _ = check_topk("prefill", ref, wrong, borrowed, settings, 4, noise_ref=against)
    assert bad.verdict is Verdict.FAIL, bad.reason


def test_every_noise_scaled_check_names_the_source_and_no_other() -> None:
    ref, noise, par = synthetic_runs(PLAN)
    ctx = CellContext(ref=ref, par=par, noise=noise, plan=PLAN, settings=CheckSettings(),
                      par_caps=Capabilities(FULL_ARTIFACTS), ref_caps=Capabilities(FULL_ARTIFACTS),
                      info=CellInfo(engine="x-engine"), noise_ref=ref, noise_source=SOURCE)
    checks = {c.name: c for c in run_checks(ctx)}
    for name in ("logits_prefill", "logits_decode", "generation"):
        assert checks[name].verdict is Verdict.PASS and checks[name].reason.endswith(f"; {SOURCE}"), checks[name]
        assert checks[name].metrics["noise_source"] == SOURCE
    assert SOURCE not in checks["layout"].reason and SOURCE not in checks["inputs"].reason


def _outside(ref, step: int, par_row: list[int], par_lps: list[float]):  # type: ignore[no-untyped-def]
    """A parallel copy of `ref` that picks token par_row[0] (outside the reference's top-k) at `step` of prompt 0,
    with its own top-k (par_row, par_lps) there."""
    tokens = ref.tensors["gen_tokens.0"].clone()
    tokens[step] = par_row[0]
    tokens[step + 1:] = (tokens[step + 1:] + 1) % 32
    ids, lps = ref.tensors["gen_topk_ids.0"].clone(), ref.tensors["gen_topk_logprobs.0"].clone()
    ids[step], lps[step] = torch.tensor(par_row), torch.tensor(par_lps, dtype=lps.dtype)
    return with_tensors(ref, gen_tokens_0=tokens, gen_topk_ids_0=ids, gen_topk_logprobs_0=lps)


def test_a_token_outside_the_reference_top_k_is_a_near_tie_only_as_the_parallel_side_sees_it() -> None:
    """The reference's top-4 at step 2 spans 3 nats (gaps of 1); the parallel run picks a token outside it. With a
    near-tie bound of 5 (a bfloat16 model's noise) and the reference's token 0.25 below it in the parallel top-k
    the divergence is a near tie (PASS); the same token with the reference's token outside the parallel top-k
    too is a jump (FAIL), and so is the first case under the 1e-3 floor (a float32 model's bound)."""
    ref, _, _ = synthetic_runs(PLAN, n_cases=1)
    step, r_ids = 2, ref.tensors["gen_topk_ids.0"][2].tolist()
    stranger = next(t for t in range(32) if t not in r_ids)
    tie = _outside(ref, step, [stranger, r_ids[0], 30, 31], [-1.0, -1.25, -3.0, -4.0])
    lps = ref.tensors["gen_topk_logprobs.0"].clone()
    lps[:, 1] -= 1.0  # a noise run whose top-2 gaps differ by 1: near-tie bound 5 x 1
    noisy = with_tensors(ref, gen_topk_logprobs_0=lps)
    result, prompts = check_generation(ref, tie, GenerationSettings(), noise=noisy)
    assert result.verdict is Verdict.PASS and prompts[0]["crossed_tie"] == pytest.approx(3.0, abs=1e-3), result.reason
    far = [t for t in range(32) if t not in r_ids and t != stranger][:3]
    jump = _outside(ref, step, [stranger, *far], [-1.0, -1.25, -3.0, -4.0])
    result, _ = check_generation(ref, jump, GenerationSettings(), noise=noisy)
    assert result.verdict is Verdict.FAIL and "par token not in the reference top-k" in result.reason
    result, _ = check_generation(ref, tie, GenerationSettings(), noise=ref)
    assert result.verdict is Verdict.FAIL and "a near tie only under a bound of 3.0e+00" in result.reason


# -- the runner's choice on a real HTTP engine: `harness serve` answering one prompt alone or in a batch gives the
# same bits, so its scheduling twin measures nothing and the embedded engine's pair on the same weights stands in

ONE_PROMPT = """
name: one-prompt
version: 1
models: [tiny-gqa]
topologies: [tp2]
max_new_tokens: 4
decode_prefix_tokens: 2
prompts: ["The capital of France is"]
"""
SERVE_SOURCE = (f"{SOURCE} (harness-serve's scheduling noise run was bit-identical to its reference in all 5 tensors "
                "both hold)")


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("noise-source")
    (root / "one.yaml").write_text(ONE_PROMPT)
    return root


def _serve_run(root: Path, name: str, *extra: str) -> tuple[int, dict]:
    code = main(["run", "--suite", str(root / "one.yaml"), "--engine", "harness-serve", "--topo", "tp2",
                 "--kv-budget-mib", "8", "--max-seq-len", "128", "--out", str(root / name), "--cache-dir",
                 str(root / "cache"), *extra])
    (cell,) = results_cells(root / name)
    return code, cell


@pytest.mark.slow
def test_a_bit_identical_scheduling_twin_borrows_the_embedded_engines_noise(one_prompt: Path) -> None:
    code, cell = _serve_run(one_prompt, "clean")
    checks = {c["name"]: c for c in cell["checks"]}
    assert code == 0 and cell["status"] == "PASS", cell["checks"]
    for name in ("logits_prefill", "logits_decode", "generation"):
        assert checks[name]["reason"].endswith(f"; {SERVE_SOURCE}"), checks[name]["reason"]
    assert checks["logits_prefill"]["metrics"]["kl_bound"]["noise"] > 0  # measured, not the twin's 0
    entries = sorted(p.name for p in (one_prompt / "cache" / "runs").iterdir())
    assert [e.rsplit("-", 1)[0] for e in entries] == [  # the embedded pair cached beside the engine's own runs
        "harness-serve-tiny-gqa-tp1-float32", "harness-serve-tiny-gqa-tp1-float32-r", "tiny-gqa-tp1-float32",
        "tiny-gqa-tp1-float32-noise-reduction-order"]


@pytest.mark.slow
def test_a_fault_still_fails_under_the_borrowed_noise(one_prompt: Path) -> None:
    code, cell = _serve_run(one_prompt, "fault", "--fault", "o-proj-shard-offset")
    checks = {c["name"]: c for c in cell["checks"]}
    assert code == 1 and cell["status"] == "FAIL" and checks["logits_prefill"]["verdict"] == "FAIL", cell["checks"]
    assert SERVE_SOURCE in checks["logits_prefill"]["reason"]
