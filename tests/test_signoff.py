"""harness signoff end to end on CPU: a clean baseline, a candidate with an injected fault (BLOCKED,
naming the cell, counted as new output corruption), an unchanged candidate (SIGN-OFF), a timed-out
candidate (new ERROR, not new FAIL), a speculator fault (performance-only), a merged candidate whose
workload cells each count; a candidate that is its own baseline, candidate and baseline of other cells and
bad input exit 2."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.verdict import NOT_RUN_CHECK, CheckResult, Verdict
from harness.records.results import read_results, write_results
from harness.report.history_strip import ERROR_COLOUR

MATRIX = ["--suite", "dcp", "--topo", "tp2dcp2,tp2", "--model", "tiny-gqa", "--workload", "prompts"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, shared_cache: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("signoff")
    runs = {"baseline": ([], 0), "faulted": (["--fault", "dcp-lse-merge"], 1), "unchanged": ([], 0),
            # every launch times out (the references are cached by then): ERROR cells, exit 3
            "timeout": (["--timeout", "0.05"], 3),
            "partial": (["--topo", "tp2dcp2", "--fault", "dcp-lse-merge"], 1)}
    out = {}
    for name, (extra, code) in runs.items():
        out[name] = root / name
        assert main(["run", *MATRIX, *extra, "--out", str(out[name]), "--cache-dir", str(shared_cache)]) == code
    return out


def _signoff(builds: dict[str, Path], candidate: str, baseline: str, out: Path) -> tuple[int, str, dict]:
    code = main(["signoff", "--candidate", str(builds[candidate]), "--baseline", str(builds[baseline]),
                 "--out", str(out)])
    return code, (out / "signoff.md").read_text(), json.loads((out / "signoff.json").read_text())


def test_faulted_candidate_is_blocked_naming_the_cell(builds: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "so"
    code = main(["signoff", "--candidate", str(builds["faulted"]), "--baseline", str(builds["baseline"]),
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    assert printed.startswith("BLOCKED: 1 of 2 cells block the release: 1 new output corruption (1 silent), "
                              "0 new performance-only, 0 new ERROR, 0 not run (missing coverage)")
    assert "blocking dcp/tiny-gqa/tp2dcp2/dcp-lse-merge/seed0 (new output corruption)" in printed
    html, md = (out / "signoff.html").read_text(), (out / "signoff.md").read_text()
    assert md.startswith("# BLOCKED") and "**dcp/tiny-gqa/tp2dcp2/dcp-lse-merge/seed0** (new output corruption)" in md
    assert html.index("BLOCKED") < html.index("Verdicts") and "dcp/tiny-gqa/tp2dcp2/dcp-lse-merge/seed0" in html
    # candidate and baseline named at the top, each linked to its report (relative links, no URL)
    top = html[:html.index("Blocking cells")]
    assert "<th>candidate</th><td><b>faulted</b>" in top and "<th>baseline</th><td><b>baseline</b>" in top
    assert 'faulted/index.html"' in top
    assert 'baseline/index.html"' in top
    assert "- **candidate** faulted" in md and "(../" in md.split("## Blocking cells")[0]
    # the noise floor as the harness measures it
    assert "same dtype with another reduction order" in html and "higher-precision twin" not in html
    # changes first, sorted: the verdict changes lead, by their size; unchanged metrics are not rows of +0
    table = md.split("## Metric deltas")[1].split("##")[0]
    rows = [ln.split("|") for ln in table.splitlines() if ln.startswith("| dcp/")]
    assert rows and all(r[7].strip() != "+0" for r in rows)
    noise_rows = [r for r in rows if r[7].strip() == "x noise"]
    sizes = [abs(float(r[6])) for r in noise_rows]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1e3
    # signoff.json beside the page: the same classes for CI
    doc = json.loads((out / "signoff.json").read_text())
    assert doc["verdict"] == "BLOCKED" and not doc["signed_off"] and doc["summary"] in printed
    assert doc["counts"] == {"new_output_corruption": 1, "new_silent_corruption": 1, "new_performance_only": 0,
                             "new_error": 0, "still_failing": 0, "not_run": 0, "blocking": 1, "cells": 2}
    (cell,) = [c for c in doc["cells"] if c["blocking"]]
    assert cell["cell"] == "dcp/tiny-gqa/tp2dcp2/dcp-lse-merge/seed0" and cell["failure_class"] == "output"
    assert cell["silent_corruption"] and cell["change"] == "new output corruption"
    assert (cell["fault"], cell["workload"]) == ("dcp-lse-merge", "prompts")
    assert "://" not in html and "<script" not in html
    # the fault does not apply at tp2: that cell is listed as not checked, never silently green
    assert "| dcp/tiny-gqa/tp2/dcp-lse-merge/seed0 | PASS | SKIP | not checked |" in md
    assert "needs a DCP topology" in md.split("## Skipped or unavailable checks")[1]
    # the parity metrics moved by orders of magnitude in noise multiples
    row = next(ln for ln in md.splitlines() if "| logits_decode | max_kl |" in ln)
    assert row.endswith("x noise |") and float(row.split("|")[5]) > 1e3
    assert "dcp-lse-merge" in md.split("## Provenance")[1]


def test_unchanged_candidate_signs_off(builds: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "so"
    code = main(["signoff", "--candidate", str(builds["unchanged"]), "--baseline", str(builds["baseline"]),
                 "--out", str(out)])
    assert code == 0 and capsys.readouterr().out.startswith("SIGN-OFF")
    md = (out / "signoff.md").read_text()
    assert md.startswith("# SIGN-OFF")
    verdict_rows = [ln for ln in md.splitlines() if ln.startswith("| dcp/") and ln.count("|") == 5]
    assert len(verdict_rows) == 2 and all(ln.endswith("| PASS | PASS | unchanged |") for ln in verdict_rows)
    skipped = [ln for ln in md.split("## Skipped or unavailable checks")[1].splitlines() if ln.startswith("- ")]
    # every check ran but the recorded-reference comparison, which names the command that records one
    assert skipped and all("reference_baseline: no recorded reference" in ln for ln in skipped)
    base_commit = json.loads((builds["baseline"] / "results.json").read_text())["provenance"]["git_commit"]
    assert base_commit in md
    deltas = [ln for ln in md.splitlines() if "x noise |" in ln]
    assert all(abs(float(ln.split("|")[6])) < 1.0 for ln in deltas)  # same build: deltas within noise
    assert deltas or "No metric changed." in md
    doc = json.loads((out / "signoff.json").read_text())
    assert doc["signed_off"] and doc["verdict"] == "SIGN-OFF" and doc["counts"]["blocking"] == 0


def test_fixed_and_missing_cells(builds: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the faulted run as baseline, the clean one as candidate: fixed, and it signs off
    assert main(["signoff", "--candidate", str(builds["unchanged"]), "--baseline", str(builds["faulted"]),
                 "--out", str(tmp_path / "a")]) == 0
    assert "| dcp/tiny-gqa/tp2dcp2/seed0 | FAIL | PASS | fixed |" in (tmp_path / "a" / "signoff.md").read_text()


def test_timeout_candidate_is_new_error_not_new_fail(builds: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, md, doc = _signoff(builds, "timeout", "baseline", tmp_path / "so")
    printed = capsys.readouterr().out
    assert code == 1 and "new FAIL" not in printed + md
    assert printed.startswith("BLOCKED: 2 of 2 cells block the release: 0 new output corruption, "
                              "0 new performance-only, 2 new ERROR, 0 not run (missing coverage)")
    assert "| dcp/tiny-gqa/tp2/seed0 | PASS | ERROR | new ERROR |" in md
    assert doc["counts"]["new_error"] == 2 and doc["counts"]["new_output_corruption"] == 0
    assert {c["failure_class"] for c in doc["cells"]} == {"infrastructure"}
    html = (tmp_path / "so" / "signoff.html").read_text()
    assert f".s-ERROR {{ background: {ERROR_COLOUR}" in html
    # FAIL -> ERROR is a new ERROR too
    code, md, doc = _signoff(builds, "timeout", "faulted", tmp_path / "so2")
    assert "| dcp/tiny-gqa/tp2dcp2/seed0 | FAIL | ERROR | new ERROR |" in md and doc["counts"]["new_error"] == 2


def test_candidate_and_baseline_of_other_cells_are_refused(builds: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Missing coverage either way is one error naming the cells that differ, before any page is written."""
    out = tmp_path / "so"
    assert main(["signoff", "--candidate", str(builds["partial"]), "--baseline", str(builds["baseline"]),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("harness: error:") == 1 and len(err.strip().splitlines()) == 1
    assert "do not cover the same cells" in err and "dcp/tiny-gqa/tp2/seed0" in err
    assert "not run for the candidate" in err
    assert "tp2dcp2" not in err  # the faulted tp2dcp2 cell is the baseline's tp2dcp2 cell in a faulty build
    assert not out.exists()
    assert main(["signoff", "--candidate", str(builds["baseline"]), "--baseline", str(builds["partial"]),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "dcp/tiny-gqa/tp2/seed0" in err and "the baseline did not run" in err and not out.exists()


def test_a_cell_the_candidate_never_reached_blocks_as_not_run(builds: dict[str, Path], tmp_path: Path) -> None:
    """An interrupted candidate lists the cells it never reached (harness run does): each blocks as not run."""
    cells, provenance, _ = read_results(builds["unchanged"])
    never = CheckResult(NOT_RUN_CHECK, Verdict.ERROR, "not run: interrupted by SIGTERM before this cell finished")
    stopped = [cells[0], replace(cells[1], checks=(never,), localization=None, details={})]
    write_results(tmp_path / "cand", stopped, provenance, "stopped")
    code, md, doc = _signoff({"cand": tmp_path / "cand", "base": builds["baseline"]}, "cand", "base", tmp_path / "so")
    assert code == 1 and doc["counts"]["not_run"] == 1 and doc["counts"]["new_error"] == 0
    assert f"| {doc['cells'][1]['cell']} | PASS | ERROR | not run |" in md
    assert "interrupted by SIGTERM" in doc["cells"][1]["reason"]


def test_merged_candidate_with_corrupted_workload_cells_is_blocked(shared_cache: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A candidate of a clean run and a faulted one, each of three workload cells, against a clean baseline:
    every cell is checked by its full identity (workload and fault included), so no cell hides another."""
    matrix = ["run", "--suite", "dcp", "--topo", "tp4dcp4", "--model", "tiny-gqa", "--cache-dir", str(shared_cache),
              "--workload", "prompts,lengths,prefix-cache"]
    runs = {"A": ([], 0), "B": (["--fault", "dcp-empty-shard-nan"], 1), "C": ([], 0)}
    for name, (extra, code) in runs.items():
        assert main([*matrix, *extra, "--out", str(tmp_path / name)]) == code
    capsys.readouterr()
    code, md, doc = _signoff({n: tmp_path / n for n in runs}, "A", "C", tmp_path / "clean")
    assert code == 0 and doc["counts"]["cells"] == 3
    capsys.readouterr()
    out = tmp_path / "so"
    code = main(["signoff", "--candidate", str(tmp_path / "A"), str(tmp_path / "B"), "--baseline", str(tmp_path / "C"),
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    # the suite's 2-token prompt (fewer tokens than dcp) is in all three workloads: each faulted cell blocks
    assert printed.startswith("BLOCKED: 3 of 6 cells block the release: 3 new output corruption (3 silent)")
    blocking = sorted(ln.split(" (")[0].strip() for ln in printed.splitlines() if ln.startswith("  blocking "))
    assert blocking == ["blocking dcp/tiny-gqa/tp4dcp4/dcp-empty-shard-nan/lengths/seed0",
                        "blocking dcp/tiny-gqa/tp4dcp4/dcp-empty-shard-nan/prefix-cache/seed0",
                        "blocking dcp/tiny-gqa/tp4dcp4/dcp-empty-shard-nan/seed0"]
    doc = json.loads((out / "signoff.json").read_text())
    assert doc["counts"]["cells"] == 6 and doc["counts"]["new_silent_corruption"] == 3
    assert sorted((c["workload"], c["fault"]) for c in doc["cells"] if c["blocking"]) == [
        ("lengths", "dcp-empty-shard-nan"), ("prefix-cache", "dcp-empty-shard-nan"),
        ("prompts", "dcp-empty-shard-nan")]


def test_speculator_fault_is_performance_only(tmp_path: Path, shared_cache: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A real speculator fault whose outputs agree (a broken MTP head): performance-only, never corruption."""
    spec = ["run", "--suite", "spec", "--topo", "tp2dcp2-mtp", "--cache-dir", str(shared_cache)]
    assert main([*spec, "--out", str(tmp_path / "base")]) == 0
    assert main([*spec, "--fault", "mtp-wrong-hidden", "--out", str(tmp_path / "cand")]) == 1
    builds = {"base": tmp_path / "base", "cand": tmp_path / "cand"}
    code, md, doc = _signoff(builds, "cand", "base", tmp_path / "so")
    assert code == 1
    assert md.splitlines()[2] == ("1 of 1 cells block the release: 0 new output corruption, "
                                  "1 new performance-only, 0 new ERROR, 0 not run (missing coverage)")
    assert doc["counts"]["new_performance_only"] == 1 and doc["counts"]["new_output_corruption"] == 0
    (cell,) = doc["cells"]
    assert cell["failure_class"] == "performance" and not cell["silent_corruption"]


def test_candidate_equal_to_its_baseline_is_refused(builds: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "so"
    assert main(["signoff", "--candidate", str(builds["baseline"]), "--baseline", str(builds["baseline"]),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("harness: error:") == 1 and len(err.strip().splitlines()) == 1 and "same run" in err
    assert not out.exists()
    # a copy of the run (same results.json) is the same run too
    copy = tmp_path / "copy"
    shutil.copytree(builds["baseline"], copy)
    assert main(["signoff", "--candidate", str(copy), "--baseline", str(builds["baseline"]), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("harness: error:") == 1


def test_bad_input_exits_2(builds: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["signoff", "--candidate", str(tmp_path / "nowhere"), "--baseline", str(builds["baseline"]),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("harness: error") == 1 and "nowhere" in err
    with pytest.raises(SystemExit) as exc:
        main(["signoff", "--candidate", str(builds["baseline"])])
    assert exc.value.code == 2
