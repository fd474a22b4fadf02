"""Every checkpoint tensor a rank holds against the plan's slice (harness/engine/runtime/param_report.py traces the
engine's own shard code; harness/arch/param_slices.py plans; harness/compare/layout/params.py compares): every
rank of every shipped model (and the unshipped test shapes) at topologies of each kind holds exactly its
planned slices, and layout faults of every architecture show as named tensors held off the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.compare.layout.params import ParamProblem, param_problems
from harness.engine.faults import fault_flags
from harness.engine.runtime.decoders import RankBuild, build_rank
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.parallelize import rank_report
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.records.rankreport import RankReport
from harness.specs.topology import parse_topology_name

DATA = Path(__file__).parent / "data" / "models"


def held(model: str, topo: str, fault: str | None = None) -> list[ParamProblem]:
    """The param check's problems for every rank of `model` at `topo` (ranks built in this process)."""
    spec = load_model(model)
    topology = parse_topology_name(topo)
    plan = plan_model(model_of(spec), topology)
    full = load_weights(spec)
    flags = fault_flags(fault, topology)
    reports: dict[int, RankReport] = {}
    for r in range(topology.tp):
        state = ParallelState(rank=r, tp=topology.tp, dcp=topology.dcp, device=torch.device("cpu"))
        parts = build_rank(RankBuild(spec, plan, full, state, flags, 1 << 22, 64, 16, torch.float32))
        assert parts.params, "the engine reports what it holds of the checkpoint"
        reports[r] = rank_report(parts.rank_layout, parts.heads, parts.weights, spec, 0, 0, {}, params=parts.params)
    return param_problems(plan.attention, reports, plan.hybrid_plan, plan.indexer)


@pytest.mark.parametrize(("model", "topo"), [
    ("tiny-gqa", "tp2"), ("tiny-gqa", "tp8dcp4"), ("tiny-kv6", "tp4"), ("tiny-9h3kv", "tp3dcp3"),
    ("tiny-fp16-big", "tp4"), ("tiny-bf16-big", "tp4dcp2i4"), ("tiny-mla", "tp4dcp2i4q"), ("tiny-mla-bf16", "tp4dcp4"),
    ("tiny-hybrid", "tp4dcp2ep4"), ("tiny-hybrid", "tp2"), (str(DATA / "mla-bf16-unshipped.yaml"), "tp4dcp4cq"),
    (str(DATA / "gqa-fp16-unshipped.yaml"), "tp4dcp2"), ("tiny-dsa", "tp4"), ("tiny-dsa-bf16", "tp4dcp2")])
def test_every_rank_holds_exactly_its_planned_slices(model: str, topo: str) -> None:
    """Negative control: a correct engine holds every tensor as planned, its values the checkpoint's."""
    assert [p.text for p in held(model, topo)] == []


@pytest.mark.parametrize(("model", "topo", "fault", "param", "says"), [
    ("tiny-gqa", "tp4dcp2", "o-proj-shard-offset", "layers.0.o.weight", "planned rows 0-127, columns 0-31"),
    ("tiny-gqa", "tp2", "mlp-norm-other-layer", "layers.0.mlp_norm.weight", "rank 1 computes layer 1 with"),
    ("tiny-mla", "tp4", "o-proj-shard-offset", "layers.0.o.weight", "planned"),
    ("tiny-fp16-big", "tp4", "ffn-floor-split", "layers.0.gate.weight", "planned"),
    ("tiny-fp16-big", "tp2", "vocab-shard-offset", "embed.weight", "planned"),
    ("tiny-mla", "tp4dcp2q", "q-replicated-own-slice", "layers.0.q_b.weight", "planned"),
    ("tiny-hybrid", "tp4", "deltanet-packed-split", "layers.0.lin_qkv.weight", "planned"),
    ("tiny-hybrid", "tp4", "moe-shared-every-rank", "layers.0.shared.gate.weight", "planned"),
    ("tiny-hybrid", "tp4", "o-proj-shard-offset", "layers.3.o.weight", "planned"),
    ("tiny-dsa", "tp4", "dsa-indexer-weights-offset", "layers.0.index_w.weight", "planned rows")])
def test_a_shard_off_the_plan_names_tensor_rank_and_slice(model: str, topo: str, fault: str, param: str,
                                                         says: str) -> None:
    """Positive controls: the o_proj shard offset, a norm taken from another layer on some ranks, and the
    catalog's split faults of every architecture each show as the tensor held off the plan."""
    problems = held(model, topo, fault)
    hits = [p for p in problems if p.param == param]
    assert hits, [p.text for p in problems][:5]
    assert any(says in p.text for p in hits), hits[0].text
    assert hits[0].text.startswith(f"rank {hits[0].rank} ")
