"""config.json as the installed transformers (5.x) writes it, read by `harness plan`: Qwen3-Next gives its hybrid
pattern as `layer_types` only (no full_attention_interval) and its partial RoPE inside `rope_parameters`;
DeepSeek-V3 names no router (its own: sigmoid scores, group-limited top-k); DeepSeek-V3.2 gives its dense layers as
`mlp_layer_types` and adds the sparse-attention indexer. Each config is made by transformers' own config class and
save_pretrained, so these follow the transformers installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from harness.cli import main  # noqa: E402
from harness.cli.plan.command import plan_document  # noqa: E402
from harness.core.errors import ConfigError  # noqa: E402
from harness.formats.locate import load_model  # noqa: E402

SMALL_MLA: dict[str, Any] = dict(vocab_size=384, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                                 q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                                 topk_group=1, max_position_embeddings=1024)


def _written(tmp_path: Path, config: Any, edit: dict[str, Any] | None = None) -> Path:
    """`config` saved by transformers into a folder (config.json only; `edit`: keys then changed in the file)."""
    folder = tmp_path / config.model_type
    config.save_pretrained(folder)
    if edit:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    return folder


def _qwen3_next(**over: Any) -> Any:
    return transformers.Qwen3NextConfig(**{**dict(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, max_position_embeddings=1024), **over})


def test_qwen3_next_layer_types_give_the_hybrid_pattern(tmp_path: Path) -> None:
    folder = _written(tmp_path, _qwen3_next())
    config = json.loads((folder / "config.json").read_text())
    assert "full_attention_interval" not in config and config["layer_types"][3] == "full_attention"
    spec = load_model(str(folder))
    assert spec.hybrid is not None and spec.hybrid.full_attention_interval == 4
    doc = plan_document(spec, "tp2", None, None, 16)
    assert doc["hybrid"]["layer_kinds"] == ["linear", "linear", "linear", "full"] * 2
    # transformers 5.x keeps the partial RoPE factor in rope_parameters: still named as what the engine lacks
    assert "partial RoPE (partial_rotary_factor 0.25)" in doc["engine_gaps"]


def test_qwen3_next_whole_head_rope_in_rope_parameters_is_no_gap(tmp_path: Path) -> None:
    folder = _written(tmp_path, _qwen3_next(), {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                    "partial_rotary_factor": 1.0}})
    assert load_model(str(folder)).engine_gaps == ()


@pytest.mark.parametrize(("edit", "named"), [
    ({"layer_types": ["linear_attention", "full_attention"] * 2 + ["linear_attention"] * 4}, "layers [1, 3]"),
    ({"layer_types": ["full_attention"] * 7}, "lists 7 layers"),
    ({"layer_types": ["sliding_attention"] * 8}, "'sliding_attention'"),
    ({"full_attention_interval": 2}, "full_attention_interval 2 disagrees"),
])
def test_a_layer_pattern_the_hybrid_layout_cannot_take_is_one_error(tmp_path: Path, edit: dict[str, Any],
                                                                    named: str) -> None:
    folder = _written(tmp_path, _qwen3_next(), edit)
    with pytest.raises(ConfigError, match="config.json") as info:
        load_model(str(folder))
    assert named in str(info.value)


def test_harness_plan_reads_a_transformers_5_qwen3_next_folder(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", str(_written(tmp_path, _qwen3_next())), "--topo", "tp2"]) == 0
    assert "partial RoPE" in capsys.readouterr().out


def test_deepseek_v2_as_transformers_writes_it(tmp_path: Path) -> None:
    spec = load_model(str(_written(tmp_path, transformers.DeepseekV2Config(**SMALL_MLA, topk_method="greedy",
                                                                           first_k_dense_replace=1))))
    assert (spec.kv_lora_rank, spec.qk_rope_dim, spec.head_dim) == (512, 64, 64)
    assert spec.moe is not None and (spec.moe.experts, spec.moe.first_dense, spec.moe.shared_ffn) == (8, 1, 128)
    assert spec.engine_gaps == ()  # greedy softmax routing, plain RoPE: the embedded engine runs it


def test_deepseek_v3_without_a_router_named_is_its_own_router(tmp_path: Path) -> None:
    folder = _written(tmp_path, transformers.DeepseekV3Config(**SMALL_MLA, first_k_dense_replace=1,
                                                              routed_scaling_factor=1.0))
    config = json.loads((folder / "config.json").read_text())
    assert "scoring_func" not in config and "topk_method" not in config
    spec = load_model(str(folder))
    assert spec.nextn_layers == 1
    assert "scoring_func 'sigmoid'" in spec.engine_gaps and "topk_method 'noaux_tc' (expert groups)" in spec.engine_gaps


def test_deepseek_v32_dense_layers_and_indexer(tmp_path: Path) -> None:
    config = transformers.DeepseekV32Config(**{**SMALL_MLA, "q_lora_rank": 64}, first_k_dense_replace=2,
                                            index_topk=64, index_n_heads=4, index_head_dim=32)
    folder = _written(tmp_path, config)
    written = json.loads((folder / "config.json").read_text())
    assert written["mlp_layer_types"] == ["dense", "dense", "sparse", "sparse"]
    spec = load_model(str(folder))
    assert spec.moe is not None and spec.moe.first_dense == 2
    gap = next(g for g in spec.engine_gaps if "DeepSeek-V3.2" in g)
    assert "index_topk 64" in gap and "index_n_heads 4" in gap and "index_head_dim 32" in gap
    assert plan_document(spec, "tp2", None, None, 16)["mla"]["latent_dim"] == 576
    bad = _written(tmp_path / "bad", config, {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
    with pytest.raises(ConfigError, match="dense layer after an expert layer"):
        load_model(str(bad))
