"""`harness report DIR [DIR...]`: re-render and merge run folders, exit codes, bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.verdict import CellResult
from harness.report import read_results, render_all, write_results
from tests.report_samples import PROVENANCE, error_cell, fail_cell, pass_cell, skip_cell, warn_cell

PROJECT = Path(__file__).resolve().parents[1]


def _run_dir(root: Path, name: str, cells: list[CellResult], provenance: dict | None = None) -> Path:
    path = root / name
    write_results(path, cells, provenance if provenance is not None else PROVENANCE, name)
    return path


def test_merge_two_runs_keeps_the_later_copy_of_a_cell(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _run_dir(tmp_path, "run-a", [pass_cell(), replace(fail_cell(), wall_s=1.0)])
    second = _run_dir(tmp_path, "run-b", [replace(fail_cell(), wall_s=2.0), skip_cell()],
                      {**PROVENANCE, "hostname": "other"})
    out = tmp_path / "merged"
    # the one FAIL is a positive control's (a --fault cell): the build's verdict decides, as in the headline
    assert main(["report", str(first), str(second), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dcp-tp-kv-layout" in printed and "FAIL (silent corruption)" in printed
    assert f"report: {out / 'index.html'}" in printed
    cells, provenance, run_id = read_results(out)
    assert run_id.startswith("merged-")
    # the later folder's copy of the same cell replaces the earlier one, in the earlier one's place
    assert [(c.topology, c.fault, c.wall_s) for c in cells] == [
        ("tp4dcp4", None, 12.5), ("tp4dcp4", "dcp-tp-kv-layout", 2.0), ("tp8", None, 0.0)]
    assert "hostname" not in provenance and provenance["git_commit"] == PROVENANCE["git_commit"]
    assert [s["run_id"] for s in provenance["sources"]] == ["run-a", "run-b"]
    page = (out / "index.html").read_text()
    assert "merged from" in page and "run-a" in page and "run-b" in page
    assert all((out / f).is_file() for f in ("results.json", "index.html", "junit.xml", "summary.md"))


def test_merge_with_only_errors_exits_3(tmp_path: Path) -> None:
    first = _run_dir(tmp_path, "a", [pass_cell()])
    second = _run_dir(tmp_path, "b", [error_cell(), warn_cell()])
    assert main(["report", str(first), str(second), "--out", str(tmp_path / "out")]) == 3


def test_later_rerun_clears_a_fail(tmp_path: Path) -> None:
    fixed = replace(pass_cell(), fault="dcp-tp-kv-layout")
    first = _run_dir(tmp_path, "a", [fail_cell(), skip_cell()])
    second = _run_dir(tmp_path, "b", [fixed, warn_cell()])
    assert main(["report", str(first), str(second), "--out", str(tmp_path / "out")]) == 0


def test_single_dir_rerenders_in_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run-1"
    render_all(run, [pass_cell(), warn_cell()], PROVENANCE, "run-1")
    (run / "index.html").unlink()
    assert main(["report", str(run)]) == 0
    assert (run / "index.html").is_file()
    cells, provenance, run_id = read_results(run)
    assert run_id == "run-1" and provenance == PROVENANCE and len(cells) == 2
    assert "SHIPPABLE WITH WARNINGS" in capsys.readouterr().out


def test_report_never_writes_over_an_input_or_another_runs_results(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first = _run_dir(tmp_path, "a", [pass_cell()])
    second = _run_dir(tmp_path, "b", [fail_cell()])
    before = (first / "results.json").read_bytes()
    for argv in ([str(first), str(second), "--out", str(first)], [str(second), "--out", str(first)]):
        assert main(["report", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harness: error: --out") and str(first / "results.json") in err[0]
        assert (first / "results.json").read_bytes() == before and not (first / "index.html").exists()
    # re-rendering one folder in place (its own results) is what `harness report DIR` does
    assert main(["report", str(first), "--out", str(first)]) == 0 and (first / "index.html").is_file()


def test_default_output_of_a_merge_is_under_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _run_dir(tmp_path, "a", [pass_cell()])
    second = _run_dir(tmp_path, "b", [skip_cell()])
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(first), str(second)]) == 0
    (merged,) = (tmp_path / "reports").iterdir()
    assert merged.name.startswith("merged-") and (merged / "index.html").is_file()


@pytest.mark.parametrize("content", ["{truncated", '{"schema_version": 2, "cells": []}', ""])
def test_corrupt_results_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              content: str) -> None:
    good = _run_dir(tmp_path, "good", [pass_cell()])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text(content)
    assert main(["report", str(good), str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error:") and str(bad / "results.json") in err[0]
    assert not (tmp_path / "out").exists()


def test_missing_results_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "missing" in capsys.readouterr().err


def _harness(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    return subprocess.run([sys.executable, "-m", "harness", "report", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_subprocess_merge_exit_codes(tmp_path: Path) -> None:
    clean = _run_dir(tmp_path, "clean", [pass_cell(), skip_cell()])
    broken = _run_dir(tmp_path, "broken", [replace(fail_cell(), fault=None)])  # a build's FAIL, not a control
    crashed = _run_dir(tmp_path, "crashed", [error_cell()])
    done = _harness(str(clean), str(broken), "--out", str(tmp_path / "o1"), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"report: {tmp_path / 'o1' / 'index.html'}" in done.stdout and "NOT SHIPPABLE" in done.stdout
    assert _harness(str(clean), str(crashed), "--out", str(tmp_path / "o2"), cwd=tmp_path).returncode == 3
    assert _harness(str(clean), "--out", str(tmp_path / "o3"), cwd=tmp_path).returncode == 0
    (tmp_path / "crashed" / "results.json").write_text("not json")
    bad = _harness(str(clean), str(crashed), cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "invalid JSON" in bad.stderr
    merged = json.loads((tmp_path / "o1" / "results.json").read_text())
    assert merged["summary"]["fail"] == 1 and merged["summary"]["silent_corruption"] == 1
