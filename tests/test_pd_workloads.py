"""Serving workloads through disaggregated prefill/decode over real gloo worlds: the prefill world sends every
workload case, the decode world's serving lanes load them (staggered concurrent arrivals, a prefix-cache lane
whose later requests hit blocks the decode side holds from an earlier transfer) and every check passes
(negative control); blocks released before their send read them FAIL pd_transfer naming a workload request
(positive control)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.pd_support import PROMPTS, cache_fixture, checks_of, pd_suite, run_cells, suite_fixture

suite_file = suite_fixture(pd_suite("pdw", ["tiny-gqa"], ["tp4>tp2"], PROMPTS[::2]), "pdw")
cache_dir = cache_fixture()


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict[str, dict]]]:
    code, cells = run_cells(out, suite, cache, "--workload", "concurrent,prefix-cache", *extra)
    return code, {c["workload"]: checks_of(c) for c in cells}


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
