"""harness signoff end to end on CPU: a clean baseline, a candidate with an injected fault (BLOCKED,
naming the cell), an unchanged candidate (SIGN-OFF); bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main

MATRIX = ["--suite", "dcp", "--topo", "tp2dcp2,tp2", "--model", "tiny-gqa"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory, shared_cache: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("signoff")
    runs = {"baseline": ([], 0), "faulted": (["--fault", "dcp-lse-merge"], 1), "unchanged": ([], 0)}
    out = {}
    for name, (extra, code) in runs.items():
        out[name] = root / name
        assert main(["run", *MATRIX, *extra, "--out", str(out[name]), "--cache-dir", str(shared_cache)]) == code
    return out


def test_faulted_candidate_is_blocked_naming_the_cell(builds: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "so"
    code = main(["signoff", "--candidate", str(builds["faulted"]), "--baseline", str(builds["baseline"]),
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    assert printed.startswith("BLOCKED") and "blocking dcp/tiny-gqa/tp2dcp2/seed0 (new FAIL)" in printed
    html, md = (out / "signoff.html").read_text(), (out / "signoff.md").read_text()
    assert md.startswith("# BLOCKED") and "**dcp/tiny-gqa/tp2dcp2/seed0** (new FAIL)" in md
    assert html.index("BLOCKED") < html.index("Verdicts") and "dcp/tiny-gqa/tp2dcp2/seed0" in html
    assert "://" not in html and "<script" not in html
    # the fault does not apply at tp2: that cell is listed as not checked, never silently green
    assert "| dcp/tiny-gqa/tp2/seed0 | PASS | SKIP | not checked |" in md
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
    assert "none: every check ran" in md
    base_commit = json.loads((builds["baseline"] / "results.json").read_text())["provenance"]["git_commit"]
    assert base_commit in md
    deltas = [ln for ln in md.splitlines() if "x noise |" in ln]
    assert deltas and all(abs(float(ln.split("|")[6])) < 1.0 for ln in deltas)  # same build: deltas within noise


def test_fixed_and_missing_cells(builds: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the faulted run as baseline, the clean one as candidate: fixed, and it signs off
    assert main(["signoff", "--candidate", str(builds["unchanged"]), "--baseline", str(builds["faulted"]),
                 "--out", str(tmp_path / "a")]) == 0
    assert "| dcp/tiny-gqa/tp2dcp2/seed0 | FAIL | PASS | fixed |" in (tmp_path / "a" / "signoff.md").read_text()


def test_bad_input_exits_2(builds: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["signoff", "--candidate", str(tmp_path / "nowhere"), "--baseline", str(builds["baseline"]),
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("harness: error") == 1 and "nowhere" in err
    with pytest.raises(SystemExit) as exc:
        main(["signoff", "--candidate", str(builds["baseline"])])
    assert exc.value.code == 2
