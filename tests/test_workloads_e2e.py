"""Workloads end to end over real gloo runs (tp2dcp2, tiny-gqa): one cell per workload in results.json with
its reproduce command, the manifest's cases with their token counts, every workload clean (negative
control), and each serving-route fault a silent-corruption FAIL of its workload's cell only (positive
controls), the route's own check included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.records.results import results_cells

SUITE = """
name: wl
version: 1
models: [tiny-gqa]
topologies: [tp2dcp2]
max_new_tokens: 8
decode_prefix_tokens: 2
kv_budget_mib: 8
max_seq_len: 256
long_context: 136
prompts: ["The capital of France is", "Once upon a time"]
workloads: [prompts, lengths, concurrent, prefix-cache, chunked-prefill, preemption]
checks: {layout: {}, logits: {}, generation: {}}
"""


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "wl.yaml"
    path.write_text(SUITE)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict]:
    code = main(["run", "--suite", str(suite), "--out", str(out), "--cache-dir", str(cache), *extra])
    return code, {"cells": results_cells(out)}


def test_every_workload_is_a_clean_cell_with_its_command_and_token_counts(tmp_path: Path, suite_file: Path,
                                                                          cache_dir: Path) -> None:
    code, doc = _run(tmp_path / "r", suite_file, cache_dir)
    cells = {c["workload"]: c for c in doc["cells"]}
    assert code == 0, [(w, c["status"], [ch["reason"] for ch in c["checks"] if ch["verdict"] != "PASS"])
                       for w, c in cells.items()]
    assert list(cells) == ["prompts", "lengths", "concurrent", "prefix-cache", "chunked-prefill", "preemption"]
    for name, cell in cells.items():
        assert cell["command"].endswith(f"--workload {name}")
        checks = {ch["name"]: ch for ch in cell["checks"]}
        assert checks["decode_consistency"]["verdict"] == "PASS"
        assert checks["generation"]["verdict"] == "PASS"
        assert checks["features_on"]["verdict"] == "PASS", checks["features_on"]  # tp, dcp, placement, its route
    route = {"concurrent": "batch_invariance", "prefix-cache": "prefix_cache", "chunked-prefill": "chunked_prefill",
             "preemption": "preemption"}
    for name, check in route.items():
        got = {ch["name"]: ch for ch in cells[name]["checks"]}[check]
        assert got["verdict"] == "PASS" and got["metrics"]["steps_compared"] > 0, got
        assert not any(ch["name"] == check for w, c in cells.items() if w != name for ch in c["checks"])
    manifest = json.loads((Path(cells["lengths"]["run_dir"]) / "manifest.json").read_text())
    entries = {e["name"]: e for e in manifest["workloads"]}
    assert [c["prompt_tokens"] for c in entries["lengths"]["cases"]] == [1, 3, 17, 65, 129, 136]
    assert all(c["tokens"] == c["prompt_tokens"] + c["continuation_tokens"] for e in entries.values()
               for c in e["cases"])
    assert entries["prefix-cache"]["stats"]["prefix_hits"] > 0 and entries["preemption"]["stats"]["preemptions"] > 0
    assert entries["chunked-prefill"]["stats"]["chunked_prompts"] == 1
    job = json.loads((Path(cells["lengths"]["run_dir"]) / "job.json").read_text())
    assert [w["schedule"] for w in job["workloads"]][:3] == ["all-at-once", "all-at-once", "staggered"]


def test_prefix_cache_hits_follow_the_token_placement(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    """Interleaved in chunks of 4 every rank still stores whole local blocks of a cached prefix: hits, and
    the same tokens; contiguous, a token's owner depends on its sequence's first forward, so the engine
    takes no hit (the route check says so) and stays right."""
    code, doc = _run(tmp_path / "r", suite_file, cache_dir, "--topo", "tp2dcp2i4,tp2dcp2c",
                     "--workload", "prefix-cache")
    cells = {c["topology"]: {ch["name"]: ch for ch in c["checks"]} for c in doc["cells"]}
    assert code == 0, {t: [(n, ch["reason"]) for n, ch in c.items() if ch["verdict"] != "PASS"]
                       for t, c in cells.items()}
    assert cells["tp2dcp2i4"]["prefix_cache"]["verdict"] == "PASS"
    assert cells["tp2dcp2c"]["prefix_cache"]["verdict"] == "SKIP"
    assert "took no prefix_cache route" in cells["tp2dcp2c"]["prefix_cache"]["reason"]
    assert cells["tp2dcp2c"]["generation"]["verdict"] == "PASS"
    # features_on: the hits prove the route on; under contiguous the engine declares it cannot cache (not silent)
    assert "prefix_cache on (prefix_hits = " in cells["tp2dcp2i4"]["features_on"]["reason"]
    assert cells["tp2dcp2c"]["features_on"]["verdict"] == "SKIP"
    assert "declares its prefix cache unable" in cells["tp2dcp2c"]["features_on"]["reason"]


def test_a_prefix_cache_that_never_hits_fails_features_on(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    """The positive control of features_on: outputs are unchanged, so the route check only SKIPs (no hit);
    the requested route that did not run is a FAIL naming it."""
    code, doc = _run(tmp_path / "r", suite_file, cache_dir, "--fault", "prefix-cache-never-hits",
                     "--workload", "prefix-cache")
    (cell,) = doc["cells"]
    checks = {ch["name"]: ch for ch in cell["checks"]}
    assert code == 1 and cell["status"] == "FAIL"
    assert {n for n, ch in checks.items() if ch["verdict"] == "FAIL"} == {"features_on"}
    assert checks["features_on"]["reason"].startswith("requested but not run: prefix_cache:")
    assert "prefix_hits = 0" in checks["features_on"]["reason"]
    assert checks["prefix_cache"]["verdict"] == "SKIP" and checks["generation"]["verdict"] == "PASS"


@pytest.mark.parametrize(("fault", "workloads", "failing", "checks"), [
    ("dcp-prefix-hit-length", "prompts,prefix-cache", {"prefix-cache"}, {"generation", "prefix_cache"}),
    ("dcp-chunk-restart", "prompts,chunked-prefill", {"chunked-prefill"}, {"generation", "chunked_prefill"}),
    ("preempt-resume-position", "prompts,preemption", {"preemption"}, {"preemption"}),
    ("block-table-wrap", "prompts,lengths", {"lengths"}, {"logits_prefill", "logits_decode", "generation"}),
    # the suite's prompts' decode paths start after 1 or 2 tokens: shorter than dcp too
    ("dcp-empty-shard-nan", "prompts,lengths", {"prompts", "lengths"}, {"logits_decode", "generation"}),
])
def test_each_route_fault_fails_its_workload_as_silent_corruption(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                                  fault: str, workloads: str, failing: set[str],
                                                                  checks: set[str]) -> None:
    code, doc = _run(tmp_path / "r", suite_file, cache_dir, "--fault", fault, "--workload", workloads)
    assert code == 1
    cells = {c["workload"]: c for c in doc["cells"]}
    assert {w for w, c in cells.items() if c["status"] == "FAIL"} == failing
    for name in failing:
        cell = cells[name]
        assert cell["silent_corruption"], cell
        failed = {ch["name"] for ch in cell["checks"] if ch["verdict"] == "FAIL"}
        assert checks <= failed, (fault, failed)
        assert f"--fault {fault} --workload {name}" in cell["command"]
