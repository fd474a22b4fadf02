"""Reruns of failed cells (`harness run --rerun-failed`), the on-call history of a cell (`harness history cell`),
and `harness bisect` finding an injected regression commit in a throwaway git repository."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
CELL = ["--suite", "dcp", "--model", "tiny-gqa", "--seed", "0", "--workload", "prompts"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, shared_cache: Path) -> Path:
    """A real two-cell run (tp2, tp2dcp2), both PASS."""
    out = tmp_path_factory.mktemp("rerun") / "clean"
    assert main(["run", *CELL, "--topo", "tp2,tp2dcp2", "--out", str(out), "--cache-dir", str(shared_cache)]) == 0
    return out


def _doctored(src: Path, dst: Path, edit: Any) -> Path:
    """A copy of the run folder `src` whose results.json `edit` changed (a recorded verdict flipped, a cell lost)."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "results.json").read_text())
    edit(doc)
    (dst / "results.json").write_text(json.dumps(doc))
    return dst


def _cells(out: Path) -> dict[str, dict[str, Any]]:
    return {c["topology"]: c for c in json.loads((out / "results.json").read_text())["cells"]}


def test_a_failed_cell_reruns_alone_and_a_pass_on_retry_shows(clean: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    def fail_tp2dcp2(doc: dict[str, Any]) -> None:
        cell = next(c for c in doc["cells"] if c["topology"] == "tp2dcp2")
        cell["checks"][0].update(verdict="FAIL", reason="recorded as failing")
        cell["status"] = "FAIL"

    first = _doctored(clean, tmp_path / "first", fail_tp2dcp2)
    capsys.readouterr()
    assert main(["run", "--rerun-failed", str(first), "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert "rerunning 1 cell(s)" in out and "dcp/tiny-gqa/tp2dcp2/seed0/prompts" in out
    assert "tiny-gqa/tp2/seed0 ..." not in out  # only the failed cell launched
    cells = _cells(tmp_path / "again")
    assert set(cells) == {"tp2", "tp2dcp2"}
    kept = (tmp_path / "again" / cells["tp2"]["run_dir"]).resolve()  # the passing cell is the first run's
    assert kept == (first / _cells(clean)["tp2"]["run_dir"]).resolve()
    rerun = next(k for k in cells["tp2dcp2"]["checks"] if k["name"] == "rerun")
    assert rerun["verdict"] == "WARN" and cells["tp2dcp2"]["status"] == "WARN"  # never silently green
    assert rerun["reason"].startswith("passed on retry after failing: attempt 1: FAIL (recorded as failing); "
                                      "attempt 2: PASS")
    assert [a["status"] for a in cells["tp2dcp2"]["details"]["attempts"]] == ["FAIL", "PASS"]
    prov = json.loads((tmp_path / "again" / "results.json").read_text())["provenance"]
    assert prov["rerun_of"]["cells"] == ["dcp/tiny-gqa/tp2dcp2/seed0/prompts"]


def test_a_cell_missing_from_the_results_is_rerun_and_a_real_failure_stays_failed(
        clean: Path, tmp_path: Path, shared_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lost = _doctored(clean, tmp_path / "lost", lambda d: d.update(cells=[c for c in d["cells"]
                                                                          if c["topology"] == "tp2"]))
    assert main(["run", "--rerun-failed", str(lost), "--out", str(tmp_path / "found")]) == 0
    rerun = next(k for k in _cells(tmp_path / "found")["tp2dcp2"]["checks"] if k["name"] == "rerun")
    assert rerun["verdict"] == "PASS" and "attempt 1: not run (absent from the run's results)" in rerun["reason"]
    faulty = tmp_path / "faulty"  # a positive control: a cell with a real bug fails on every attempt
    assert main(["run", *CELL, "--topo", "tp2dcp2", "--fault", "dcp-lse-merge", "--out", str(faulty),
                 "--cache-dir", str(shared_cache)]) == 1
    assert main(["run", "--rerun-failed", str(faulty), "--out", str(tmp_path / "faulty-again")]) == 1
    cell = _cells(tmp_path / "faulty-again")["tp2dcp2"]
    rerun = next(k for k in cell["checks"] if k["name"] == "rerun")
    assert cell["status"] == "FAIL" and rerun["verdict"] == "FAIL" and rerun["reason"].startswith("failed again")
    capsys.readouterr()
    assert main(["run", "--rerun-failed", str(clean), "--out", str(tmp_path / "none")]) == 0
    assert "nothing to rerun" in capsys.readouterr().out


def _seeded_history(clean: Path, tmp_path: Path) -> Path:
    """Seven nightlies of the clean run's cells, tp2dcp2 with statuses P F P P S F F over builds c1..c7."""
    db = tmp_path / "history.db"
    for n, status in enumerate("PFPPSFF", 1):
        def nightly(doc: dict[str, Any], n: int = n, status: str = status) -> None:
            doc["run_id"], doc["created"] = f"nightly-{n}", f"2026-11-{n:02d}T02:00:00+00:00"
            doc["provenance"]["git_commit"] = f"{n:x}" * 40
            verdict = {"P": "PASS", "F": "FAIL", "S": "SKIP"}[status]
            cell = next(c for c in doc["cells"] if c["topology"] == "tp2dcp2")
            cell["checks"] = [{**cell["checks"][0], "verdict": verdict, "reason": f"nightly {n}"}]
        run = _doctored(clean, tmp_path / f"nightly-{n}", nightly)
        assert main(["history", "add", str(run), "--history", str(db)]) == 0
    return db


def test_history_answers_the_on_call_questions(clean: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    db = _seeded_history(clean, tmp_path)
    capsys.readouterr()
    assert main(["history", "cell", "dcp/tiny-gqa/tp2dcp2/seed0/prompts", "--history", str(db),
                 "--window", "2026-11-01", "--format", "json"]) == 0
    (story,) = json.loads(capsys.readouterr().out)
    assert story["failing"] and story["streak_runs"] == 2
    assert story["streak_start"]["run_id"] == "nightly-6" and story["first_failure"]["run_id"] == "nightly-2"
    assert story["flips"] == 3  # P->F, F->P, P->F (the SKIP is no verdict)
    assert story["last_good"]["run_id"] == "nightly-4" and story["last_good"]["git_commit"] == "4" * 40
    assert [r["run_id"] for r in story["between"]] == ["nightly-5", "nightly-6"]
    assert main(["history", "cell", "tp2dcp2", "--history", str(db), "--window", "2026-11-01"]) == 0
    text = capsys.readouterr().out
    assert "failing since      2026-11-06" in text
    assert f"harness bisect --cell ID --good {'4' * 12} --bad {'6' * 12}" in text
    assert main(["history", "cell", "dcp/tiny-gqa/tp2/seed0/prompts", "--history", str(db),
                 "--window", "2026-11-01", "--format", "json"]) == 0
    (passing,) = json.loads(capsys.readouterr().out)
    assert not passing["failing"] and passing["flips"] == 0 and passing["first_failure"] is None
    assert main(["history", "cell", "tp2", "--history", str(db), "--window", "bad"]) == 2


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_bisect_finds_the_injected_regression_commit(tmp_path: Path, shared_cache: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"  # a throwaway checkout of this harness: good, docs, the regression, docs
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("harness", "suites", "topologies", "models", "engines", "baselines"):
        shutil.copytree(ROOT / folder, repo / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", repo)
    _git(tmp_path, "init", "-q", str(repo))
    for key, value in (("user.email", "t@example.com"), ("user.name", "t"), ("commit.gpgsign", "false")):
        _git(repo, "config", key, value)
    commits = []

    def commit(message: str) -> None:
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", message)
        commits.append(_git(repo, "rev-parse", "HEAD"))

    commit("good")
    (repo / "NOTES").write_text("one\n")
    commit("notes")
    dense = repo / "harness" / "engine" / "layers" / "dense.py"
    text = dense.read_text()
    assert "merge_partials(outs, lses, self.flags.lse_merge_mean)" in text
    dense.write_text(text.replace("merge_partials(outs, lses, self.flags.lse_merge_mean)",
                                  "merge_partials(outs, lses, True)"))  # the partial outputs averaged, not LSE-merged
    commit("attention: simpler merge")
    (repo / "NOTES").write_text("two\n")
    commit("more notes")
    capsys.readouterr()
    assert main(["bisect", *CELL, "--topo", "tp2dcp2", "--cell", "dcp/tiny-gqa/tp2dcp2/seed0/prompts",
                 "--good", commits[0], "--bad", commits[-1], "--repo", str(repo), "--cache-dir", str(shared_cache),
                 "--work", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert f"first bad commit: {commits[2]} attention: simpler merge" in out
    assert _git(repo, "rev-parse", "HEAD") == commits[-1] and not _git(repo, "status", "--porcelain")  # untouched
    assert _git(repo, "worktree", "list").count("\n") == 0  # the bisection's worktree removed
