"""MLA models exported as DeepSeek-V2 (DeepseekV2ForCausalLM, DeepSeek's tensor names, interleaved RoPE rows): the
folder loads in transformers with the embedded engine's logits, and loads back into the embedded engine (the
same canonical weights), so an external engine and `--reference-engine embedded` run identical weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.formats.hf.deepseek import interleave_order
from harness.formats.locate import load_model
from harness.formats.weights import load_weights, weights_hash

IDS = [list(b"The capital of France is"), list(b"def f(x):\n    return x * 2")]


@pytest.fixture(scope="module", params=["tiny-mla", "tiny-dsv2"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("export") / request.param
    assert main(["export", "--model", request.param, "--out", str(out)]) == 0
    return request.param, out


def test_mla_export_is_a_deepseek_v2_folder_that_loads_back(exported: tuple[str, Path]) -> None:
    name, folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    original, loaded = load_model(name), load_model(str(folder))
    for field in ("heads", "head_dim", "hidden", "layers", "ffn", "vocab", "kv_lora_rank", "q_lora_rank",
                  "qk_rope_dim", "qk_nope_dim", "kv_heads"):
        assert getattr(loaded, field) == getattr(original, field), field
    assert loaded.source == "hf" and loaded.mla
    assert weights_hash(load_weights(loaded)) == weights_hash(load_weights(original))


def test_the_file_holds_deepseek_s_interleaved_rope_rows(exported: tuple[str, Path]) -> None:
    """kv_a's k_pe rows in the file are the canonical (rotate-halves) rows in pair order (i, i + rope/2) -> (2i,
    2i+1), the nope and latent rows untouched."""
    from safetensors.torch import load_file

    name, folder = exported
    spec = load_model(name)
    canonical = load_weights(spec)["layers.0.kv_a.weight"]
    written = load_file(str(folder / "model.safetensors"))["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    lora = spec.kv_lora_rank
    assert torch.equal(written[:lora], canonical[:lora])
    assert torch.equal(written[lora:], canonical[lora:][interleave_order(spec.qk_rope_dim)])
    assert not torch.equal(written[lora:], canonical[lora:])


def test_transformers_deepseek_v2_matches_the_embedded_engine(exported: tuple[str, Path]) -> None:
    """transformers' own DeepseekV2ForCausalLM on the folder gives the embedded engine's logits (RoPE, latent
    norm, absorbed attention and scale agree); the rows written in the halves order would not (positive control:
    scores of positions > 0 change)."""
    from transformers import AutoModelForCausalLM

    name, folder = exported
    spec = load_model(name)
    engine = Engine(spec, load_weights(spec), ParallelState.single())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for ids in IDS:
        ours = engine.prefill_logits([ids])[0]  # [T, V]
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]  # [T, V]
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        torch.testing.assert_close(theirs, ours, atol=5e-5, rtol=1e-5)
    with torch.no_grad():  # the same file read with the rope rows in the halves order: the logits move
        for module in model.modules():
            if hasattr(module, "kv_a_proj_with_mqa"):
                w = module.kv_a_proj_with_mqa.weight
                lora = spec.kv_lora_rank
                w[lora:] = w[lora:][torch.argsort(interleave_order(spec.qk_rope_dim))]
        moved = model(torch.tensor([IDS[0]])).logits[0]
    assert (moved[1:] - engine.prefill_logits([IDS[0]])[0][1:]).abs().max() > 1e-3
