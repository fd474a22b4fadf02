"""Hybrid models exported as Qwen3-Next (Qwen3NextForCausalLM: packed in_proj_qkvz / in_proj_ba, per-expert
tensors, (1 + w) norms, a zero shared_expert_gate): the folder loads back into the embedded engine with the same
weights, and transformers' own Qwen3Next on it gives the embedded engine's logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.core.errors import ConfigError
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.formats.export import export_model
from harness.formats.locate import load_model
from harness.formats.weights import load_weights, validate_checkpoint

IDS = [list(b"The capital of France is"), list(b"def f(x):\n    return x * 2")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny-qwen3next"
    assert main(["export", "--model", "tiny-qwen3next", "--out", str(out)]) == 0
    return out


def test_the_export_is_a_qwen3_next_folder_that_loads_back_with_the_same_weights(exported: Path) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["model_type"] == "qwen3_next"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["partial_rotary_factor"] == 1.0 and config["torch_dtype"] == "bfloat16"
    original, loaded = load_model("tiny-qwen3next"), load_model(str(exported))
    assert loaded.source == "hf" and loaded.hybrid == original.hybrid and loaded.dtype == "bfloat16"
    assert loaded.engine_gaps == ()
    validate_checkpoint(loaded)
    ours, theirs = load_weights(original), load_weights(loaded)
    assert set(ours) == set(theirs)
    for name in ours:  # the file holds the model's bfloat16 values exactly (norm offsets and the x2 included)
        assert torch.equal(ours[name].to(torch.bfloat16), theirs[name].to(torch.bfloat16)), name


def test_the_file_holds_qwen3_next_s_forms(exported: Path) -> None:
    """Norms as w - 1, the shared expert gate zero with its down projection doubled, q|k|v|z packed per K head."""
    from safetensors.torch import load_file

    spec = load_model("tiny-qwen3next")
    w = {k: v.to(torch.bfloat16) for k, v in load_weights(spec).items()}
    f = load_file(str(exported / "model.safetensors"))
    layer = "model.layers.0."
    assert torch.equal(f[layer + "input_layernorm.weight"].float() + 1, w["layers.0.attn_norm.weight"].float())
    assert torch.equal(f["model.layers.3.self_attn.q_norm.weight"].float() + 1, w["layers.3.q_norm.weight"].float())
    assert torch.equal(f[layer + "linear_attn.norm.weight"], w["layers.0.lin_norm.weight"])  # the gated norm: w
    assert not torch.count_nonzero(f[layer + "mlp.shared_expert_gate.weight"])
    assert torch.equal(f[layer + "mlp.shared_expert.down_proj.weight"], w["layers.0.shared.down.weight"] * 2)
    h, dk = spec.hybrid, 128
    assert h is not None
    qkvz = f[layer + "linear_attn.in_proj_qkvz.weight"].view(h.linear_k_heads, -1, spec.hidden)
    assert torch.equal(qkvz[1, :dk], w["layers.0.lin_qkv.weight"][dk:2 * dk])  # K head 1's q rows
    assert torch.equal(f[layer + "linear_attn.conv1d.weight"][:, 0], w["layers.0.lin_conv.weight"])


def test_transformers_qwen3_next_matches_the_embedded_engine(exported: Path) -> None:
    """transformers' Qwen3NextForCausalLM on the folder gives the embedded engine's logits (both in float32 over
    the file's bfloat16 values: norms, gating, conv, head grouping and the shared expert agree); in_proj_qkvz read
    in the canonical flat q|k|v|z order instead of per K head moves them (positive control)."""
    from transformers import AutoModelForCausalLM

    spec = dataclasses.replace(load_model(str(exported)), dtype="float32")
    engine = Engine(spec, load_weights(spec), ParallelState.single())
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    for ids in IDS:
        ours = engine.prefill_logits([ids])[0]  # [T, V]
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0]  # [T, V]
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        torch.testing.assert_close(theirs, ours, atol=2e-4, rtol=1e-5)
    h = spec.hybrid
    assert h is not None
    with torch.no_grad():
        w = model.model.layers[0].linear_attn.in_proj_qkvz.weight
        per_head = w.view(h.linear_k_heads, -1, spec.hidden)  # [nk, 2 dk + 2 r dv, H]
        w.copy_(per_head.transpose(0, 1).reshape(-1, spec.hidden))  # K heads' rows interleaved: the wrong order
        moved = model(torch.tensor([IDS[0]])).logits[0]
    assert (moved - engine.prefill_logits([IDS[0]])[0]).abs().max() > 1e-2


def test_a_nonzero_shared_expert_gate_is_refused_naming_the_tensor(exported: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gated"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((exported / name).read_bytes())
    tensors = load_file(str(exported / "model.safetensors"))
    tensors["model.layers.2.mlp.shared_expert_gate.weight"][0, 5] = 0.25
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.layers\.2\.mlp\.shared_expert_gate\.weight is nonzero"):
        load_weights(load_model(str(folder)))


def test_a_hybrid_model_without_qwen3_next_s_function_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    """tiny-hybrid has no q_norm/k_norm: written as Qwen3-Next it would be another function."""
    with pytest.raises(ConfigError, match=r"q_norm/k_norm \(qk_norm: true\)"):
        export_model(load_model("tiny-hybrid"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
