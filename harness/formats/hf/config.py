"""Reading a Hugging Face folder's config.json: the file itself and the fields every architecture family shares
(RoPE in the transformers 4 and 5 forms, the working length, the chat template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core import jsonio
from harness.core.errors import ConfigError

DEFAULT_MAX_SEQ_LEN = 2048


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


def config_value(config: dict[str, Any], key: str, where: Path) -> Any:
    """config[key], or one ConfigError naming the folder and the missing key."""
    if config.get(key) is None:
        raise ConfigError(f"{where}/config.json: missing {key!r}")
    return config[key]


def rope_type(config: dict[str, Any]) -> str:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return str(params.get("rope_type", params.get("type", "default")))


def rope_theta(config: dict[str, Any]) -> float:
    """rope_theta from transformers 4 (top level) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def max_seq_len(config: dict[str, Any]) -> int:
    """The harness's working length: 2048, capped by the model's context and any sliding window."""
    limits = [DEFAULT_MAX_SEQ_LEN, config.get("max_position_embeddings"), config.get("sliding_window")]
    return min(int(v) for v in limits if v)


def has_chat_template(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    in_config = config.is_file() and bool(read_json(config).get("chat_template"))
    return in_config or (folder / "chat_template.jinja").is_file()
