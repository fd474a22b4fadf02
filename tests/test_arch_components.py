"""Architecture components (harness/arch): one plan_model for every shipped model, and no code outside the
components branches on the architecture."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.arch.component import PlanError
from harness.arch.components import (
    DENSE_PLAN_FAULTS,
    LAYOUT_FAULTS,
    Attention,
    GatedAttention,
    GatedDeltaNet,
    LatentAttention,
    MoE,
    SparseAttention,
)
from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.arch.scope import OWNED_FAULTS
from harness.cli.plan.command import plan_document
from harness.core.errors import ConfigError
from harness.engine.faults import FAULTS
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.partition.hybrid_layout import plan_hybrid
from harness.partition.layout import plan_layout, plan_speculator
from harness.partition.mla_layout import plan_mla
from harness.specs.model import shipped_models
from harness.specs.pool import PoolSettings
from harness.specs.topology import load_catalog

HARNESS = Path(__file__).resolve().parents[1] / "harness"
# where the architecture fields are defined, with their partition math, and the components that read them
ALLOWED = ("arch/", "specs/", "partition/")
ARCH_FLAGS = frozenset({"mla", "hybrid", "sparse"})  # ModelSpec.mla / .hybrid / .sparse, AttentionShape.mla
ARCH_NUMBERS = frozenset({"kv_lora_rank"})         # a number that is a flag when tested (kv_lora_rank > 0)
# a rank report's MLA and hybrid records (harness/records/rankreport.py RankReport.mla / .hybrid) are what a rank says
# it holds, not the model's flags: the components' layout checks read them as `report.mla` / `report.hybrid`
RECORD_RECEIVERS = frozenset({"report"})
TOPOLOGIES = ("tp1", "tp2", "tp4", "tp9", "tp4dcp2", "tp4dcp4", "tp4dcp4i4", "tp4dcp2c", "tp4dcp2q", "tp4-mtp",
              "tp4dcp4-draft", "tp4ep2", "tp4ep4-mtp")


def architecture_reads(source: str) -> list[str]:
    """`line: expression` of every read of an architecture flag in `source`, and every test of an
    architecture number (an if, a conditional expression, a boolean operation or a comparison)."""
    tree = ast.parse(source)
    tested: set[int] = set()
    for node in ast.walk(tree):
        tests = ([node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert))
                 else node.values if isinstance(node, ast.BoolOp)
                 else [node] if isinstance(node, (ast.Compare, ast.UnaryOp)) else [])
        tested.update(id(n) for t in tests for n in ast.walk(t))
    reads = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
             and (node.attr in ARCH_FLAGS or (node.attr in ARCH_NUMBERS and id(node) in tested))
             and not (isinstance(node.value, ast.Name) and node.value.id in RECORD_RECEIVERS)]
    return [f"{node.lineno}: {ast.unparse(node)}" for node in sorted(reads, key=lambda n: (n.lineno, n.col_offset))]


def test_the_scanner_flags_a_branch_on_the_architecture() -> None:
    snippet = ("def build(spec):\n"
               "    if spec.mla:\n        return 1\n"
               "    parts = hybrid_parts(spec) if spec.hybrid is not None else None\n"
               "    latent = spec.kv_lora_rank > 0\n"
               "    width = spec.kv_lora_rank + spec.qk_rope_dim\n"
               "    return parts, latent, width\n")
    assert architecture_reads(snippet) == ["2: spec.mla", "4: spec.hybrid", "5: spec.kv_lora_rank"]
    assert architecture_reads("plan = model_plan.latent\nwidth = spec.kv_lora_rank * 2\nrecord = report.mla\n") == []


def test_no_code_outside_the_components_branches_on_the_architecture() -> None:
    found = {}
    for path in sorted(HARNESS.rglob("*.py")):
        rel = path.relative_to(HARNESS).as_posix()
        if rel.startswith(ALLOWED):
            continue
        reads = architecture_reads(path.read_text())
        if reads:
            found[rel] = reads
    assert found == {}, f"architecture branches outside harness/arch: {found}"


def test_every_model_is_its_list_of_components() -> None:
    names = {name: model_of(load_model(name)).names for name in shipped_models()}
    assert names["tiny-gqa"] == (Attention.name,)
    assert names["tiny-mla"] == (LatentAttention.name,)
    assert names["tiny-hybrid"] == (GatedAttention.name, MoE.name, GatedDeltaNet.name)
    assert names["tiny-dsa"] == (SparseAttention.name,)
    assert set(names) == set(shipped_models())


def _old_plans(name: str, topo_name: str) -> dict:
    """What the callers assembled before plan_model: the attention layout, the MLA view, the hybrid plan
    and the speculator's, each from its planner."""
    model, topo = load_model(name), load_catalog().resolve(topo_name)[0]
    dense = plan_layout(model.attention_shape, topo.tp, topo.dcp, placement=topo.placement,
                        q_replicated=topo.q_replicated)
    hybrid = plan_hybrid(model.attention_shape, model.hybrid, topo.tp, topo.dcp, topo.ep) if model.hybrid else None
    return {"attention": (hybrid.attention if hybrid else dense).to_dict(),
            "mla": plan_mla(model.attention_shape, model.mla_shape, topo.tp, topo.dcp, topo.placement,
                            topo.q_replicated).to_dict() if model.mla else None,
            "hybrid": hybrid.to_dict() if hybrid else None,
            "speculator": plan_speculator(model.speculator_shape, topo.tp).to_dict()
            if topo.speculator != "none" else None}


@pytest.mark.parametrize("name", sorted(shipped_models()))
def test_plan_model_gives_each_planner_s_plan(name: str) -> None:
    planned = 0
    for topo_name in TOPOLOGIES:
        topo = load_catalog().resolve(topo_name)[0]
        try:
            plan = plan_model(model_of(load_model(name)), topo)
        except PlanError as exc:
            # ep > 1 without experts and a hybrid model's DCP placement are plan_model's own rules
            if exc.component != MoE.name and "is a hybrid model" not in str(exc):
                with pytest.raises(ConfigError) as old:
                    _old_plans(name, topo_name)  # the planners refuse it in the same words
                assert str(old.value) == str(exc)
            continue
        planned += 1
        hybrid = plan.hybrid_plan
        assert _old_plans(name, topo_name) == {
            "attention": plan.attention.to_dict(), "mla": plan.latent.to_dict() if plan.latent else None,
            "hybrid": hybrid.to_dict() if hybrid else None,
            "speculator": plan.speculator.to_dict() if plan.speculator else None}
    assert planned >= 2


def test_harness_plan_json_matches_the_recorded_main_output(tmp_path: Path) -> None:
    """The documents of `harness plan --format json` for a model of each kind, against those recorded
    before the components (tests/data/plan_documents.json)."""
    recorded = json.loads((Path(__file__).parent / "data" / "plan_documents.json").read_text())
    for key, text in recorded.items():
        name, topo, budget = key.split("|")
        doc = plan_document(load_model(name), topo, None if budget == "None" else float(budget), None, 16, 16)
        assert json.dumps(doc, indent=2) == text, key


def test_the_faults_components_own_are_faults() -> None:
    """A component's fault set names faults of the registry (a typo would leave a fault never inert)."""
    owned = OWNED_FAULTS | LAYOUT_FAULTS | DENSE_PLAN_FAULTS
    assert owned <= set(FAULTS), owned - set(FAULTS)


@pytest.mark.parametrize("name", ["tiny-gqa", "tiny-mla", "tiny-hybrid"])
def test_each_component_s_report_fields_are_in_the_rank_report(name: str) -> None:
    """The rank-report fields a component's layout check reads are those the engine writes for it."""
    spec = load_model(name)
    engine = Engine(spec, load_weights(spec), ParallelState.single(), pool=PoolSettings(max_seq_len=64))
    written = engine.layout_report().to_json()
    for component in model_of(spec).components:
        for field in component.report_fields:
            head, _, rest = field.partition(".")
            assert head in written and (not rest or rest in written[head]), (component.name, field)


@pytest.mark.parametrize(("model", "topo", "error"), [
    ("tiny-hybrid", "tp4dcp2c", "model tiny-hybrid is a hybrid model: its attention layers run round-robin DCP"),
    ("tiny-gqa", "tp4ep2", "ep=2 needs a MoE model; tiny-gqa is dense (no hybrid.experts)")])
def test_harness_serve_refuses_a_model_plan_does_not_split(model: str, topo: str, error: str) -> None:
    """`harness serve` plans the whole model before any rank starts: one line, exit 2 (a split that
    only a component refuses too)."""
    proc = subprocess.run([sys.executable, "-m", "harness", "serve", "--model", model, "--topo", topo, "--port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                            "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"harness: error: {error}")
