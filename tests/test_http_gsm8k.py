"""GSM8K over HTTP: `harness run --suite <gsm8k suite> --engine harness-serve` asks the questions through
the server (the harness LM over the run's HTTP dialect), keeps per-question records in each run
directory, and the paired McNemar check and the baseline gate work as for the embedded engine. Cheap:
the synthetic tiny-gqa model (its answers are noise, but identical noise on a correct layout), two
questions of the 32-question fixture, zero-shot, 8 new tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.records.results import results_cells
from tests.conftest import GSM8K_FIXTURE, small_gsm8k_suite

N_QUESTIONS = 2


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_gsm8k_suite(
        tmp_path_factory.mktemp("http-gsm8k-suite"),
        dict(models=["tiny-gqa"], topologies=["tp2dcp2"], prompts=["The capital of France is"], max_new_tokens=4,
             decode_prefix_tokens=2, max_seq_len=512, kv_budget_mib=8, profiles={}),
        dict(limit=N_QUESTIONS, num_fewshot=0, max_new_tokens=8, batch_size=N_QUESTIONS))


@pytest.fixture(scope="module")
def cache_dir(shared_cache: Path) -> Path:
    return shared_cache


def _run(out: Path, suite_file: Path, cache_dir: Path, *extra: str) -> tuple[int, dict]:
    code = main(["run", "--suite", str(suite_file), "--engine", "harness-serve", "--out", str(out),
                 "--cache-dir", str(cache_dir), "--baselines-dir", str(out / "baselines"),
                 "--gsm8k-path", str(GSM8K_FIXTURE), *extra])
    (cell,) = results_cells(out)
    return code, cell


def _checks(cell: dict) -> dict[str, dict]:
    return {c["name"]: c for c in cell["checks"]}


@pytest.mark.slow
def test_gsm8k_over_http_pairs_with_the_reference(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    code, cell = _run(tmp_path / "clean", suite_file, cache_dir)
    checks = _checks(cell)
    assert code == 0 and checks["gsm8k_paired"]["verdict"] == "PASS", cell["checks"]
    assert checks["gsm8k_baseline"]["verdict"] == "WARN"  # no stored baseline: WARN naming the update command
    par = json.loads((Path(cell["run_dir"]) / "gsm8k.json").read_text())
    ref = json.loads((Path(cell["reference_dir"]) / "gsm8k.json").read_text())
    assert par["n"] == ref["n"] == N_QUESTIONS and len(par["records"]) == N_QUESTIONS
    assert [r["generation"] for r in par["records"]] == [r["generation"] for r in ref["records"]]
    assert checks["gsm8k_paired"]["metrics"]["generation_agreement"] == 1.0


@pytest.mark.slow
def test_kv_layout_bug_over_http_fails_the_paired_check(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    code, cell = _run(tmp_path / "fault", suite_file, cache_dir, "--fault", "dcp-tp-kv-layout")
    checks = _checks(cell)
    assert code == 1 and checks["gsm8k_paired"]["verdict"] == "FAIL", cell["checks"]
    assert checks["gsm8k_paired"]["metrics"]["generation_agreement"] < 0.8
