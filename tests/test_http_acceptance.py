"""Acceptance over HTTP from the engine's counters: `harness run --suite spec --engine harness-serve`
differences vLLM's `vllm:spec_decode_num_*_total` counters around the speculative requests and gates
the mean accepted length against the reference topology (also over HTTP) and the stored baseline
(baselines/acceptance.yaml has harness-serve's entries). The reference is run once for both tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.jsonio import read_json


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http-spec-cache")


def _run(out: Path, cache: Path, *extra: str) -> dict:
    code = main(["run", "--suite", "spec", "--topo", "tp2-draft", "--engine", "harness-serve", "--out", str(out),
                 "--cache-dir", str(cache), *extra])
    cell = read_json(out / "results.json")["cells"][0]
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


@pytest.mark.slow
def test_stale_draft_kv_fails_acceptance_over_http(tmp_path: Path, cache: Path) -> None:
    cell = _run(tmp_path / "fault", cache, "--fault", "draft-stale-kv")
    verdicts = cell["verdicts"]
    assert cell["exit"] == 1 and cell["silent_corruption"]
    assert verdicts["acceptance"] == "FAIL" and verdicts["acceptance_baseline"] == "FAIL"
    assert verdicts["lossless"] == "PASS"
    spec = cell["details"]["speculator"]
    assert spec["mean_acceptance"] < spec["reference_mean_acceptance"] - 0.05
