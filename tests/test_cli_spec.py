"""Speculative cells end to end through `harness run` on real gloo runs: the shipped spec suite passes,
and each speculator fault is flagged by its own check while greedy output stays lossless.

tp2dcp2 rather than the suite's tp4dcp4: the point (the speculator keeps the plain TP layout, dcp = 1,
while the target's DCP group holds every KV head on every rank) is the same with two ranks, which
a 2-core machine runs at half the cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main


@pytest.fixture(scope="module")
def cache_dir(shared_cache: Path) -> Path:
    return shared_cache


def _cells(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())["cells"]


def test_spec_suite_passes_with_acceptance_details(tmp_path: Path, cache_dir: Path) -> None:
    assert main(["run", "--suite", "spec", "--topo", "tp2dcp2-mtp,tp2dcp2-draft", "--out", str(tmp_path),
                 "--cache-dir", str(cache_dir)]) == 0
    for cell in _cells(tmp_path):
        verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
        assert verdicts == {**{name: "PASS" for name in (
            "inputs", "layout", "speculator_layout", "features_on", "logits_prefill", "logits_decode", "generation",
            "collectives", "lossless", "acceptance", "acceptance_baseline", "acceptance_per_position")},
            "speculative_logprobs": "SKIP",  # the embedded speculative path returns tokens only
            "reference_baseline": "SKIP"}  # no reference recorded
        spec = cell["details"]["speculator"]
        assert 1.0 < spec["mean_acceptance"] < 4.0  # mean accepted length: neither none nor all (k=3)
        assert spec["mean_acceptance"] == spec["reference_mean_acceptance"] and spec["traces_differ"] == 0
        # gated against the shipped baselines/acceptance.yaml (the key has no topology)
        assert spec["baseline_mean_acceptance"] == pytest.approx(spec["mean_acceptance"], abs=0.05)
        assert spec["first_divergence"] is None and spec["source"] == "traces"
        # the speculator keeps the plain TP layout (dcp = 1): tiny-gqa kv=2 over 2 ranks -> 1 head each,
        # while the target's DCP group holds both KV heads on each rank
        layout = cell["details"]["speculator_layout"]
        assert [r["kv_heads"] for r in layout["actual"]["ranks"]] == [[0], [1]]
        assert [r["kv_heads"] for r in cell["details"]["layout"]["actual"]["ranks"]] == [[0, 1], [0, 1]]


@pytest.mark.parametrize(("fault", "topo", "flagged"), [
    ("draft-dcp-kv-heads", "tp2dcp2-draft", {"speculator_layout"}),
    ("draft-stale-kv", "tp2dcp2-draft", {"acceptance", "acceptance_baseline", "acceptance_per_position"}),
    ("mtp-wrong-hidden", "tp2dcp2-mtp", {"acceptance"}),
    ("mtp-dcp-hidden-owner", "tp2dcp2-mtp", {"acceptance"}),  # the same wrong state on every DCP rank
    # a verify bug the tp1 reference shares: only the stored baseline sees it
    ("spec-verify-last-draft", "tp2dcp2-mtp", {"acceptance_baseline", "acceptance_per_position"}),
])
def test_speculator_fault_flagged_by_its_check_only(tmp_path: Path, cache_dir: Path, fault: str, topo: str,
                                                    flagged: set[str]) -> None:
    assert main(["run", "--suite", "spec", "--topo", topo, "--fault", fault, "--out", str(tmp_path),
                 "--cache-dir", str(cache_dir)]) == 1
    (cell,) = _cells(tmp_path)
    failed = {c["name"] for c in cell["checks"] if c["verdict"] == "FAIL"}
    assert failed == flagged
    # a broken drafter is a speed regression (outputs agree), a wrong draft layout a layout bug
    performance = flagged <= {"acceptance", "acceptance_baseline", "acceptance_per_position"}
    assert cell["failure_class"] == ("performance" if performance else "output")
    assert cell["silent_corruption"] is not performance
    if performance:
        page = (tmp_path / "index.html").read_text()
        assert "Performance-only regression in 1 cell" in page and "Silent corruption in" not in page
        assert 'type="performance-only"' in (tmp_path / "junit.xml").read_text()
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    assert verdicts["lossless"] == "PASS"  # a broken drafter never changes greedy output
    spec = cell["details"]["speculator"]
    if "acceptance" in flagged:  # localized: the first verify step whose accept count differs
        first = spec["first_divergence"]
        assert first["reference"]["accepted"] != first["parallel"]["accepted"]
        assert len(first["reference"]["proposed"]) == len(first["parallel"]["proposed"]) == 3
        summary = (tmp_path / "summary.md").read_text()
        assert f"prompt {first['prompt']} verify step {first['step']} (new token {first['position']})" in summary
    if fault == "spec-verify-last-draft":  # the reference shares the bug: traces agree, the baseline does not
        assert spec["traces_differ"] == 0 and spec["histogram"][3] == 0
        assert spec["mean_acceptance"] < spec["baseline_mean_acceptance"] - 0.05
