"""Baselines file round trip, `harness baseline update` with its diff, and the gate of a cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.baselines.baseline import (
    BASELINE_SCHEMA_VERSION,
    GATE_CHECK,
    BaselineEntry,
    Baselines,
    Measurement,
    baselines_path,
    gate_cell,
    load_baselines,
    read_baselines,
    write_baselines,
)
from harness.cli import main
from harness.core.errors import ConfigError
from harness.core.verdict import CellResult, CheckResult, Verdict
from harness.gsm8k.records import FLEXIBLE
from harness.gsm8k.settings import GSM8KSettings
from harness.records.results import write_results

PROVENANCE = {"harness_version": "0.1.0", "git_commit": "abc123", "torch_version": "2.13.0", "python": "3.11",
              "device": "cpu", "dtypes": ["float32"], "seeds": [0], "command": "harness run --suite gsm8k",
              "hostname": "ci"}


def _entry(topology: str = "tp1", n: int = 1319, score: float = 0.60, **kw: Any) -> BaselineEntry:
    return BaselineEntry(model="smollm2-135m", task="gsm8k", topology=topology, n=n, score=score, stderr=0.0135,
                         provenance={"git_commit": "abc123", "date": "2025-01-01"}, **kw)


def _cell(topology: str, score: float, n: int = 50, fault: str | None = None, clean: bool = True,
          verdict: Verdict = Verdict.PASS) -> CellResult:
    details = {"gsm8k": {"task": "gsm8k", "filter": "strict-match", "n": n, "score": score, "stderr": 0.07}}
    return CellResult(suite="gsm8k", model="smollm2-135m", topology=topology, fault=fault, seed=0,
                      checks=(CheckResult("gsm8k_paired", verdict, "r"),), clean_exit=clean,
                      command=f"harness run --suite gsm8k --topo {topology}", details=details)


def _run_dir(tmp_path: Path, cells: list[CellResult], name: str = "run") -> Path:
    out = tmp_path / name
    write_results(out, cells, PROVENANCE, run_id=name)
    return out


def test_round_trip(tmp_path: Path) -> None:
    baselines = Baselines(suite="gsm8k", entries=(_entry("tp1"), _entry("tp3", score=0.59, filter=FLEXIBLE)))
    path = baselines_path("gsm8k", tmp_path)
    write_baselines(baselines, path)
    assert read_baselines(path) == baselines
    assert load_baselines("gsm8k", tmp_path) == baselines
    assert path.read_text().startswith("# GSM8K baselines")


def test_missing_file_is_empty(tmp_path: Path) -> None:
    assert load_baselines("nope", tmp_path) == Baselines(suite="nope")


@pytest.mark.parametrize(("text", "message"), [
    ("schema_version: 2\nbaselines: []\n", "schema_version 2"),
    ("schema_version: 1\nbaseline: []\n", "did you mean 'baselines'"),
    ("schema_version: 1\nbaselines:\n- {model: m, task: t, topology: tp1, n: 5, score: 55.0, stderr: 0.1}\n",
     "score=55.0 must be a number in 0..1"),
    ("schema_version: 1\nbaselines:\n- {model: m, task: t, topology: tp1, n: 5, score: 0.5, stderr: 0.1, sigma: 1}\n",
     "unknown key 'sigma'"),
    ("schema_version: 1\nbaselines:\n- {model: m, task: t, topology: tp1, n: 5, score: 0.5, stderr: 0.1}\n"
     "- {model: m, task: t, topology: tp1, n: 5, score: 0.6, stderr: 0.1}\n", "duplicate baselines"),
])
def test_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_baselines(path)


def test_update_writes_new_baselines_with_yes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_dir(tmp_path, [_cell("tp1", 0.06), _cell("tp3", 0.04),
                              _cell("tp3dcp3", 0.0, fault="dcp-tp-kv-layout", verdict=Verdict.FAIL),
                              _cell("tp9", 0.0, clean=False, verdict=Verdict.ERROR)])
    folder = tmp_path / "baselines"
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "+ smollm2-135m / gsm8k / tp1 / n=50: score 0.0600" in out
    assert "skip smollm2-135m / tp3dcp3 (seed 0): fault 'dcp-tp-kv-layout' injected" in out
    assert "skip smollm2-135m / tp9 (seed 0): the run broke" in out
    stored = load_baselines("gsm8k", folder)
    assert [(e.topology, e.n, e.score) for e in stored.entries] == [("tp1", 50, 0.06), ("tp3", 50, 0.04)]
    prov = stored.entries[0].provenance
    assert prov["git_commit"] == "abc123" and prov["device"] == "cpu" and prov["dtype"] == "float32"
    assert prov["seed"] == 0 and prov["run_id"] == "run" and prov["harness_version"] == "0.1.0"
    assert prov["date"] and "torch 2.13.0" in prov["engine"]
    raw = json.loads(json.dumps(stored.to_dict()))
    assert raw["schema_version"] == BASELINE_SCHEMA_VERSION


def test_update_shows_diff_and_refuses_without_tty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "baselines"
    old = Baselines(suite="gsm8k", entries=(_entry("tp1", n=50, score=0.04), _entry("tp1", n=1319)))
    write_baselines(old, baselines_path("gsm8k", folder))
    run = _run_dir(tmp_path, [_cell("tp1", 0.06)])
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "~ smollm2-135m / gsm8k / tp1 / n=50:" in captured.out
    assert "score: 0.04 -> 0.06" in captured.out
    assert "provenance.run_id: None -> 'run'" in captured.out
    assert "pass --yes" in captured.err
    assert load_baselines("gsm8k", folder) == old  # nothing written
    assert main(["baseline", "update", "--from", str(run / "results.json"), "--dir", str(folder), "--yes"]) == 0
    new = load_baselines("gsm8k", folder)
    assert [(e.n, e.score) for e in new.entries] == [(50, 0.06), (1319, 0.60)]  # the n=1319 entry is kept
    capsys.readouterr()
    assert main(["baseline", "update", "--from", str(run), "--dir", str(folder)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_update_needs_one_suite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = CellResult(suite="dcp", model="tiny-gqa", topology="tp2", fault=None, seed=0, checks=(),
                       clean_exit=True)
    run = _run_dir(tmp_path, [_cell("tp1", 0.06), other])
    assert main(["baseline", "update", "--from", str(run), "--dir", str(tmp_path), "--yes"]) == 2
    assert "pick one with --suite" in capsys.readouterr().err
    assert main(["baseline", "update", "--from", str(run), "--dir", str(tmp_path), "--suite", "dcp"]) == 1
    assert main(["baseline", "update", "--from", str(run), "--dir", str(tmp_path), "--suite", "gsm8k",
                 "--yes"]) == 0


def test_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_baselines(Baselines(suite="gsm8k", entries=(_entry(),)), baselines_path("gsm8k", tmp_path))
    assert main(["baseline", "show", "--suite", "gsm8k", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "0.6000" in out and "abc123" in out


# ---- the gate ------------------------------------------------------------------------------------------


def _baselines() -> Baselines:
    return Baselines(suite="gsm8k", entries=(_entry("tp1", n=1319, score=0.60), _entry("tp1", n=50, score=0.60)))


def test_gate_pass() -> None:
    check = gate_cell(_baselines(), "smollm2-135m", "gsm8k", "tp1", Measurement(score=0.59, n=1319))
    assert check.name == GATE_CHECK and check.verdict is Verdict.PASS
    assert check.metrics["threshold"] == pytest.approx(0.60 - 0.0320, abs=1e-3)
    assert check.metrics["baseline_provenance"]["git_commit"] == "abc123"


def test_gate_fail_on_a_drop_well_beyond_theta() -> None:
    check = gate_cell(_baselines(), "smollm2-135m", "gsm8k", "tp1", Measurement(score=0.45, n=1319))
    assert check.verdict is Verdict.FAIL
    assert 0.60 - 0.45 > 3 * check.metrics["theta"]
    assert "drop of 15.0 points" in check.reason


def test_gate_warns_on_missing_baseline_with_the_command() -> None:
    check = gate_cell(_baselines(), "smollm2-135m", "gsm8k", "tp3dcp3", Measurement(score=0.6, n=50),
                      run_dir="reports/run-7")
    assert check.verdict is Verdict.WARN
    assert "`harness baseline update --from reports/run-7 --suite gsm8k`" in check.reason
    other_n = gate_cell(_baselines(), "smollm2-135m", "gsm8k", "tp1", Measurement(score=0.6, n=200))
    assert other_n.verdict is Verdict.WARN and "baselines exist for n=50, 1319" in other_n.reason


def test_gate_warns_when_n_is_too_small() -> None:
    check = gate_cell(_baselines(), "smollm2-135m", "gsm8k", "tp1", Measurement(score=0.60, n=50),
                      GSM8KSettings(sigma=0.5, detect_drop=0.05))
    assert check.verdict is Verdict.WARN
    assert "n=50 can only detect drops >= 24.9 points; the suite asks for 5.0" in check.reason


def test_gate_warns_on_filter_mismatch() -> None:
    check = gate_cell(_baselines(), "smollm2-135m", "gsm8k", "tp1", Measurement(score=0.6, n=50, filter=FLEXIBLE))
    assert check.verdict is Verdict.WARN and "scored with strict-match" in check.reason
