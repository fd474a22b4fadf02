"""History: real runs recorded into SQLite; trend, flaky (PASS<->FAIL without a code change), new
failure and fixed marks; the report's strip. Verdicts vary by running with and without a fault."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from harness.cli import main
from harness.errors import ConfigError
from harness.history import connect, parse_since, query, trends

CELL = ["--suite", "dcp", "--topo", "tp2dcp2", "--model", "tiny-gqa"]
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


def test_flaky_cell_is_named_with_its_flip_count(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["history", "show", "--history", str(runs["db"])]) == 1
    out = capsys.readouterr().out
    assert "3 runs from" in out
    line = next(ln for ln in out.splitlines() if "logits_decode" in ln and "tp2dcp2" in ln and not ln.startswith(" "))
    assert "PFP" in line and "FLAKY(2 flips)" in line
    layout = next(ln for ln in out.splitlines() if " layout " in ln)
    assert "PPP" in layout and "FLAKY" not in layout
    assert "FLAKY dcp/tiny-gqa/tp2dcp2/seed0 logits_decode: 2 flip(s) over 3 runs" in out
    assert "build nightly-build-7" in out


def test_report_shows_strip_and_flaky_banner(runs: dict[str, Path]) -> None:
    html = (runs["r3"] / "index.html").read_text()
    assert 'id="flaky"' in html and "logits_decode (2 flips)" in html
    assert html.count("<rect") >= 3 and 'class="history"' in html
    assert "r2: FAIL" in html and "r1: PASS" in html


def test_new_failure_and_fixed_across_builds(runs: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "builds.db"
    assert main(["history", "add", str(runs["r1"]), "--label", "v1", "--history", str(db)]) == 0
    assert main(["history", "add", str(runs["r2"]), "--label", "v2", "--history", str(db)]) == 0
    capsys.readouterr()
    assert main(["history", "show", "--history", str(db), "--cell", "tiny-gqa/tp2dcp2"]) == 0
    out = capsys.readouterr().out
    decode = next(ln for ln in out.splitlines() if "logits_decode" in ln)
    assert "NEW-FAIL" in decode and "FLAKY" not in decode
    assert main(["history", "add", str(runs["r3"]), "--label", "v3", "--history", str(db)]) == 0
    conn = connect(db, create=False)
    found = {t.check: t for t in trends(query(conn, suite="dcp"))}
    assert found["logits_decode"].fixed and not found["logits_decode"].flaky
    assert [r.verdict for r in found["logits_decode"].rows] == ["PASS", "FAIL", "PASS"]
    assert found["logits_decode"].rows[1].fault == "dcp-lse-merge"
    assert found["logits_decode"].rows[1].max_noise_multiple > found["logits_decode"].rows[0].max_noise_multiple
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


def test_parse_since_ages() -> None:
    now = datetime(2025, 1, 10, tzinfo=timezone.utc)
    assert parse_since("7d", now) == "2025-01-03T00:00:00+00:00"
    assert parse_since("2025-01-05", now) == "2025-01-05T00:00:00+00:00"
    with pytest.raises(ConfigError):
        parse_since("soon", now)
