"""History: real runs recorded into SQLite; trend, flaky (PASS<->FAIL between runs of one build), new
failure and fixed marks; fault runs as positive controls (never a flip); a shard merge is the same
build as the unsharded run; the report's strip in the matrix. Verdicts vary by running with and
without a fault; a flaky check is a recorded clean run whose copy had one verdict flipped."""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.records.history import connect, parse_since, query, trends
from harness.report.history_strip import ERROR_COLOUR

CELL = ["--suite", "dcp", "--topo", "tp2dcp2", "--model", "tiny-gqa", "--workload", "prompts"]
FAULT = ["--fault", "dcp-lse-merge"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shared_cache: Path) -> dict[str, Path]:
    """Three real runs, clean / faulted / clean, recorded by `harness run --history` with one build label."""
    root = tmp_path_factory.mktemp("history")
    db = root / "flaky.db"
    out = {"db": db}
    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_BUILD_LABEL", "nightly-build-7")
    try:
        for name, extra, code in (("r1", [], 0), ("r2", FAULT, 1), ("r3", [], 0)):
            out[name] = root / name
            assert main(["run", *CELL, *extra, "--out", str(out[name]), "--cache-dir", str(shared_cache),
                         "--history", str(db)]) == code
    finally:
        mp.undo()
    return out


def test_fault_run_of_the_same_commit_is_a_control_not_a_flip(runs: dict[str, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["history", "show", "--history", str(runs["db"])]) == 0
    out = capsys.readouterr().out
    assert "3 runs of 1 build from" in out and "FLAKY" not in out and "NEW-FAIL" not in out
    lines = out.splitlines()
    clean = next(ln for ln in lines if ln.startswith("dcp/tiny-gqa/tp2dcp2/seed0 ") and "logits_decode" in ln)
    assert " PP " in clean  # the two clean runs, the fault run apart
    control = next(ln for ln in out.splitlines() if "[fault dcp-lse-merge]" in ln and "logits_decode" in ln)
    assert " F " in control and "CONTROL detected" in control
    assert "dcp/tiny-gqa/tp2dcp2/seed0 [fault dcp-lse-merge]: still detected by logits_prefill, logits_decode" in out


def test_flaky_check_is_named_with_its_flip_count(runs: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A real clean run, then a copy of it (another run id, same build) with one check flipped to FAIL,
    then the clean run again: 2 flips within one build, no fault."""
    db = tmp_path / "flaky.db"
    flipped = tmp_path / "r1-flipped"
    shutil.copytree(runs["r1"], flipped)
    doc = json.loads((flipped / "results.json").read_text())
    doc["run_id"], doc["created"] = "r1-flipped", doc["created"][:-6] + ".5+00:00"
    check = next(c for c in doc["cells"][0]["checks"] if c["name"] == "logits_decode")
    check["verdict"] = "FAIL"
    (flipped / "results.json").write_text(json.dumps(doc))
    for run in (runs["r1"], flipped, runs["r3"]):
        assert main(["history", "add", str(run), "--label", "nightly-build-7", "--history", str(db)]) == 0
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db)]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "logits_decode" in ln and not ln.startswith(" "))
    assert " PFP " in line and "FLAKY(2 flips)" in line and "NEW-FAIL" not in line
    assert "FLAKY dcp/tiny-gqa/tp2dcp2/seed0 logits_decode: 2 flip(s) over 3 runs" in out
    assert "build nightly-build-7" in out
    layout = next(ln for ln in out.splitlines() if " layout " in ln)
    assert "PPP" in layout and "FLAKY" not in layout
    # the report of the last run: the flaky banner, and the trend in the matrix (first screen)
    assert main(["report", str(runs["r3"]), "--out", str(tmp_path / "rep"), "--history", str(db)]) == 0
    html = (tmp_path / "rep" / "index.html").read_text()
    assert 'id="flaky"' in html and "logits_decode (2 flips)" in html
    assert html.index('class="trend"') < html.index("<h2>Cells</h2>")


def test_report_shows_trend_in_the_matrix_with_builds_and_controls(runs: dict[str, Path], tmp_path: Path) -> None:
    html = (runs["r3"] / "index.html").read_text()
    assert 'id="flaky"' not in html and "FLAKY" not in html
    matrix = html[html.index('<table class="matrix">'):html.index("</table>", html.index('<table class="matrix">'))]
    assert "<th>trend" in matrix and 'class="history"' in matrix and "nightly-build-7" in matrix
    assert matrix.count("<rect") == 2  # the clean cell's two runs; the fault run is a control of its own
    assert "r1 (build nightly-build-7): PASS" in matrix and "r2" not in matrix
    # the fault run's own report shows it as a control, still detected
    fault_html = (runs["r2"] / "index.html").read_text()
    assert "control (dcp-lse-merge): still detected" in fault_html and "NEW-FAIL" not in fault_html


def test_new_failure_fixed_and_error_colour_across_builds(runs: dict[str, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         shared_cache: Path) -> None:
    """Builds v1 PASS, v2 ERROR (a launch timeout): NEW-FAIL; v3 PASS: FIXED; ERROR one colour everywhere."""
    db = tmp_path / "err.db"
    timeout = tmp_path / "timeout"
    assert main(["run", *CELL, "--timeout", "0.05", "--out", str(timeout), "--cache-dir", str(shared_cache)]) == 3
    assert main(["history", "add", str(runs["r1"]), "--label", "v1", "--history", str(db)]) == 0
    assert main(["history", "add", str(timeout), "--label", "v2", "--history", str(db)]) == 0
    assert main(["report", str(timeout), "--out", str(tmp_path / "rep2"), "--history", str(db)]) == 3
    html = (tmp_path / "rep2" / "index.html").read_text()
    assert "NEW-FAIL" in html[html.index('<table class="matrix">'):html.index("<h2>Cells</h2>")]
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db)]) == 0
    out = capsys.readouterr().out
    run_line = next(ln for ln in out.splitlines() if ln.startswith("dcp/") and " run " in ln)
    assert "NEW-FAIL" in run_line  # PASS -> ERROR: the run check did not fail in the build before
    assert "NEW-FAIL: 1 cell(s) fail or error now" in out
    assert f'fill="{ERROR_COLOUR}"' in html and f"--error: {ERROR_COLOUR}" in html
    assert ".v-ERROR { background: var(--error)" in html
    purples = set(re.findall(r"#(?:3b1f64|8250df|5a2d91|fbefff)", html, flags=re.I))
    assert purples == {ERROR_COLOUR}
    again = tmp_path / "again"  # a clean run created after the timeout run
    assert main(["run", *CELL, "--out", str(again), "--cache-dir", str(shared_cache)]) == 0
    assert main(["history", "add", str(again), "--label", "v3", "--history", str(db)]) == 0
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db), "--cell", "tp2dcp2"]) == 0
    out = capsys.readouterr().out
    assert "FIXED: 1 cell(s) pass now, failed or errored in the build before: dcp/tiny-gqa/tp2dcp2/seed0" in out
    assert "NEW-FAIL" not in out


def test_shard_merge_is_the_same_build(runs: dict[str, Path], tmp_path: Path, shared_cache: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two shards recorded, then their merge recorded, then the unsharded run: one build, each result once."""
    db = tmp_path / "shards.db"
    matrix = ["--suite", "dcp", "--topo", "tp2dcp2,tp2", "--model", "tiny-gqa", "--workload", "prompts",
              "--cache-dir", str(shared_cache)]
    for k in (1, 2):
        assert main(["run", *matrix, "--shard", f"{k}/2", "--out", str(tmp_path / f"s{k}"), "--history", str(db)]) == 0
    assert main(["report", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "merged")]) == 0
    assert main(["history", "add", str(tmp_path / "merged"), "--history", str(db)]) == 0
    assert main(["run", *matrix, "--out", str(tmp_path / "whole"), "--history", str(db)]) == 0
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db)]) == 0
    out = capsys.readouterr().out
    assert "of 1 build from" in out and "FLAKY" not in out
    decode = [ln for ln in out.splitlines() if "logits_decode" in ln]
    assert len(decode) == 2 and all(" PP " in ln for ln in decode)  # its shard (merge not counted again) + whole


def test_fault_build_is_a_control_across_builds(runs: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "builds.db"
    assert main(["history", "add", str(runs["r1"]), "--label", "v1", "--history", str(db)]) == 0
    assert main(["history", "add", str(runs["r2"]), "--label", "v2", "--history", str(db)]) == 0
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db), "--cell", "tiny-gqa/tp2dcp2"]) == 0
    out = capsys.readouterr().out
    decode = next(ln for ln in out.splitlines() if "logits_decode" in ln and "[fault" in ln)
    assert "CONTROL detected" in decode and "NEW-FAIL" not in decode and "FLAKY" not in decode
    assert main(["history", "add", str(runs["r3"]), "--label", "v3", "--history", str(db)]) == 0
    conn = connect(db, create=False)
    found = {(t.check, t.fault): t for t in trends(query(conn, suite="dcp"))}
    clean, control = found[("logits_decode", None)], found[("logits_decode", "dcp-lse-merge")]
    assert not clean.fixed and not clean.new_failure and not clean.flaky  # the fault run is not of this trend
    assert [r.verdict for r in clean.rows] == ["PASS", "PASS"] and [r.verdict for r in control.rows] == ["FAIL"]
    assert control.control and control.detected and not control.new_failure
    assert control.rows[0].max_noise_multiple > clean.rows[0].max_noise_multiple
    # re-adding a run replaces its rows
    assert main(["history", "add", str(runs["r3"]), "--label", "v3", "--history", str(db)]) == 0
    checks = len(json.loads((runs["r3"] / "results.json").read_text())["cells"][0]["checks"])
    assert len(query(conn, suite="dcp", cells=["tp2dcp2"])) == 3 * checks


def test_show_filters_and_bad_input(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["history", "show", "--history", str(runs["db"]), "--suite", "tp"]) == 0
    assert "no recorded runs match" in capsys.readouterr().out
    assert main(["history", "show", "--history", str(runs["db"]), "--since", "2999-01-01"]) == 0
    assert "no recorded runs match" in capsys.readouterr().out
    assert main(["history", "show", "--history", str(runs["db"]), "--since", "yesterday"]) == 2
    assert "--since 'yesterday'" in capsys.readouterr().err
    assert main(["history", "show", "--history", str(tmp_path / "none.db")]) == 2
    assert "does not exist" in capsys.readouterr().err
    junk = tmp_path / "junk.db"
    junk.write_text("not sqlite at all " * 100)
    assert main(["history", "show", "--history", str(junk)]) == 2
    assert "cannot be opened as a harness history database" in capsys.readouterr().err


def test_damaged_rows_and_schema_are_one_error(runs: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A store whose row does not parse (noise multiples that are no JSON) or whose schema text is not UTF-8 is one
    error naming the store or row, never a traceback (hypothesis found both in tests/test_fuzz_inputs.py)."""
    import sqlite3

    db = tmp_path / "row.db"
    shutil.copy(runs["db"], db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE checks SET noise_multiples = '{\"a\": 1 2}' WHERE rowid = (SELECT MIN(rowid) FROM checks)")
    assert main(["history", "show", "--history", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of the checks table" in err[0] and "is damaged" in err[0], err
    schema = tmp_path / "schema.db"
    raw = bytearray(runs["db"].read_bytes())
    at = raw.index(b"CREATE TABLE")
    raw[at + 2] = 0xEC  # inside sqlite_master's SQL text
    schema.write_bytes(bytes(raw))
    assert main(["history", "show", "--history", str(schema)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(schema) in err[0], err


def test_corrupt_history_is_refused_before_the_run(tmp_path: Path, shared_cache: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A --history (or $HARNESS_HISTORY) that is no history database is one error before any cell runs, not
    after the reports are written (which would hide their verdicts behind exit 2)."""
    junk = tmp_path / "junk.db"
    junk.write_text("not sqlite at all " * 100)
    out = tmp_path / "out"
    assert main(["run", *CELL, "--out", str(out), "--cache-dir", str(shared_cache), "--history", str(junk)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "cannot be opened as a harness history database" in err[0] and str(junk) in err[0]
    assert "[1/" not in captured.out and not (out / "results.json").exists()
    monkeypatch.setenv("HARNESS_HISTORY", str(junk))
    assert main(["run", *CELL, "--out", str(out), "--cache-dir", str(shared_cache)]) == 2
    assert "[1/" not in capsys.readouterr().out and not (out / "results.json").exists()


def test_parse_since_ages() -> None:
    now = datetime(2025, 1, 10, tzinfo=timezone.utc)
    assert parse_since("7d", now) == "2025-01-03T00:00:00+00:00"
    assert parse_since("2025-01-05", now) == "2025-01-05T00:00:00+00:00"
    with pytest.raises(ConfigError):
        parse_since("soon", now)
