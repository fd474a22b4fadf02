"""An MLA model's MTP layer exported in DeepSeek-V3's format (tiny-dsv3-mtp): the folder holds the MTP layer as
model.layers.{L}.* with DeepSeek's names and config num_nextn_predict_layers, the embedded engine's -mtp speculator
loads it back from the folder and proposes the same drafts with the same logits as the in-memory model; a
perturbed MTP tensor in the folder changes them (positive control)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.core.errors import ConfigError
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import run_speculative_cases
from harness.engine.speculative.decoding import SpecResult
from harness.engine.speculative.speculator import SpeculativeSettings, speculator_for
from harness.formats.export import export_model
from harness.formats.hf.spec import spec_from_hf
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.specs.model import ModelSpec
from harness.specs.pool import PoolSettings

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Q: 17 + 25 = ?\nA:", "Layout bugs hide in decode"]
POOL = PoolSettings(budget_bytes=16 << 20, max_seq_len=128)
MTP_TENSORS = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
               "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_proj.weight",
               "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_model(load_model("tiny-dsv3-mtp"), tmp_path_factory.mktemp("dsv3") / "tiny-dsv3-mtp")


def _mtp(spec: ModelSpec, k: int = 3) -> tuple[SpecResult, list[torch.Tensor]]:
    """Speculative greedy decoding with the -mtp speculator, and its logits over each prompt (catch-up entries)."""
    weights = load_weights(spec)
    target = Engine(spec, weights, ParallelState.single(), pool=POOL, speculator="mtp")
    prompts = [load_tokenizer(spec).encode(p) for p in PROMPTS]
    speculator = speculator_for(target, "mtp", weights, SpeculativeSettings(k=k))
    result = run_speculative_cases(target, speculator, prompts, k, 12)
    logits = []
    for p in prompts:  # the MTP's logits over the prompt, fed the target's hidden states
        t_id, s_id = target.open_sequences(1)[0], speculator.open_sequences(1)[0]
        _, hidden = target.extend([t_id], [p], [0])
        out, _ = speculator.extend([s_id], [p[1:]], [1], speculator.target_hidden(hidden[:, :-1]))
        logits.append(out[0])
        target.close_sequences([t_id])
        speculator.close_sequences([s_id])
    return result, logits


def test_the_folder_is_deepseek_v3_with_its_mtp_layer(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 1
    assert config["first_k_dense_replace"] == 2  # the MTP layer has a dense MLP too (vLLM builds it from this)
    names = set(load_file(str(folder / "model.safetensors")))
    assert {n.removeprefix("model.layers.1.") for n in names if n.startswith("model.layers.1.")} == MTP_TENSORS
    spec = spec_from_hf(folder)
    assert (spec.nextn_layers, spec.layers, spec.source) == (1, 1, "hf")
    assert set(load_weights(spec)) == set(load_weights(load_model("tiny-dsv3-mtp")))  # the target skips layer 1


def test_the_loaded_mtp_layer_drafts_as_the_in_memory_one(folder: Path, tmp_path: Path) -> None:
    memory, memory_logits = _mtp(load_model("tiny-dsv3-mtp"))
    loaded, loaded_logits = _mtp(spec_from_hf(folder))
    assert loaded.drafts == memory.drafts and loaded.accepted == memory.accepted
    assert loaded.mean_accepted_length == memory.mean_accepted_length > 1.5  # the MTP agrees with its target
    for a, b in zip(memory_logits, loaded_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # positive control: eh_proj's two halves swapped in the file (the module then reads the embedding as the hidden
    # state) changes the drafts and the logits, and the target's output stays
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    eh = tensors["model.layers.1.eh_proj.weight"]
    tensors["model.layers.1.eh_proj.weight"] = torch.cat([eh[:, 256:], eh[:, :256]], dim=1).contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    swapped, swapped_logits = _mtp(spec_from_hf(broken))
    assert swapped.drafts != memory.drafts and swapped.tokens == memory.tokens
    assert max(float((a - b).abs().max()) for a, b in zip(memory_logits, swapped_logits)) > 1.0


def test_a_missing_mtp_tensor_is_one_error_naming_it(folder: Path, tmp_path: Path) -> None:
    broken = tmp_path / "missing"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.hnorm.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    spec = spec_from_hf(broken)
    target = Engine(spec, load_weights(spec), ParallelState.single(), pool=POOL, speculator="mtp")
    with pytest.raises(ConfigError, match=r"has no model\.layers\.1\.hnorm\.weight"):
        speculator_for(target, "mtp", load_weights(spec), SpeculativeSettings())
