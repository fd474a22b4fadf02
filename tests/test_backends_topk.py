"""The top-k-only engine (embedded-topk): it withholds full logits, hidden states and attention
outputs, and every seed-class fault still FAILs as silent corruption from top-k logprobs alone;
a clean cell PASSes; localization is a SKIP naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.records.results import results_cells

TOPK_SUITE = """
name: topk
version: 1
models: [tiny-gqa]
topologies: [tp2dcp2]
max_new_tokens: 8
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 128
prompts: ["The capital of France is", "Q: 17 + 25 = ?"]
"""


@pytest.fixture(scope="module")
def cache_dir(shared_cache: Path) -> Path:
    return shared_cache


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "topk.yaml"
    path.write_text(TOPK_SUITE)
    return path


def _run(tmp_path: Path, suite: Path, cache: Path, *args: str) -> tuple[int, dict]:
    rc = main(["run", "--suite", str(suite), "--engine", "embedded-topk", "--out", str(tmp_path),
               "--cache-dir", str(cache), *args])
    (cell,) = results_cells(tmp_path)
    return rc, cell


def test_clean_topk_cell_passes_and_localization_skips_with_the_reason(tmp_path: Path, suite_file: Path,
                                                                        cache_dir: Path) -> None:
    rc, cell = _run(tmp_path, suite_file, cache_dir, "--topo", "tp2dcp2")
    checks = {c["name"]: c for c in cell["checks"]}
    assert rc == 0 and cell["status"] == "PASS", [c["reason"] for c in cell["checks"]]
    assert cell["engine"] == "embedded-topk"
    for path in ("prefill", "decode"):
        metrics = checks[f"logits_{path}"]["metrics"]
        assert checks[f"logits_{path}"]["verdict"] == "PASS" and metrics["source"] == "top-k logprobs"
        assert metrics["k"] == 20 and metrics["top1_agreement"] == 1.0
    assert checks["localization"]["verdict"] == "SKIP"
    assert checks["localization"]["reason"] == ("engine embedded-topk gives no hidden_states: "
                                                "localization unavailable")
    assert checks["inputs"]["verdict"] == "PASS"
    run_dir = Path(cell["run_dir"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["backend"]["name"] == "embedded-topk"
            and "full_logits" not in manifest["backend"]["capabilities"]["provides"])
    from safetensors import safe_open
    with safe_open(str(run_dir / "tensors.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert main(["validate", str(run_dir)]) == 0  # a top-k-only run keeps the contract
    assert "decode_topk_logprobs.0" in keys and not any(k.startswith(("prefill_logits", "decode_logits", "hidden",
                                                                      "attn")) for k in keys)


@pytest.mark.parametrize("fault,model,topo", [
    ("dcp-tp-kv-layout", "tiny-gqa", "tp2dcp2"),
    ("dcp-lse-merge", "tiny-gqa", "tp2dcp2"),
    ("dcp-token-owner", "tiny-gqa", "tp2dcp2"),
    ("gcd-naive-gqa", "tiny-kv6", "tp4"),
])
def test_seed_faults_fail_as_silent_corruption_from_topk_logprobs(tmp_path: Path, suite_file: Path, cache_dir: Path,
                                                                  fault: str, model: str, topo: str) -> None:
    rc, cell = _run(tmp_path, suite_file, cache_dir, "--model", model, "--topo", topo, "--fault", fault)
    checks = {c["name"]: c for c in cell["checks"]}
    assert rc == 1 and cell["status"] == "FAIL" and cell["silent_corruption"] is True
    decode = checks["logits_decode"]
    assert decode["verdict"] == "FAIL" and decode["metrics"]["source"] == "top-k logprobs", decode["reason"]
    assert "KL lower bound" in decode["reason"]
    assert checks["localization"]["verdict"] == "SKIP" and cell["localization"] is None
