"""The reference engine under real torchrun/gloo processes matches tp1 for every split it allows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.records.artifacts import RunArtifacts
from harness.records.contract import GEN_TOKENS, GEN_TOPK_LOGPROBS
from tests.conftest import launch_run

# (model, topology): every shipped tiny model at the splits its heads allow, incl. GCD duplication
# (tiny-kv6 at tp4), MQA at tp8 and the SmolLM2 head layout at tp3/tp9.
SPLITS = [
    ("tiny-gqa", "tp2"), ("tiny-gqa", "tp4"), ("tiny-gqa", "tp4dcp2"), ("tiny-gqa", "tp4dcp4"),
    ("tiny-gqa", "tp8dcp8"),
    ("tiny-kv6", "tp4"), ("tiny-kv6", "tp4dcp2"),
    ("tiny-mqa", "tp8"), ("tiny-mqa", "tp4dcp4"),
    ("tiny-9h3kv", "tp3"), ("tiny-9h3kv", "tp3dcp3"), ("tiny-9h3kv", "tp9"),
]
ATOL = 2e-4  # fp32 logits of magnitude ~10: reduction-order noise is ~1e-5


def _max_err(a: RunArtifacts, b: RunArtifacts, kind: str) -> float:
    return max((a.tensor(kind, c.index) - b.tensor(kind, c.index)).abs().max().item() for c in a.cases)


@pytest.mark.parametrize(("model", "topo"), SPLITS)
def test_parallel_matches_tp1(run, model: str, topo: str) -> None:
    ref, par = run(model, "tp1"), run(model, topo)
    assert ref.ok and par.ok, par.manifest.get("error")
    for kind in ("prefill_logits", "decode_logits", "hidden", "attn"):
        assert _max_err(ref, par, kind) < ATOL, kind
    for c in ref.cases:
        assert torch.equal(ref.tensor("gen_tokens", c.index), par.tensor("gen_tokens", c.index))
    ranks = par.layout["target"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(par.manifest["topology"]["tp"]))


def test_decode_through_cache_equals_full_recompute(run) -> None:
    ref = run("tiny-gqa", "tp1")
    for c in ref.cases:
        full = ref.tensor("prefill_logits", c.index)[c.decode_start:]  # [T-D, V]
        assert torch.allclose(ref.tensor("decode_logits", c.index), full, atol=1e-4)


def test_dcp_stores_each_token_once_per_group(run) -> None:
    """Under tp4dcp4 every rank holds all KV heads (kv_tp_size 1) with identical K/V weights."""
    par = run("tiny-gqa", "tp4dcp4")
    ranks = par.layout["target"]["ranks"]
    assert all(r["kv_heads"] == [0, 1] for r in ranks)
    assert len({tuple(sorted(r["kv_weight_checksums"].items())) for r in ranks}) == 1


@pytest.mark.parametrize(("fault", "model", "topo", "kinds"), [
    ("dcp-tp-kv-layout", "tiny-gqa", "tp4dcp4", ("decode_logits", "prefill_logits")),
    ("dcp-lse-merge", "tiny-gqa", "tp4dcp4", ("decode_logits",)),
    ("dcp-token-owner", "tiny-gqa", "tp4dcp4", ("decode_logits",)),
    ("gcd-naive-gqa", "tiny-kv6", "tp4", ("decode_logits", "prefill_logits")),
])
def test_fault_changes_parallel_output_only(run, fault: str, model: str, topo: str, kinds: tuple[str, ...]) -> None:
    ref, clean, broken = run(model, "tp1"), run(model, topo), run(model, topo, fault)
    assert broken.ok, broken.manifest.get("error")
    for kind in kinds:
        assert _max_err(ref, broken, kind) > 0.1, (fault, kind)
        assert _max_err(ref, clean, kind) < ATOL


def test_dcp_token_owner_leaves_prefill_alone(run) -> None:
    """The token-owner bug lives in decode only: the prefill path still matches."""
    ref, broken = run("tiny-gqa", "tp1"), run("tiny-gqa", "tp4dcp4", "dcp-token-owner")
    assert _max_err(ref, broken, "prefill_logits") < ATOL


def test_gcd_fault_is_inert_at_tp1(run) -> None:
    """The naive local Q->KV mapping equals the global one when one rank holds every head: a tp1 run
    with the fault is a separate launch whose outputs equal the clean tp1 run's."""
    ref, ref_fault = run("tiny-kv6", "tp1"), run("tiny-kv6", "tp1", "gcd-naive-gqa")
    assert ref_fault.ok and ref_fault.path != ref.path
    for kind in ("prefill_logits", "decode_logits"):
        assert _max_err(ref, ref_fault, kind) == 0.0


@pytest.mark.parametrize("fault", ["dcp-tp-kv-layout", "dcp-lse-merge", "dcp-token-owner"])
def test_dcp_faults_cannot_reach_a_run_without_dcp(fault: str) -> None:
    """A DCP fault cannot be injected where there is no DCP group (the tp1 reference, or plain TP):
    the cell is a SKIP naming why, so no reference is ever run with it."""
    from harness.flow.runner import skip_reason
    from harness.formats.locate import load_model
    from harness.specs.topology import Topology

    model = load_model("tiny-gqa")
    for topo in (Topology(tp=1), Topology(tp=4)):
        reason = skip_reason(model, topo, fault)
        assert reason is not None and "needs a DCP topology" in reason
    assert skip_reason(model, Topology(tp=4, dcp=4), fault) is None


@pytest.mark.parametrize("fault", [None, "dcp-token-owner"])
def test_shared_prompt_prefix_under_dcp_matches_tp1(tmp_path: Path, fault: str | None) -> None:
    """Engine.generate computes a common prompt prefix once and copies its KV blocks into each sequence
    (under DCP each rank copies the tokens it owns): greedy generation from prompts sharing a prefix of
    several KV blocks is the same at tp2dcp2 as at tp1, with top-k logprobs within float32 noise; with a
    DCP decode bug injected (positive control) the comparison fails."""
    prefix = "Answer each question carefully and show the steps before the final answer. " * 2
    prompts = [prefix + "Q: 2 + 3 = ?", prefix + "Q: the capital of France?", prefix + "Q: 7 * 6"]
    ref = launch_run(tmp_path / "tp1", "tiny-gqa", "tp1", prompts=prompts)
    par = launch_run(tmp_path / "tp2dcp2", "tiny-gqa", "tp2dcp2", fault=fault, prompts=prompts)
    assert min(len(c.prompt_ids) for c in ref.cases) > 128  # the shared prefix spans several blocks
    same = [par.tensor(GEN_TOKENS, c.index).tolist() == ref.tensor(GEN_TOKENS, c.index).tolist() for c in ref.cases]
    err = max((par.tensor(GEN_TOPK_LOGPROBS, c.index) - ref.tensor(GEN_TOPK_LOGPROBS, c.index)).abs().max().item()
              for c in ref.cases)
    if fault is None:
        assert all(same) and err < ATOL, (same, err)
    else:
        assert err > 100 * ATOL, (same, err)
