"""Acceptance over HTTP from the engine's counters: `harness run --suite spec --engine harness-serve`
differences vLLM's `vllm:spec_decode_num_*_total` counters around the speculative requests and gates
the mean accepted length against the reference topology (also over HTTP) and the stored baseline
(baselines/acceptance.yaml has harness-serve's entries). The reference is run once for both tests.
Through the SGLang dialect (`--engine harness-serve-sglang`) the mean comes from SGLang's per-request
verify counts (meta_info.spec_verify_ct: completion tokens / verify steps) instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.core.jsonio import read_json
from harness.records.results import results_cells

pytestmark = pytest.mark.xdist_group("http-acceptance")  # the module's reference runs once


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http-spec-cache")


def _run(out: Path, cache: Path, *extra: str, engine: str = "harness-serve") -> dict:
    code = main(["run", "--suite", "spec", "--topo", "tp2-draft", "--engine", engine, "--out", str(out),
                 "--cache-dir", str(cache), *extra])
    cell = results_cells(out)[0]
    cell["exit"] = code
    cell["verdicts"] = {c["name"]: c["verdict"] for c in cell["checks"]}
    return cell


@pytest.mark.slow
def test_clean_speculative_cell_gets_a_real_acceptance_verdict_over_http(tmp_path: Path, cache: Path) -> None:
    cell = _run(tmp_path / "clean", cache)
    verdicts = cell["verdicts"]
    assert cell["exit"] == 0 and cell["engine"] == "harness-serve"
    assert verdicts["acceptance"] == "PASS" and verdicts["acceptance_baseline"] == "PASS"
    assert verdicts["lossless"] == "PASS"
    spec = cell["details"]["speculator"]
    assert spec["source"] == "the engines' spec-decode counters" and spec["histogram"] is None
    assert 1.0 < spec["mean_acceptance"] < 4.0 and spec["mean_acceptance"] == spec["reference_mean_acceptance"]
    counters = read_json(Path(cell["run_dir"]) / "manifest.json")["speculative"]
    assert counters["source"] == "metrics" and counters["draft_tokens"] == 3 * counters["drafts"] > 0
    assert spec["mean_acceptance"] == pytest.approx(1 + counters["accepted_tokens"] / counters["drafts"])
    # the per-position counters (vllm:spec_decode_num_accepted_tokens_per_pos) give the histogram, gated per
    # position against 0.95 x the reference's (harness-serve's stored baselines hold no histogram)
    assert sum(counters["histogram"]) == counters["drafts"] and len(counters["accepted_per_position"]) == 3
    assert sum(counters["accepted_per_position"]) == counters["accepted_tokens"]
    assert verdicts["acceptance_per_position"] == "PASS"
    assert "0.95 x the reference" in _reason(cell, "acceptance_per_position")
    # what the speculative server returned: its logprobs vs the plain server's and vs its own re-prefill
    assert verdicts["speculative_logprobs"] == "PASS" and verdicts["speculative_consistency"] == "PASS"
    assert verdicts["features_on"] == "SKIP" and "reports no ranks" in _reason(cell, "features_on")
    assert "speculator (draft)" in _reason(cell, "features_on")  # proven from the counters


@pytest.mark.slow
def test_stale_draft_kv_fails_acceptance_over_http(tmp_path: Path, cache: Path) -> None:
    cell = _run(tmp_path / "fault", cache, "--fault", "draft-stale-kv")
    verdicts = cell["verdicts"]
    assert cell["exit"] == 1 and cell["failure_class"] == "performance" and not cell["silent_corruption"]
    assert verdicts["acceptance"] == "FAIL" and verdicts["acceptance_baseline"] == "FAIL"
    assert verdicts["lossless"] == "PASS"
    spec = cell["details"]["speculator"]
    assert spec["mean_acceptance"] < spec["reference_mean_acceptance"] - 0.05
    assert verdicts["acceptance_per_position"] == "FAIL"
    assert _reason(cell, "acceptance_per_position").startswith("draft position ")
    assert verdicts["speculative_logprobs"] == "PASS"  # output and its logprobs unchanged


@pytest.mark.slow
def test_shifted_speculative_logprobs_fail_over_http(tmp_path: Path, cache: Path) -> None:
    """The positive control of speculative_logprobs: tokens and acceptance unchanged, the logprobs the
    speculative server returns are the next position's; the plain server and lossless see nothing."""
    cell = _run(tmp_path / "shift", cache, "--fault", "spec-logprob-shift")
    verdicts = cell["verdicts"]
    assert cell["exit"] == 1 and cell["silent_corruption"], cell["checks"]
    assert verdicts["speculative_logprobs"] == "FAIL" and verdicts["speculative_consistency"] == "FAIL"
    assert "speculative vs plain server: logprob difference" in _reason(cell, "speculative_logprobs")
    assert {n for n, v in verdicts.items() if v == "FAIL"} == {"speculative_logprobs", "speculative_consistency"}


def _reason(cell: dict, name: str) -> str:
    return next(str(c["reason"]) for c in cell["checks"] if c["name"] == name)


@pytest.mark.slow
def test_sglang_per_request_verify_counts_gate_acceptance(tmp_path: Path, cache: Path) -> None:
    """SGLang's dialect: no counters are read; the per-request verify counts give the mean, against the
    reference's (same engine at tp1), and the stale-draft fault moves it (the positive control)."""
    cells = {name: _run(tmp_path / name, cache, *extra, engine="harness-serve-sglang")
             for name, extra in (("clean", ()), ("fault", ("--fault", "draft-stale-kv")))}
    clean, fault = cells["clean"], cells["fault"]
    assert clean["verdicts"]["acceptance"] == "PASS" and clean["verdicts"]["lossless"] == "PASS", clean["checks"]
    counts = read_json(Path(clean["run_dir"]) / "manifest.json")["speculative"]
    assert counts["source"] == "requests" and counts["verify_steps"] > 0
    assert counts["mean_accepted_length"] == pytest.approx(counts["committed_tokens"] / counts["verify_steps"])
    assert clean["details"]["speculator"]["mean_acceptance"] == pytest.approx(counts["mean_accepted_length"])
    assert fault["exit"] == 1 and fault["verdicts"]["acceptance"] == "FAIL", fault["checks"]
    spec = fault["details"]["speculator"]
    assert spec["mean_acceptance"] < spec["reference_mean_acceptance"] - 0.05
