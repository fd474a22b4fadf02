"""MLA and the DCP token placements in the embedded engine, under real gloo processes: parity with tp1,
the layout self-report (latent rows, Q weights, stored positions), and each new fault flagged by a run
as silent corruption with its localization (positive controls)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.engine.fault_scope import inert_reason
from harness.flow.runner import skip_reason
from harness.formats.locate import load_model
from harness.partition.layout import local_positions
from harness.specs.topology import parse_topology_name
from tests.test_engine_parity import ATOL, _max_err

# MLA at TP (the whole latent cache on every rank) and under DCP with each placement and Q mode; GQA
# under the interleaved and contiguous placements
SPLITS = [("tiny-mla", "tp2"), ("tiny-mla", "tp4dcp4"), ("tiny-mla", "tp4dcp2c"), ("tiny-mla", "tp4dcp4i4q"),
          ("tiny-gqa", "tp4dcp4i4"), ("tiny-gqa", "tp4dcp2c")]


@pytest.mark.parametrize(("model", "topo"), SPLITS)
def test_parallel_matches_tp1_and_reports_its_layout(run, model: str, topo: str) -> None:
    ref, par = run(model, "tp1"), run(model, topo)
    assert ref.ok and par.ok, par.manifest.get("error")
    for kind in ("prefill_logits", "decode_logits", "hidden", "attn"):
        assert _max_err(ref, par, kind) < ATOL, kind
    for c in ref.cases:
        assert torch.equal(ref.tensor("gen_tokens", c.index), par.tensor("gen_tokens", c.index))
    t = parse_topology_name(topo)
    ranks = par.layout["target"]["ranks"]
    spec = load_model(model)
    if spec.mla:  # one latent row per stored token (kv_lora + rope values, every layer), no separate V
        assert all(r["kv_bytes_per_token"] == spec.layers * (spec.kv_lora_rank + spec.qk_rope_dim) * 4 for r in ranks)
        assert all(r["q_mode"] == ("replicated" if t.q_replicated else "split") for r in ranks)
        held = [r["q_weight_heads"] for r in ranks]
        assert held == ([r["group_q_heads"] for r in ranks] if t.q_replicated else [r["q_heads"] for r in ranks])
        assert len({r["kv_weight_checksums"]["0"] for r in ranks}) == 1  # the latent projection everywhere
    if t.dcp > 1:  # each rank stored exactly the placement's share of the probe sequence
        for r in ranks:
            probe = r["stored_positions"]
            assert probe["positions"] == local_positions(probe["length"], r["dcp_rank"], t.dcp, t.placement,
                                                         probe["prompt_len"])


def test_a_short_prompt_leaves_ranks_without_tokens(run) -> None:
    """tp4dcp2c: a 3-token decode prefix is dealt in blocks of 2, so the last rank of each group owns one
    prompt token and every decode token, the first rank no decode token: LSE -inf shards are merged."""
    par = run("tiny-mla", "tp4dcp2c")
    first = par.layout["target"]["ranks"][0]["stored_positions"]
    assert first["prompt_len"] == 3 and first["positions"] == [0, 1]


FAULTS = [  # fault, model, topology, the layout problem it leaves (None: the layout is as planned)
    ("mla-rope-local-slot", "tiny-mla", "tp4dcp4", None),
    ("dcp-lse-base2", "tiny-mla", "tp4dcp2", None),
    ("dcp-empty-shard-lse0", "tiny-mla", "tp4dcp4", None),
    ("q-replicated-own-slice", "tiny-mla", "tp4dcp4q", "Q weights (q_b_proj, w_kc) of head 0 differ between ranks"),
    ("dcp-interleave-per-token", "tiny-gqa", "tp4dcp4i4",
     "rank 0 stores tokens 0,4 of a 8-token sequence, the interleave 4 placement gives it 0-3"),
    ("dcp-contiguous-global-len", "tiny-gqa", "tp4dcp2c", "rank 0 stores tokens"),
]
SMALL_SUITE = """
name: mla-small
version: 1
description: a few short prompts on the MLA and GQA tiny models
models: [tiny-mla, tiny-gqa]
topologies: [tp4dcp4]
reference: tp1
seeds: [0]
max_new_tokens: 6
decode_prefix_tokens: 3
prompts: ["Hi", "The capital of France is", "Q: 17 + 25 = ?\\nA:"]
checks: {layout: {}, logits: {}, generation: {}}
"""


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "mla-small.yaml"
    path.write_text(SMALL_SUITE)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(("fault", "model", "topo", "layout_problem"), FAULTS)
def test_fault_is_silent_corruption_localized(tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str,
                                              model: str, topo: str, layout_problem: str | None) -> None:
    rc = main(["run", "--suite", str(suite_file), "--model", model, "--topo", topo, "--fault", fault,
               "--out", str(tmp_path), "--cache-dir", str(cache_dir)])
    assert rc == 1
    (cell,) = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert cell["status"] == "FAIL" and cell["silent_corruption"] is True
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    reasons = {c["name"]: c["reason"] for c in cell["checks"]}
    assert verdicts["logits_prefill"] == verdicts["logits_decode"] == "FAIL", reasons
    assert cell["localization"]["summary"].startswith("layer 0 attention: heads 0-7 on ranks 0-3"), cell["localization"]
    if layout_problem is None:
        assert verdicts["layout"] == "PASS", reasons["layout"]
    else:
        layout = next(c for c in cell["checks"] if c["name"] == "layout")  # the reason leads with one problem
        problems = [reasons["layout"], *layout["metrics"].get("problems", [])]
        assert verdicts["layout"] == "FAIL" and any(layout_problem in p for p in problems), problems
    if layout_problem is not None and "stores tokens" in layout_problem:  # the placement that ran is another one
        assert reasons["features_on"].startswith("requested but not run: placement: "), reasons["features_on"]
    else:
        assert verdicts["features_on"] == "PASS", reasons["features_on"]


def test_the_clean_cells_of_the_fault_topologies_pass(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    """Negative control of the faults above: the same cells without a fault pass every check."""
    rc = main(["run", "--suite", str(suite_file), "--topo", "tp4dcp4q,tp4dcp4i4,tp4dcp2c", "--model", "tiny-mla",
               "--out", str(tmp_path), "--cache-dir", str(cache_dir)])
    cells = json.loads((tmp_path / "results.json").read_text())["cells"]
    assert rc == 0 and [c["status"] for c in cells] == ["PASS"] * 3


@pytest.mark.parametrize(("fault", "model", "topo", "why"), [
    ("mla-rope-local-slot", "tiny-gqa", "tp4dcp4", "acts on MLA attention"),
    ("q-replicated-own-slice", "tiny-mla", "tp4dcp4", "needs a Q-replicated DCP topology"),
    ("dcp-interleave-per-token", "tiny-gqa", "tp4dcp4", "needs a interleave DCP placement (e.g. tp4dcp4i16)"),
    ("dcp-contiguous-global-len", "tiny-gqa", "tp4dcp4i4", "needs a contiguous DCP placement (e.g. tp4dcp4c)"),
    (None, "tiny-gqa", "tp4dcp4q", "Q-replicated DCP (topology suffix q) needs an MLA model"),
])
def test_cells_a_fault_or_mode_cannot_act_on_are_skips(fault: str | None, model: str, topo: str, why: str) -> None:
    spec, t = load_model(model), parse_topology_name(topo)
    reason = skip_reason(spec, t, fault)
    assert reason is not None and why in reason, reason
    if fault == "mla-rope-local-slot":
        assert inert_reason(fault, spec, t) == reason


def test_http_engines_skip_the_placements_their_templates_cannot_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLA model is served from its DeepSeek-V2 export (tests/test_deepseek_export.py); a placement or Q mode the
    template has no option for is a SKIP naming the axis, never a run with another layout."""
    from harness.backends.http.backend import HttpBackend

    backend = HttpBackend("harness-serve")
    assert backend.skip_reason(load_model("tiny-mla"), parse_topology_name("tp2")) is None
    assert "no option for the DCP token placement (interleave 16)" in backend.skip_reason(
        load_model("tiny-gqa"), parse_topology_name("tp4dcp4i16"))
    assert "no option for Q replication" in backend.skip_reason(load_model("tiny-mla"),
                                                                parse_topology_name("tp4dcp4q"))
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", sys.executable)  # the template alone decides; nothing starts
    vllm = HttpBackend("vllm")
    assert vllm.skip_reason(load_model("tiny-mla"), parse_topology_name("tp4dcp4i16q")) is None
    assert "contiguous DCP token placement" in vllm.skip_reason(load_model("tiny-mla"),
                                                                parse_topology_name("tp4dcp4c"))
