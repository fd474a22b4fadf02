"""A hybrid (Qwen3-Next) rank as vLLM's layout probe reports it (tests/vllm_plugin/harness_vllm_probe/gdn.py: the
`hybrid` record of rank<R>.json) becomes RankReport.hybrid, and the `layout` check gives it the embedded engine's
verdicts: a clean tp2 of tiny-qwen3next PASSes (the pool sized in vLLM's blocks); a rank whose in_proj_qkvz holds
another rank's K-head group (the plugin's gdn-head-shard fault) FAILs naming the rank and its V / K heads; a recurrent
state holding the wrong number of heads, a conv cut off its component rows and a shared expert counted twice FAIL
naming what differs; a record with an unknown field is a schema error naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.backends.http.layout import probe_layout
from harness.compare.layout.hybrid import check_hybrid_layout
from harness.core.verdict import Verdict
from harness.formats.locate import load_model
from harness.records.rankreport import LayoutSchemaError
from harness.specs.topology import parse_topology_name

SPEC = load_model("tiny-qwen3next")  # 4 Q / 2 KV heads of 64; GDN 2 K / 6 V heads of 128; 8 experts of 64


def _hybrid(rank: int, shard: int) -> dict[str, Any]:
    """What the probe writes for a tp2 rank whose in_proj_qkvz holds K-head group `shard`."""
    v = list(range(3 * shard, 3 * shard + 3))
    return {"linear": {"v_heads": v, "k_heads": [shard], "out_v_heads": v,
                       "conv_rows": [[128 * rank, 128 * rank + 128], [256 + 128 * rank, 384 + 128 * rank],
                                     [512 + 384 * rank, 896 + 384 * rank]],
                       "state_digests": [], "weight_checksum": f"w{rank}", "recurrent_heads": 3, "conv_channels": 640,
                       "state_bytes_per_slot": 3 * (3 * 128 * 128 * 4 + 640 * 3 * 2)},
            "moe": {"experts": list(range(8)), "expert_ffn_shard": [32 * rank, 32 * rank + 32], "expert_columns": 32,
                    "shared_columns": 64, "router_checksum": "router"},
            "cache_groups": {"slots": 146, "attention_blocks": 146, "attention_blocks_per_seq": 1, "state_slots": 146,
                             "state_bytes": 87_000_000, "attention_bytes": 33_000_000}}


def _report(rank: int, shard: int | None = None) -> dict[str, Any]:
    layer = {"layer": "model.layers.3.self_attn", "tp_rank": rank, "num_heads": 2, "num_kv_heads": 1,
             "claimed_q_heads": [2 * rank, 2 * rank + 1], "claimed_kv_heads": [rank],
             "q_heads": [2 * rank, 2 * rank + 1], "k_heads": [rank], "v_heads": [rank]}
    return {"schema_version": 1, "tp_rank": rank, "tp_size": 2, "dcp_rank": 0, "dcp_size": 1, "dcp_members": [rank],
            "layers": [layer], "kv_weight_checksums": {str(rank): f"kv{rank}"},
            "hybrid": _hybrid(rank, rank if shard is None else shard),
            "kv_cache": {"num_blocks": 146, "block_size": 896, "bytes_per_token": 256, "tensor_bytes": 1 << 27,
                         "bound_bytes": 146 * 896 * 256, "budget_bytes": 1 << 26, "sizing": "blocks",
                         "max_model_len": 256}}


def _check(tmp_path: Path, *reports: dict[str, Any]) -> Any:
    for report in reports:
        (tmp_path / f"rank{report['tp_rank']}.json").write_text(json.dumps(report))
    plan = plan_model(model_of(SPEC), parse_topology_name("tp2")).hybrid_plan
    assert plan is not None
    return check_hybrid_layout(plan, probe_layout(tmp_path, 2))


def test_a_clean_qwen3_next_probe_report_passes_layout(tmp_path: Path) -> None:
    result = _check(tmp_path, _report(0), _report(1))
    assert result.verdict is Verdict.PASS, result.metrics["problems"]
    assert "3 linear-attention layers as planned, 8 experts over ep=1; cache groups in blocks" in result.reason


def test_a_gdn_head_slice_from_another_rank_fails_naming_rank_and_heads(tmp_path: Path) -> None:
    result = _check(tmp_path, _report(0), _report(1, shard=0))
    assert result.verdict is Verdict.FAIL
    problems = result.metrics["problems"]
    assert "rank 1 holds linear-attention v heads 0-2, planned 3-5" in problems
    assert "rank 1 holds linear-attention k heads 0, planned 1" in problems
    assert any(p.startswith("linear-attention V head 0's output is added by 2 ranks") for p in problems)


@pytest.mark.parametrize(("path", "value", "problem"), [
    (("linear", "recurrent_heads"), 6, "rank 1's recurrent state holds 6 V heads, planned 3"),
    (("linear", "conv_channels"), 1280, "rank 1's conv state holds 1280 channels, planned 640"),
    (("linear", "conv_rows"), [[0, 128], [384, 512], [896, 1280]],
     "rank 1 loads packed in_proj/conv rows 0-127, 384-511, 896-1279, planned per component (q|k|v) 128-255, "
     "384-511, 896-1279"),
    (("moe", "shared_columns"), 128, "rank 1 holds 128 shared-expert columns, planned 64"),
])
def test_a_rank_off_the_plan_fails_naming_what_differs(tmp_path: Path, path: tuple[str, str], value: Any,
                                                        problem: str) -> None:
    bad = _report(1)
    bad["hybrid"][path[0]][path[1]] = value
    result = _check(tmp_path, _report(0), bad)
    assert result.verdict is Verdict.FAIL and problem in result.metrics["problems"], result.metrics["problems"]


def test_an_unknown_field_in_the_hybrid_record_is_a_schema_error(tmp_path: Path) -> None:
    bad = _report(1)
    bad["hybrid"]["linear"]["heads_held"] = 3
    (tmp_path / "rank0.json").write_text(json.dumps(_report(0)))
    (tmp_path / "rank1.json").write_text(json.dumps(bad))
    with pytest.raises(LayoutSchemaError, match=r"layout probe rank 1: unknown field hybrid\.linear\.'heads_held'"):
        probe_layout(tmp_path, 2)
