"""A draft speculator through disaggregated prefill/decode over real gloo worlds: `PREFILL>DECODE-draft` parses
(the speculator runs in the decode world; -mtp and a prefill-side speculator are errors naming the form), the
target's prompt KV is loaded for the speculative route too, the draft computes its own cache, and acceptance
through P/D equals the non-disaggregated reference's (negative control); a draft cache that keeps rejected
tokens FAILs acceptance through P/D (positive control)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.specs.topology import parse_topology_name
from tests.pd_support import PROMPTS, cache_fixture, checks_of, pd_suite, run_cells, suite_fixture

SUITE = pd_suite("pds", ["tiny-gqa"], ["tp4>tp2-draft"],
                 ["The capital of France is", "Once upon a time, in a land far away, there lived a", PROMPTS[2]],
                 max_new_tokens=16, decode_prefix_tokens=4,
                 checks="{layout: {}, speculator_layout: {}, logits: {}, generation: {}, lossless: {}, acceptance: {}}",
                 extra="reference: tp1\nspeculative: {k: 3, draft_noise: 0.1}\n")


def test_the_decode_side_takes_a_draft_speculator_and_names_the_form_otherwise() -> None:
    topo = parse_topology_name("tp4>tp2-draft")
    assert topo.speculator == "draft" and topo.prefill is not None and topo.prefill.speculator == "none"
    with pytest.raises(ConfigError, match=r"takes -draft .* not -mtp.*PREFILL>DECODE\[-draft\]"):
        parse_topology_name("tp2>tp2-mtp")
    with pytest.raises(ConfigError, match=r"the prefill layout has speculator 'draft'.*tp2>tp2-draft"):
        parse_topology_name("tp2-draft>tp2")


suite_file = suite_fixture(SUITE, "pds")
cache_dir = cache_fixture()


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    code, (cell,) = run_cells(out, suite, cache, *extra)
    return code, checks_of(cell)


def test_acceptance_through_pd_equals_the_reference_s(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    code, checks = _run(tmp_path / "r", suite_file, cache_dir)
    assert code == 0, {n: ch["reason"] for n, ch in checks.items() if ch["verdict"] not in ("PASS", "SKIP")}
    for name in ("lossless", "acceptance", "pd_transfer", "pd_load", "pd_consistency"):
        assert checks[name]["verdict"] == "PASS", (name, checks[name]["reason"])
    assert "0/3 prompts' accept traces differ" in checks["acceptance"]["reason"]
    (record,) = [json.loads(p.read_text()) for p in (tmp_path / "r" / "runs").rglob("pd.json")]
    speculative = [load for load in record["decode"][0]["loads"] if load["route"] == "speculative"]
    assert len(speculative) == 3 and all(load["state"] == "loaded" for load in speculative)


def test_a_stale_draft_cache_through_pd_fails_acceptance(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    code, checks = _run(tmp_path / "r", suite_file, cache_dir, "--fault", "draft-stale-kv")
    assert code == 1
    assert checks["acceptance"]["verdict"] == "FAIL", checks["acceptance"]["reason"]
    assert checks["lossless"]["verdict"] == "PASS"  # greedy output stays lossless: only acceptance drops
