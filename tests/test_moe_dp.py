"""Attention data parallel (dp<N>) with MoE over expert parallel, and redundant experts (docs/moe-dp.md):
the grammar, the expert map and its one-replica rule, the plans, the padded/dummy rows of the gathered MoE
batch in one process, and real gloo runs through `harness run`: the negative control (tp2dp2ep2 passes,
each rank running its own requests) and each DP / redundant-expert fault FAILing as silent corruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.arch.scope import inert_reason
from harness.cli import main
from harness.compare.layout.hybrid import check_hybrid_layout
from harness.core.errors import ConfigError
from harness.core.verdict import Verdict
from harness.engine.fault import FaultFlags
from harness.engine.faults import FAULTS, fault_flags
from harness.engine.layers.dp_moe import DpSplit, combine, gathered_rows
from harness.engine.layers.hybrid import shard_moe
from harness.engine.layers.moe import MoeRows, moe_activations
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.partition.expert_map import expert_map, local_first_pick
from harness.partition.hybrid_layout import plan_moe
from harness.records.results import results_cells
from harness.specs.topology import GRAMMAR, Topology, parse_topology_name

DP_FAULTS = ("dp-pad-local-count", "dp-dummy-topk-wrap", "redundant-expert-twice", "dp-shared-unreduced")

SUITE = """
name: moe-dp-small
version: 1
models: [tiny-moe-dp]
topologies: [tp2dp2ep2]
max_new_tokens: 5
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is", "Q: 17 + 25 = ?\\nA:", "Once upon a time, in a land far away"]
checks: {layout: {}, logits: {kl_factor: 25}, generation: {}}
"""


def test_the_grammar_takes_dp_and_names_what_is_valid() -> None:
    topo = parse_topology_name("tp4dp4ep4")
    assert (topo.tp, topo.dp, topo.ep, topo.world_size, topo.canonical_name) == (4, 4, 4, 4, "tp4dp4ep4")
    assert "dp<D>" in GRAMMAR
    assert Topology.from_dict(topo.to_dict()) == topo
    assert "dp" not in parse_topology_name("tp4ep4").to_dict()  # topologies without dp keep their dict
    with pytest.raises(ConfigError, match=r"dp=2 with tp=4: .*valid: dp=tp, e.g. tp4dp4ep4"):
        parse_topology_name("tp4dp2ep4")
    with pytest.raises(ConfigError, match=r"dp=2 with dcp=2: .*valid: dcp=1 with dp > 1"):
        Topology(tp=2, dcp=2, dp=2)


def test_each_routed_token_goes_to_exactly_one_replica() -> None:
    """Brute force over tokens and logical experts: the pick is one replica of that expert, the same on every
    rank (it depends on the token's index only), and every replica serves some token."""
    emap = expert_map(8, 4)
    assert emap.slot_logical == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)
    for logical in range(8):
        picks = [emap.pick(logical, token) for token in range(16)]
        assert set(picks) == set(emap.replicas(logical))
        assert all(emap.slot_logical[p] == logical for p in picks)
    # the buggy local-first pick: two ranks holding replicas of expert 0 both keep theirs
    assert local_first_pick(emap, 0, 1, (0, 1, 2)) == 0 and local_first_pick(emap, 0, 1, (6, 7, 8)) == 8
    with pytest.raises(ConfigError, match="redundant_experts=-1"):
        expert_map(8, -1)


def test_the_plan_replicates_attention_per_dp_rank_and_places_physical_slots() -> None:
    spec = load_model("tiny-moe-dp")
    plan = plan_model(model_of(spec), parse_topology_name("tp4dp4ep4"))
    assert [r.q_heads for r in plan.attention.ranks] == [tuple(range(8))] * 4  # whole attention per DP rank
    assert [r.vocab_shard for r in plan.attention.ranks] == [(0, spec.vocab)] * 4
    assert [(r.rank, r.dcp_members, r.dcp_group) for r in plan.attention.ranks] == [(r, (r,), r) for r in range(4)]
    assert plan.attention.kv_replicas == (4, 4) and plan.attention.tp == 4
    assert plan.linear is not None and plan.linear.dp == 4 and plan.linear.v_replicas == (4,) * 6
    assert plan.moe is not None and plan.moe.dp == 4 and plan.moe.physical == 12
    assert [r.experts for r in plan.moe.ranks] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)]
    assert [r.logical for r in plan.moe.ranks] == [(0, 1, 2), (3, 4, 5), (6, 7, 0), (1, 2, 3)]
    with pytest.raises(ConfigError, match="12 physical slots is not divisible by ep=8"):
        plan_moe(spec.hybrid, 8, 8)
    with pytest.raises(ConfigError, match="dp=2 .*needs a MoE model; tiny-gqa"):
        plan_model(model_of(load_model("tiny-gqa")), Topology(tp=2, dp=2))


@pytest.mark.parametrize(("fault", "model", "topo", "inert"), [
    ("dp-pad-local-count", "tiny-moe-dp", "tp4ep4", "no attention data parallel"),
    ("dp-dummy-topk-wrap", "tiny-moe-dp", "tp4dp4ep4", None),
    ("redundant-expert-twice", "tiny-hybrid", "tp4ep4", "no redundant experts"),
    ("redundant-expert-twice", "tiny-moe-dp", "tp4ep2", None),
    ("redundant-expert-twice", "tiny-moe-dp", "tp4", "the replicas of each expert are on one EP rank"),
    ("dp-shared-unreduced", "tiny-gqa", "tp4", "it is a dense model"),
])
def test_the_faults_scope(fault: str, model: str, topo: str, inert: str | None) -> None:
    topology = parse_topology_name(topo)
    why = inert_reason(fault, model_of(load_model(model)), topology, fault_flags(fault, topology))
    assert (why is None) if inert is None else (why is not None and inert in why), why


def test_padding_and_dummy_rows_never_reach_a_real_token() -> None:
    """The gathered batch of 3 DP ranks with 2, 0 (idle) and 1 tokens, padded to 2 rows each: the combine keeps
    real rows as they are; the dummy-wrap fault adds the dummy row into the last real token; the local-count
    fault (this rank's count, 1, for every DP rank) drops DP rank 0's second token on DP rank 2."""
    split = DpSplit(dp=3, rank=2, own=(0,), counts=(2, 0, 1))
    rows = gathered_rows(split, FaultFlags(), torch.device("cpu"))
    assert rows.real.tolist() == [True, True, False, False, True, False]
    assert rows.dummy.tolist() == [False, False, True, False, False, False]
    y = torch.arange(1.0, 7.0)[:, None].repeat(1, 3)  # [6, 3]: row i holds i + 1
    assert combine(y, rows)[:, 0].tolist() == [1, 2, 0, 0, 5, 0]
    wrapped = gathered_rows(split, FaultFlags(dp_dummy_wrap=True), torch.device("cpu"))
    assert combine(y, wrapped)[:, 0].tolist() == [1, 2, 0, 0, 5 + 3, 0]
    local = gathered_rows(split, FaultFlags(dp_pad_local_count=True), torch.device("cpu"))
    assert local.real.tolist() == [True, False, True, False, True, False]  # the idle rank's row: kept, unused


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 4), (4, 2)])
def test_redundant_expert_partials_sum_to_the_whole_layer(tp: int, ep: int) -> None:
    """Each rank's physical slots, summed over the world, equal one rank holding every logical expert once;
    the local-first pick (fault redundant-expert-twice) counts replicated experts twice."""
    spec = load_model("tiny-moe-dp")
    weights = load_weights(spec)
    h = torch.randn(9, spec.hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cast = lambda t: t.to(torch.float64)  # noqa: E731

    def output(world: int, ep_size: int, local_first: bool = False) -> torch.Tensor:
        plan = plan_moe(spec.hybrid, world, ep_size)
        total = torch.zeros_like(h)
        for rank in plan.ranks:
            w = shard_moe(weights, "layers.0.", rank, FaultFlags(), plan, cast)
            rows = MoeRows.all_real(h.shape[0], h.device, local_first)
            total += moe_activations(h, w, spec.hybrid.top_k, rows=rows) @ w.down.T
        return total

    whole = output(1, 1)
    torch.testing.assert_close(output(tp, ep), whole, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(output(tp, ep, local_first=True), whole)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-dp-cache")


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe-dp-suite") / "moe-dp-small.yaml"
    path.write_text(SUITE)
    return path


def test_dp_runs_each_request_on_one_rank_and_passes_clean(tmp_path: Path, suite_file: Path, cache_dir: Path) -> None:
    """The negative control on real gloo ranks: padded batches (unequal prompts per DP rank) and idle DP ranks
    (the decode path's tail) match the tp1 reference; the probe request's KV lives on one DP rank only."""
    assert main(["run", "--suite", str(suite_file), "--out", str(tmp_path), "--cache-dir", str(cache_dir)]) == 0
    (cell,) = results_cells(tmp_path)
    assert cell["status"] == "PASS", cell["checks"]
    features = {c["name"]: c for c in cell["checks"]}["features_on"]
    owner = [r["rank"] for r in json.loads((Path(cell["run_dir"]) / "layout.json").read_text())["target"]["ranks"]
             if r.get("stored_positions") is not None]
    assert len(owner) == 1 and f"dp on (the probe sequence ran on DP rank {owner[0]} only, of 2)" in features["reason"]
    ranks = json.loads((Path(cell["run_dir"]) / "layout.json").read_text())["target"]["ranks"]
    assert [r["hybrid"]["moe"]["logical"] for r in ranks] == [[0, 1, 2, 3, 4, 5], [6, 7, 0, 1, 2, 3]]
    sums = [r["hybrid"]["moe"]["slot_checksums"] for r in ranks]
    assert sums[0][:4] == sums[1][2:]  # the replicas hold their logical experts' weights
    # the layout check's positive controls on the expert map: a replica with other weights, a wrong slot
    target = json.loads((Path(cell["run_dir"]) / "layout.json").read_text())["target"]
    plan = plan_model(model_of(load_model("tiny-moe-dp")), parse_topology_name("tp2dp2ep2")).hybrid_plan
    assert plan is not None
    assert check_hybrid_layout(plan, target).verdict is Verdict.PASS
    target["ranks"][1]["hybrid"]["moe"]["slot_checksums"][2] = "0" * 16  # slot 8: logical expert 0's replica
    result = check_hybrid_layout(plan, target)
    assert result.verdict is Verdict.FAIL and "the replicas of logical expert 0 (columns 0-63) hold different weights" \
        in result.reason, result.reason
    target["ranks"][1]["hybrid"]["moe"]["logical"][2] = 5
    assert "rank 1 loads logical experts [6, 7, 5, 1, 2, 3] into its physical slots 6-11, the expert map plans " \
           "[6, 7, 0, 1, 2, 3]" in check_hybrid_layout(plan, target).metrics["problems"]


@pytest.mark.parametrize("fault", DP_FAULTS)
def test_dp_fault_is_silent_corruption(tmp_path: Path, suite_file: Path, cache_dir: Path, fault: str) -> None:
    assert fault in FAULTS
    assert main(["run", "--suite", str(suite_file), "--fault", fault, "--out", str(tmp_path),
                 "--cache-dir", str(cache_dir)]) == 1
    (cell,) = results_cells(tmp_path)
    assert cell["status"] == "FAIL" and cell["silent_corruption"] is True, cell["checks"]
    verdicts = {c["name"]: c["verdict"] for c in cell["checks"]}
    assert verdicts["layout"] == "PASS" and verdicts["logits_decode"] == "FAIL", verdicts
    # every DP fault breaks the MoE combine: the MoE FFN is blamed, never the layer's token mixer
    assert cell["localization"]["summary"].startswith("layer 0, the FFN (MoE"), cell["localization"]
