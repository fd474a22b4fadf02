"""An MLA + MoE model (tiny-dsv2-moe: DeepSeek-V2's latent attention, layer 0 dense, layer 1 four routed experts
top-2 plus a shared expert) exported as DeepseekV2ForCausalLM: the config names the experts as DeepSeek does, the
file holds one tensor per expert under DeepSeek's names, transformers' DeepseekV2 on the folder gives the embedded
engine's logits, and the embedded engine loads the folder back to the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.cli import main
from harness.core.errors import ConfigError
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.formats.hf.deepseek import stack_experts, unstack_experts
from harness.formats.locate import load_model
from harness.formats.weights import checkpoint_shapes, load_weights, weights_hash

MODEL = "tiny-dsv2-moe"
IDS = [list(b"The capital of France is"), list(b"def f(x):\n    return x * 2")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / MODEL
    assert main(["export", "--model", MODEL, "--out", str(out)]) == 0
    return out


def test_the_config_names_deepseek_s_experts(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert {k: config[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                   "n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "topk_method",
                                   "scoring_func", "routed_scaling_factor")} == {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": False, "topk_method": "greedy", "scoring_func": "softmax",
        "routed_scaling_factor": 1.0}


def test_the_file_holds_one_tensor_per_expert_under_deepseek_s_names(folder: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert list(f.get_slice("model.layers.1.mlp.experts.3.down_proj.weight").get_shape()) == [256, 128]
    experts = {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")}
    assert experts <= names
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith("model.layers.0.mlp.experts") or n.startswith("model.layers.1.mlp.gate_proj")
                   for n in names)
    assert checkpoint_shapes(load_model(str(folder)), folder)["layers.1.experts.gate.weight"] == (4, 128, 256)


def test_the_embedded_engine_loads_the_folder_back(folder: Path) -> None:
    original, loaded = load_model(MODEL), load_model(str(folder))
    assert loaded.moe == original.moe and loaded.source == "hf" and not loaded.engine_gaps
    assert weights_hash(load_weights(loaded)) == weights_hash(load_weights(original))


def test_transformers_deepseek_v2_matches_the_embedded_engine(folder: Path) -> None:
    """Routing (softmax over all experts, top-2, not renormalized), the shared expert and the dense first layer
    agree with transformers; with two experts' weights swapped in transformers (positive control) they do not."""
    from transformers import AutoModelForCausalLM

    spec = load_model(MODEL)
    engine = Engine(spec, load_weights(spec), ParallelState.single())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = [engine.prefill_logits([ids])[0] for ids in IDS]  # each [T, V]
    with torch.no_grad():
        for ids, mine in zip(IDS, ours):
            theirs = model(torch.tensor([ids])).logits[0]  # [T, V]
            assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
            torch.testing.assert_close(theirs, mine, atol=5e-5, rtol=1e-5)
        experts = model.model.layers[1].mlp.experts
        for p in experts.parameters():
            p[[0, 1]] = p[[1, 0]]
        moved = model(torch.tensor([IDS[0]])).logits[0]
    assert (moved - ours[0]).abs().max() > 1e-3


def test_per_expert_tensors_stack_back_and_a_missing_expert_is_named() -> None:
    stacked = {"layers.1.experts.gate.weight": torch.arange(24.0).view(3, 2, 4), "norm.weight": torch.ones(4)}
    apart = unstack_experts(stacked)
    assert sorted(apart) == ["layers.1.experts.0.gate.weight", "layers.1.experts.1.gate.weight",
                             "layers.1.experts.2.gate.weight", "norm.weight"]
    back = stack_experts(apart)
    assert sorted(back) == sorted(stacked) and all(torch.equal(back[k], stacked[k]) for k in stacked)
    del apart["layers.1.experts.1.gate.weight"]
    with pytest.raises(ConfigError, match=r"layers.1.experts.gate.weight: the checkpoint holds experts \[0, 2\], "
                                          r"missing \[1\]"):
        stack_experts(apart)
