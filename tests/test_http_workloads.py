"""Workloads over HTTP: `harness run --suite dcp --engine harness-serve --workload prompts,lengths,prefix-cache`
sends each workload's cases to a real `harness serve` on 127.0.0.1 as the workload schedules them, one cell per
workload. A clean run passes with logits_decode and decode_consistency verdicts (negative control); a
block-table fault that only shows past 2 blocks per rank behind the server FAILs the lengths cell's generation
while the suite's short prompts still generate alike (positive control); a staggered workload's recorded
request times show its waves. The reference (harness serve at tp1) and its noise twin run once per module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.checks.workload_checks import unknown_route
from harness.cli import main
from harness.core.jsonio import read_json
from harness.core.verdict import CheckResult, Verdict
from harness.records.results import results_cells

pytestmark = pytest.mark.xdist_group("http-workloads")  # the module's reference runs once
WORKLOADS = "prompts,lengths,prefix-cache"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("http-workloads-cache")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    return _run(tmp_path_factory.mktemp("clean"), cache)


def _run(out: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict[str, Any]]]:
    code = main(["run", "--suite", "dcp", "--model", "tiny-gqa", "--topo", "tp2dcp2", "--engine", "harness-serve",
                 "--workload", WORKLOADS, "--out", str(out), "--cache-dir", str(cache), "--kv-budget-mib", "8",
                 *extra])
    return code, {cell["workload"]: cell for cell in results_cells(out)}


def _verdicts(cell: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in cell["checks"]}


def _check(cell: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in cell["checks"] if c["name"] == name)


@pytest.mark.slow
def test_clean_workloads_pass_over_http_one_cell_each(clean: tuple[int, dict[str, dict[str, Any]]]) -> None:
    code, cells = clean
    assert code == 0 and sorted(cells) == sorted(WORKLOADS.split(","))
    for name, cell in cells.items():
        assert cell["status"] == "PASS" and cell["engine"] == "harness-serve", (name, cell["checks"])
        assert f"--workload {name}" in cell["command"]
        consistency = _check(cell, "decode_consistency")  # the re-prefill over HTTP: a verdict
        assert consistency["verdict"] == "PASS" and consistency["metrics"]["steps_compared"] > 0, consistency
    for name in ("prompts", "lengths"):  # the decode path over HTTP: the greedy walk, a verdict
        decode = _check(cells[name], "logits_decode")
        assert decode["verdict"] == "PASS" and decode["metrics"]["decode_steps_compared"] > 0, decode
    # the server reports no prefix-cache hits: the agreement with the one-batch twin is a SKIP that says why
    route = _check(cells["prefix-cache"], "prefix_cache")
    assert route["verdict"] == "SKIP" and "reports no prefix_hits" in route["reason"], route
    assert route["metrics"]["steps_compared"] > 0


@pytest.mark.slow
def test_the_run_records_each_workload_and_its_staggered_waves(clean: tuple[int, dict[str, dict[str, Any]]]) -> None:
    _, cells = clean
    manifest = read_json(Path(cells["lengths"]["run_dir"]) / "manifest.json")
    capabilities = manifest["backend"]["capabilities"]["provides"]
    assert {"workloads", "schedule_twin", "reprefill"} <= set(capabilities)
    entries = {e["name"]: e for e in manifest["workloads"]}
    assert [e["name"] for e in manifest["workloads"]] == WORKLOADS.split(",")
    lengths = [c["prompt_tokens"] for c in entries["lengths"]["cases"]]
    assert lengths[:5] == [1, 3, 17, 65, 129] and all(c["continuation_tokens"] > 0 for c in entries["lengths"]["cases"])
    staggered = entries["prefix-cache"]
    assert staggered["stats"]["source"] == "client" and "prefix_hits" not in staggered["stats"]
    schedule = staggered["requests"]["schedule"]
    assert schedule["name"] == "staggered" and schedule["wave"] == 1
    sent = [t for t in staggered["requests"]["requests"] if t["phase"] == "generate"]
    assert [t["case"] for t in sorted(sent, key=lambda t: t["sent_order"])] == [c["index"] for c in staggered["cases"]]
    times = [t["sent_s"] for t in sorted(sent, key=lambda t: t["sent_order"])]
    # each wave leaves at least delay_s after the previous one was sent (the sender sleeps that long)
    assert all(b - a >= schedule["delay_s"] for a, b in zip(times, times[1:])), times
    drill_down = cells["prefix-cache"]["details"]["requests"]  # the report shows each workload's own record
    assert drill_down["parallel"]["schedule"]["name"] == "staggered"
    assert cells["lengths"]["details"]["requests"]["parallel"]["schedule"]["name"] == "all-at-once"
    together = entries["lengths"]["requests"]  # all at once: the server had several of them at a time
    assert together["schedule"]["name"] == "all-at-once" and together["max_in_flight_seen"]["generate"] > 1


@pytest.mark.slow
def test_a_block_table_fault_behind_the_server_fails_the_long_workload(tmp_path: Path, cache: Path,
                                                                       clean: tuple[int, Any]) -> None:
    code, cells = _run(tmp_path, cache, "--fault", "block-table-wrap")
    assert code == 1
    # sequences past 2 blocks per rank read the wrong keys: the lengths workload's long prompts generate wrong
    lengths = cells["lengths"]
    assert lengths["status"] == "FAIL" and lengths["silent_corruption"], lengths["checks"]
    assert _verdicts(lengths)["generation"] == "FAIL" and _verdicts(lengths)["logits_decode"] == "FAIL"
    assert _verdicts(cells["prompts"])["generation"] == "PASS"  # the suite's short prompts generate alike
    assert _verdicts(cells["prefix-cache"])["generation"] == "FAIL"  # a 72-token shared prefix: past 2 blocks


@pytest.mark.slow
def test_a_decode_only_fault_fails_decode_consistency_without_a_reference(tmp_path: Path, cache: Path,
                                                                         clean: tuple[int, Any]) -> None:
    code, cells = _run(tmp_path, cache, "--fault", "dcp-token-owner")
    assert code == 1
    # each decode token's K/V stored on every rank of its DCP group: the prefill path is intact, so the
    # decode steps leave the re-prefill of the same tokens in the same run
    for name in ("prompts", "lengths"):
        verdicts = _verdicts(cells[name])
        assert verdicts["logits_prefill"] == "PASS" and verdicts["decode_consistency"] == "FAIL", cells[name]["checks"]
        assert "decode vs re-prefill" in _check(cells[name], "decode_consistency")["reason"]


def test_a_route_check_without_engine_stats_fails_a_difference_and_skips_an_agreement() -> None:
    stats = {"source": "client", "max_in_flight_seen": 3}
    agree = CheckResult("batch_invariance", Verdict.PASS, "4 prompts agree", {"steps_compared": 32})
    skipped = unknown_route("batch_invariance", "max_running", stats, agree)
    assert skipped.verdict is Verdict.SKIP and skipped.metrics == {"steps_compared": 32}
    assert "reports no max_running" in skipped.reason and "up to 3 requests open" in skipped.reason
    differ = CheckResult("batch_invariance", Verdict.FAIL, "prompt 2 diverges at generation step 1")
    failed = unknown_route("batch_invariance", "max_running", stats, differ)
    assert failed.verdict is Verdict.FAIL and failed.reason.startswith("prompt 2 diverges")
