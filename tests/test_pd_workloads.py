"""Serving workloads through disaggregated prefill/decode over real gloo worlds: the prefill world sends every
workload case, the decode world's serving lanes load them (staggered concurrent arrivals, a prefix-cache lane
whose later requests hit blocks the decode side holds from an earlier transfer) and every check passes
(negative control); blocks released before their send read them FAIL pd_transfer naming a workload request
(positive control)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.records.results import results_cells

SUITE = """
name: pdw
version: 1
models: [tiny-gqa]
topologies: ["tp4>tp2"]
max_new_tokens: 6
decode_prefix_tokens: 3
kv_budget_mib: 8
max_seq_len: 256
prompts:
  - "The capital of France is"
  - "Q: 17 + 25 = ?\\nA:"
checks: {layout: {}, logits: {}, generation: {}}
"""


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "pdw.yaml"
    path.write_text(SUITE)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict[str, dict]]]:
    code = main(["run", "--suite", str(suite), "--out", str(out), "--cache-dir", str(cache),
                 "--workload", "concurrent,prefix-cache", *extra])
    return code, {c["workload"]: {ch["name"]: ch for ch in c["checks"]} for c in results_cells(out)}


def test_workloads_load_their_prompts_and_hit_the_decode_side_prefix_cache(tmp_path: Path, suite_file: Path,
                                                                             cache_dir: Path) -> None:
    code, cells = _run(tmp_path / "r", suite_file, cache_dir)
    assert code == 0, {w: {n: ch["reason"] for n, ch in c.items() if ch["verdict"] != "PASS"} for w, c in cells.items()}
    assert set(cells) == {"concurrent", "prefix-cache"}
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "r" / "runs").rglob("pd.json")]
    routes = {load["route"] for rank in record["decode"] for load in rank["loads"]}
    assert {"decode_path", "generation", "concurrent", "prefix-cache"} <= routes
    prefix_loads = [load for load in record["decode"][0]["loads"] if load["route"] == "prefix-cache"]
    # 4 requests share a prefix: the first loads it from the prefill side, the later ones hit the decode
    # side's prefix cache holding those transferred blocks (only requests that missed load)
    assert 0 < len(prefix_loads) < 4
    assert cells["prefix-cache"]["prefix_cache"]["verdict"] == "PASS"
    assert cells["concurrent"]["pd_transfer"]["metrics"]["mismatches"] == 0


def test_a_block_released_before_its_send_fails_naming_a_workload_request(tmp_path: Path, suite_file: Path,
                                                                          cache_dir: Path) -> None:
    code, cells = _run(tmp_path / "r", suite_file, cache_dir, "--fault", "pd-early-release")
    assert code == 1
    reason = cells["concurrent"]["pd_transfer"]["reason"]
    assert cells["concurrent"]["pd_transfer"]["verdict"] == "FAIL" and "decode rank" in reason
    assert "(concurrent)" in reason or "(decode_path)" in reason or "(generation)" in reason, reason
