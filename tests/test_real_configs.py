"""`harness plan` on real checkpoints' config.json (no weights): DeepSeek-V2-Lite (MLA + 64 routed experts, YaRN
RoPE) and Qwen3-Next-80B-A3B (Gated DeltaNet + gated attention + 512 experts, partial RoPE), from their public
configs in tests/data/configs/. Each is planned at any topology; what the checkpoint has that the embedded engine
does not implement is named, and the embedded engine refuses such a model with that reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import main
from harness.cli.plan.command import plan_document
from harness.core.errors import ConfigError
from harness.formats.locate import load_model
from harness.formats.weights import load_weights

CONFIGS = Path(__file__).parent / "data" / "configs"
DSV2_LITE = str(CONFIGS / "deepseek-v2-lite")
QWEN3_NEXT = str(CONFIGS / "qwen3-next-80b-a3b-instruct")


def test_deepseek_v2_lite_is_planned_as_mla_with_experts() -> None:
    spec = load_model(DSV2_LITE)
    assert (spec.heads, spec.kv_lora_rank, spec.qk_rope_dim, spec.qk_nope_dim, spec.head_dim) == (16, 512, 64, 128, 128)
    assert spec.moe is not None and (spec.moe.experts, spec.moe.top_k, spec.moe.moe_ffn, spec.moe.shared_ffn,
                                     spec.moe.first_dense) == (64, 6, 1408, 2816, 1)
    doc = plan_document(spec, "tp4dcp4", None, None, 16)
    assert doc["mla"]["latent_dim"] == 576 and doc["kv_bytes_per_token_per_rank"] == 27 * 576 * 4
    assert [r["q_heads"] for r in doc["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert doc["moe"]["ep"] == 1 and doc["moe"]["ranks"][1]["expert_ffn_shard"] == [352, 704]
    ep = plan_document(spec, "tp4ep4", None, None, 16)["moe"]
    assert [r["experts"][0] for r in ep["ranks"]] == [0, 16, 32, 48] and ep["ranks"][0]["expert_ffn_shard"] == [0, 1408]
    assert doc["engine_gaps"] == ["yarn RoPE scaling"]


def test_qwen3_next_is_planned_as_a_hybrid_with_experts() -> None:
    spec = load_model(QWEN3_NEXT)
    assert spec.hybrid is not None and (spec.hybrid.linear_k_heads, spec.hybrid.linear_v_heads,
                                        spec.hybrid.experts, spec.hybrid.top_k) == (16, 32, 512, 10)
    doc = plan_document(spec, "tp4dcp4", None, None, 16)
    hybrid = doc["hybrid"]
    assert hybrid["layer_kinds"].count("full") == 12 and hybrid["moe"]["experts"] == 512
    assert [r["kv_heads"] for r in doc["ranks"]] == [[0, 1]] * 4  # kv_tp_size 1 under dcp4: every rank holds both
    assert "partial RoPE (partial_rotary_factor 0.25)" in doc["engine_gaps"]


@pytest.mark.parametrize("folder, why", [(DSV2_LITE, "yarn RoPE scaling"),
                                         (QWEN3_NEXT, "partial RoPE")])
def test_the_embedded_engine_refuses_what_it_does_not_implement(folder: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        load_weights(load_model(folder))


def test_harness_plan_prints_a_real_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", DSV2_LITE, "--topo", "tp4dcp4"]) == 0
    out = capsys.readouterr().out
    assert "MLA: latent row 576 = kv_lora_rank 512 + qk_rope_dim 64" in out and "MoE: 64 experts, top-6" in out
    assert "not run by the embedded engine (served by vllm / sglang): yarn RoPE scaling" in out
