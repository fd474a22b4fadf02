"""The typed rank report of layout.json (harness/records/rankreport.py): every record survives JSON and back,
the JSON shape is the one engines have always written, and a broken report is one error naming the
entry, the rank and the field."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from harness.backends.http.layout import probe_layout
from harness.records.rankreport import (
    WIRE_ORDER,
    CacheGroupsReport,
    ExpertsReport,
    HybridReport,
    LayoutSchemaError,
    LinearReport,
    MLAReport,
    ParamShard,
    ProbeLayer,
    RankReport,
    SparseReport,
    SpeculatorReport,
    StoredPositions,
    entry_json,
    read_ranks,
    read_speculator,
)
from harness.report.details import _LAYOUT_FIRST
from tests.report_fixtures import cell

DATA = Path(__file__).parent / "data"


def full_report(rank: int = 1) -> RankReport:
    """A rank report with every optional record filled."""
    return RankReport(
        rank=rank, q_heads=(2, 3), kv_heads=(1,), dcp_group=0, dcp_rank=1, dcp_members=(0, 1), kv_tp_rank=0,
        q_to_kv=(1, 1), group_q_heads=(0, 1, 2, 3), group_q_to_kv=(0, 0, 1, 1), kv_pool_bytes=4096,
        kv_pool_blocks=16, kv_weight_checksums={"1": "abc"}, v_heads=(1,), ffn_shard=(8, 16), vocab_shard=(96, 192),
        kv_block_size=16, kv_bytes_per_token=64, stored_positions=StoredPositions(9, 3, (1, 3, 5, 7)),
        experts=ExpertsReport(experts=(2, 3), expert_ffn_shard=(0, 32), expert_columns=32, shared_columns=16,
                              router_checksum="r", logical=(2, 3), slot_checksums=("s2", "s3")),
        hybrid=HybridReport(
            linear=LinearReport(v_heads=(2, 3), k_heads=(1,), out_v_heads=(3,), conv_rows=((4, 8), (12, 16), (30, 36)),
                                state_digests=("d0", "d1"), weight_checksum="w"),
            moe=ExpertsReport(experts=(2, 3), expert_ffn_shard=(0, 32), expert_columns=32, shared_columns=16,
                              router_checksum="r"),
            cache_groups=CacheGroupsReport(slots=4, attention_blocks=16, attention_blocks_per_seq=4, state_slots=4,
                                           state_bytes=1024, attention_bytes=4096)),
        mla=MLAReport(q_mode="replicated", q_weight_heads=(0, 1, 2, 3), q_weight_checksums={"0": "q0"},
                      latent_dim=40),
        sparse=SparseReport(index_heads=(1,), index_weight_checksums={"1": "i1"}, index_key_checksum="k",
                            cache_group_blocks={"kv": 16, "index_keys": 16}, block_size=16,
                            selected=(((0,), (0, 1)),), margins=((1.0, 0.25),)),
        layers=(ProbeLayer("model.layers.0.self_attn", (2, 3), (1,), None, (2, 3), (1,)),),
        layers_differing=("model.layers.0.self_attn",),
        params={"layers.0.o.weight": ParamShard(shape=(8, 16), slice=(((0, 8),), ((4, 8), (12, 16))), count=64,
                                                checksum="c", source="c", used_in=(0,))})


def test_every_record_round_trips_through_json() -> None:
    report = full_report()
    data = json.loads(json.dumps(report.to_json()))
    assert RankReport.from_json(data) == report
    mla = WIRE_ORDER.index("mla")  # its fields sit inline, where the record is
    assert list(data) == [*WIRE_ORDER[:mla], "q_mode", "q_weight_heads", "q_weight_checksums", "latent_dim",
                          *WIRE_ORDER[mla + 1:]]
    assert sorted(WIRE_ORDER) == sorted(f.name for f in fields(RankReport))
    assert data["hybrid"]["moe"]["expert_ffn_shard"] == [0, 32]
    assert data["params"]["layers.0.o.weight"]["slice"] == [[[0, 8]], [[4, 8], [12, 16]]]
    required = [f.name for f in fields(RankReport) if f.default is not None]
    plain = RankReport.from_json({k: data[k] for k in required})
    assert plain.mla is None and plain.hybrid is None and list(plain.to_json()) == [k for k in WIRE_ORDER
                                                                                   if k in required]
    hybrid_no_moe = RankReport.from_json({**data, "hybrid": {**data["hybrid"], "moe": None}})
    assert hybrid_no_moe.hybrid is not None and hybrid_no_moe.hybrid.moe is None


def test_the_speculator_entry_round_trips() -> None:
    entry = entry_json([full_report(1), full_report(0)], {"budget_bytes": 1024, "max_seq_len": 64, "block_size": 16},
                       SpeculatorReport(kind="draft", layers=2, slots=4))
    assert list(entry) == ["kind", "layers", "slots", "ranks", "pool"]
    assert [r.rank for r in read_ranks(entry)] == [0, 1]  # written in rank order
    assert read_speculator(entry) == SpeculatorReport(kind="draft", layers=2, slots=4)


def test_the_json_engines_write_reads_back_unchanged() -> None:
    """Schema 1 is the shape both engine families wrote before the schema existed: a committed embedded
    run (tp2dcp2, stored positions) and the real vLLM probe's report come back key for key, in order."""
    actual = cell("clean").details["layout"]["actual"]
    probed = probe_layout(DATA / "vllm" / "probe-tp2-kv-shard", 2)
    for entry in (actual, probed):
        reports = read_ranks(entry)
        assert [json.dumps(r.to_json()) for r in reports] == [json.dumps(r) for r in entry["ranks"]]
    assert read_ranks(probed)[1].layers is not None and read_ranks(actual)[0].stored_positions is not None


def _broken(change: Any) -> str:
    data = copy.deepcopy(full_report(rank=3).to_json())
    change(data)
    with pytest.raises(LayoutSchemaError) as err:
        read_ranks({"ranks": [full_report(rank=0).to_json(), data]}, "layout.json target")
    return str(err.value)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("q_to_kv"), "layout.json target rank 3: field 'q_to_kv' is missing"),
    (lambda d: d.update(kv_pool_bytes="4096"),
     "layout.json target rank 3: field 'kv_pool_bytes' is '4096' (str), expected an integer"),
    (lambda d: d.update(kv_pool_blocks=True),
     "layout.json target rank 3: field 'kv_pool_blocks' is True (bool), expected an integer"),
    (lambda d: d.update(q_heads=[2, "3"]), "layout.json target rank 3: field 'q_heads[1]' is '3' (str)"),
    (lambda d: d.update(ffn_shard=[8]), "layout.json target rank 3: field 'ffn_shard' has 1 values, expected 2"),
    (lambda d: d.update(kv_weight_checksums=["abc"]),
     "layout.json target rank 3: field 'kv_weight_checksums' is list, expected an object"),
    (lambda d: d.update(q_head=[2, 3]), "layout.json target rank 3: unknown field 'q_head'"),
    (lambda d: d.pop("latent_dim"), "layout.json target rank 3: field 'latent_dim' is missing"),
    (lambda d: d.update(mla={"q_mode": "split"}), "layout.json target rank 3: unknown field 'mla'"),
    (lambda d: d["hybrid"]["linear"].pop("weight_checksum"),
     "layout.json target rank 3: field 'hybrid.linear.weight_checksum' is missing"),
    (lambda d: d["hybrid"]["moe"].update(experts=None),
     "layout.json target rank 3: field 'hybrid.moe.experts' is null, expected a list"),
    (lambda d: d["stored_positions"].update(positions={"0": 1}),
     "layout.json target rank 3: field 'stored_positions.positions' is dict, expected a list"),
    (lambda d: d.update(rank="3"), "layout.json target ranks[1]: field 'rank' is '3' (str), expected an integer"),
])
def test_a_broken_field_is_one_error_naming_rank_and_field(change: Any, message: str) -> None:
    assert _broken(change).startswith(message)


def test_an_entry_without_ranks_or_with_a_non_object_rank_is_named() -> None:
    for entry in ({}, {"ranks": []}, {"ranks": "r"}, None):
        with pytest.raises(LayoutSchemaError, match="layout.json speculator has no 'ranks' list"):
            read_ranks(entry, "layout.json speculator")
    with pytest.raises(LayoutSchemaError, match=r"layout.json target ranks\[0\]: a rank report is list"):
        read_ranks({"ranks": [[0, 1]]}, "layout.json target")


def test_the_report_drill_down_names_rank_report_fields() -> None:
    """The drill-down's leading layout columns are fields of the schema (a renamed field cannot silently
    drop its column); q_to_local_kv is the planner's, shown when a plan has it."""
    assert set(_LAYOUT_FIRST) - {f.name for f in fields(RankReport)} == {"q_to_local_kv"}
