"""A Hugging Face folder's tensors by file name, for the adapters: name-by-name translation with one error naming
the first tensor no canonical name stands for, and a whole file's shapes compared with what a spec calls for."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, TypeVar

import torch

from harness.core.errors import ConfigError
from harness.formats.hf.names import canonical_from_hf
from harness.formats.names import expected_shapes
from harness.specs.model import ModelSpec

Weights = dict[str, torch.Tensor]
Shape = tuple[int, ...]
IGNORED_HF_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
V = TypeVar("V")


def by_name(spec: ModelSpec, found: Mapping[str, V], where: Path, family: str,
            skip: Callable[[str], bool] = lambda key: False) -> dict[str, V]:
    """Each file tensor (or shape) under its canonical name; ignored tensors, a tied lm_head and `skip`ped ones
    (another module's, e.g. an MTP layer) left out; a tensor no canonical name stands for is a ConfigError."""
    out: dict[str, V] = {}
    for key, value in found.items():
        if key.endswith(IGNORED_HF_SUFFIXES) or (key == "lm_head.weight" and spec.tied_embeddings) or skip(key):
            continue
        name = canonical_from_hf(key)
        if name is None:
            raise ConfigError(f"{where}: tensor {key!r} is not part of a {family} model (unsupported architecture?)")
        out[name] = value
    return out


def whole_file_shapes(spec: ModelSpec, found: dict[str, Shape],
                      file_shapes: Callable[[ModelSpec, dict[str, Shape]], dict[str, Shape]],
                      path: Path) -> dict[str, Shape]:
    """A whole-file format's header shapes checked against the file form of the spec's shapes (one ConfigError
    naming the first missing, unknown or misshapen tensor); the canonical shapes they stand for."""
    expected = expected_shapes(spec)
    wanted = file_shapes(spec, expected)
    found = {k: v for k, v in found.items() if not k.endswith(IGNORED_HF_SUFFIXES)}
    if spec.tied_embeddings:
        found.pop("lm_head.weight", None)
    missing = sorted(set(wanted) - set(found))
    unknown = sorted(set(found) - set(wanted))
    wrong = sorted(k for k in set(wanted) & set(found) if wanted[k] != found[k])
    if missing:
        raise ConfigError(f"checkpoint {path}: missing tensor {missing[0]!r} ({len(missing)} missing in all) "
                          f"for model {spec.name!r}")
    if unknown:
        raise ConfigError(f"checkpoint {path}: unexpected tensor {unknown[0]!r} for model {spec.name!r}")
    if wrong:
        raise ConfigError(f"checkpoint {path}: tensor {wrong[0]!r} has shape {found[wrong[0]]}, model "
                          f"{spec.name!r} expects {wanted[wrong[0]]}")
    return expected
