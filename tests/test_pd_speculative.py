"""A draft speculator through disaggregated prefill/decode over real gloo worlds: `PREFILL>DECODE-draft` parses
(the speculator runs in the decode world; -mtp and a prefill-side speculator are errors naming the form), the
target's prompt KV is loaded for the speculative route too, the draft computes its own cache, and acceptance
through P/D equals the non-disaggregated reference's (negative control); a draft cache that keeps rejected
tokens FAILs acceptance through P/D (positive control)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.records.results import results_cells
from harness.specs.topology import parse_topology_name

SUITE = """
name: pds
version: 1
models: [tiny-gqa]
topologies: ["tp4>tp2-draft"]
reference: tp1
max_new_tokens: 16
decode_prefix_tokens: 4
kv_budget_mib: 8
max_seq_len: 256
prompts:
  - "The capital of France is"
  - "Once upon a time, in a land far away, there lived a"
  - "Q: 17 + 25 = ?\\nA:"
speculative: {k: 3, draft_noise: 0.1}
checks: {layout: {}, speculator_layout: {}, logits: {}, generation: {}, lossless: {}, acceptance: {}}
"""


def test_the_decode_side_takes_a_draft_speculator_and_names_the_form_otherwise() -> None:
    topo = parse_topology_name("tp4>tp2-draft")
    assert topo.speculator == "draft" and topo.prefill is not None and topo.prefill.speculator == "none"
    with pytest.raises(ConfigError, match=r"takes -draft .* not -mtp.*PREFILL>DECODE\[-draft\]"):
        parse_topology_name("tp2>tp2-mtp")
    with pytest.raises(ConfigError, match=r"the prefill layout has speculator 'draft'.*tp2>tp2-draft"):
        parse_topology_name("tp2-draft>tp2")


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "pds.yaml"
    path.write_text(SUITE)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _run(out: Path, suite: Path, cache: Path, *extra: str) -> tuple[int, dict[str, dict]]:
    code = main(["run", "--suite", str(suite), "--out", str(out), "--cache-dir", str(cache), *extra])
    (cell,) = results_cells(out)
    return code, {ch["name"]: ch for ch in cell["checks"]}


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
