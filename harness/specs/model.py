"""ModelSpec: the architecture numbers of one decoder model and where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.core.paths import MODELS_DIR
from harness.partition.hybrid_layout import HybridShape, MoeShape
from harness.partition.layout import AttentionShape
from harness.partition.mla_layout import MLAShape
from harness.partition.sparse_layout import SparseShape
from harness.specs.loader import build, check_path_name, did_you_mean, expect_int, expect_mapping

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
SOURCES: tuple[str, ...] = ("synthetic", "hf", "gguf", "package")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama/Qwen-style decoder. `source` says where weights come from:
    synthetic (seeded init), hf (checkpoint folder), gguf (file), package (a pip package shipping a GGUF)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    layers: int
    ffn: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tied_embeddings: bool = False
    qkv_bias: bool = False
    dtype: str = "float32"
    source: str = "synthetic"
    seed: int = 0
    init_std: float = 0.08
    path: str = ""
    package: str = ""
    max_seq_len: int = 2048
    chat_template: bool = False
    speculator_layers: int = 1
    # MTP layers the checkpoint holds (DeepSeek-V3's num_nextn_predict_layers; 0: none). An MLA model with
    # nextn_layers 1 is exported as DeepSeek-V3 with its MTP layer (model.layers.{layers}.*: the embedded engine's
    # MTP speculator), and a DeepSeek-V3 folder's MTP layer is what the embedded engine's -mtp speculator runs
    nextn_layers: int = 0
    hybrid: HybridShape | None = None  # linear attention, gated attention, MoE (harness/partition/hybrid_layout.py)
    moe: MoeShape | None = None  # experts of an MLA model (DeepSeek-V2/V3); a hybrid model's are in `hybrid`
    # what the checkpoint has that the embedded engine does not implement (e.g. YaRN RoPE): such a model is planned
    # (`harness plan`) and served by an HTTP engine, and the embedded engine refuses it naming these
    engine_gaps: tuple[str, ...] = ()
    # MLA (multi-head latent attention, DeepSeek-V2 style; kv_lora_rank > 0): head_dim is then the
    # value head width, kv_heads is 1 (the shared latent), q_lora_rank 0 means q_proj reads the hidden state
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    sparse: SparseShape | None = None  # sparse attention with a lightning indexer (harness/partition/sparse_layout.py)

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        check_path_name(where, "name", self.name)  # names run folders and cache entries
        for name in ("heads", "kv_heads", "head_dim", "hidden", "layers", "ffn", "vocab", "max_seq_len"):
            expect_int(where, name, getattr(self, name), minimum=1)
        for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_dim", "qk_nope_dim", "nextn_layers"):
            expect_int(where, name, getattr(self, name), minimum=0)
        if self.mla:
            self._check_mla(where)
        if self.heads % self.kv_heads:
            raise ConfigError(f"{where}: heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in DTYPES:
            raise ConfigError(f"{where}: dtype={self.dtype!r} is not one of {', '.join(DTYPES)}"
                              f"{did_you_mean(self.dtype, DTYPES)}")
        if self.source not in SOURCES:
            raise ConfigError(f"{where}: source={self.source!r} is not one of {', '.join(SOURCES)}"
                              f"{did_you_mean(self.source, SOURCES)}")
        if self.source in ("hf", "gguf") and not self.path:
            raise ConfigError(f"{where}: source={self.source} needs a path")
        if self.source == "package" and not self.package:
            raise ConfigError(f"{where}: source=package needs a package name")
        if self.hybrid is not None and not isinstance(self.hybrid, HybridShape):
            raise ConfigError(f"{where}: hybrid must be a mapping of {', '.join(HybridShape.__dataclass_fields__)}, "
                              f"got {self.hybrid!r}")
        if self.moe is not None and not (isinstance(self.moe, MoeShape) and self.kv_lora_rank > 0):
            raise ConfigError(f"{where}: moe (experts of an MLA model) needs kv_lora_rank > 0 and a mapping of "
                              f"{', '.join(MoeShape.__dataclass_fields__)}, got {self.moe!r}; a hybrid model's "
                              f"experts go under hybrid")
        if self.hybrid is not None and self.qkv_bias:
            raise ConfigError(f"{where}: qkv_bias=true is not supported with hybrid (gated attention has no biases)")
        if self.sparse is not None and not isinstance(self.sparse, SparseShape):
            raise ConfigError(f"{where}: sparse must be a mapping of {', '.join(SparseShape.__dataclass_fields__)}, "
                              f"got {self.sparse!r}")
        if self.sparse is not None and (self.hybrid is not None or self.mla or self.source != "synthetic"):
            raise ConfigError(f"{where}: sparse attention runs on a synthetic dense/GQA model only (got hybrid="
                              f"{self.hybrid is not None}, kv_lora_rank={self.kv_lora_rank}, source={self.source})")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError(f"{where}: rope_theta={self.rope_theta} and norm_eps={self.norm_eps} must be > 0")

    def _check_mla(self, where: str) -> None:
        if self.kv_heads != 1:
            raise ConfigError(f"{where}: an MLA model (kv_lora_rank={self.kv_lora_rank}) shares one latent per "
                              f"token: kv_heads={self.kv_heads} must be 1")
        if self.qk_rope_dim < 2 or self.qk_rope_dim % 2 or self.qk_nope_dim < 1:
            raise ConfigError(f"{where}: MLA needs an even qk_rope_dim >= 2 and qk_nope_dim >= 1, got "
                              f"qk_rope_dim={self.qk_rope_dim}, qk_nope_dim={self.qk_nope_dim}")
        if self.source not in ("synthetic", "hf") or self.qkv_bias:
            raise ConfigError(f"{where}: MLA models are synthetic or DeepSeek-V2 Hugging Face folders, without "
                              f"qkv_bias, in the embedded engine (got source={self.source}, qkv_bias={self.qkv_bias})")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def mla_shape(self) -> MLAShape:
        return MLAShape(q_lora_rank=self.q_lora_rank, qk_nope_dim=self.qk_nope_dim, hidden=self.hidden)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def attention_shape(self) -> AttentionShape:
        return AttentionShape(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                              layers=self.layers, dtype_bytes=self.dtype_bytes, ffn=self.ffn,
                              vocab=self.vocab, kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim)

    @property
    def speculator_shape(self) -> AttentionShape:
        """The draft / MTP module: the target's head layout with `speculator_layers` layers (an MLA target's:
        latent attention, as DeepSeek-V3's MTP layer)."""
        return replace(self.attention_shape, layers=self.speculator_layers)

    def with_dtype(self, dtype: str) -> "ModelSpec":
        return replace(self, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("hybrid", "sparse", "moe", "engine_gaps", "nextn_layers")}
        if self.hybrid is not None:  # dense models keep their dict (and their cache keys) unchanged
            out["hybrid"] = self.hybrid.to_dict()
        if self.sparse is not None:
            out["sparse"] = self.sparse.to_dict()
        if self.moe is not None:
            out["moe"] = self.moe.to_dict()
        if self.engine_gaps:
            out["engine_gaps"] = list(self.engine_gaps)
        if self.nextn_layers:  # a model without MTP layers keeps its dict (and cache keys)
            out["nextn_layers"] = self.nextn_layers
        return out


def model_from_dict(where: str, data: dict[str, Any], name: str = "") -> ModelSpec:
    data = dict(expect_mapping(where, data))
    if name and "name" not in data:
        data["name"] = name
    if isinstance(data.get("hybrid"), dict):
        data["hybrid"] = build(HybridShape, f"{where}: hybrid", data["hybrid"])
    if isinstance(data.get("sparse"), dict):
        data["sparse"] = build(SparseShape, f"{where}: sparse", data["sparse"])
    if isinstance(data.get("moe"), dict):
        data["moe"] = build(MoeShape, f"{where}: moe", data["moe"])
    if isinstance(data.get("engine_gaps"), list):
        data["engine_gaps"] = tuple(str(g) for g in data["engine_gaps"])
    return build(ModelSpec, where, data)


def shipped_models(folder: Path = MODELS_DIR) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}
