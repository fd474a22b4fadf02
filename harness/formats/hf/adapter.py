"""One adapter per Hugging Face architecture family: what its config.json says about a model (read) and what it
says for one (write), and its weights in both directions (canonical names and layout <-> the file's names, shapes
and layout). The registry finds a folder's adapter by its config's model_type and a spec's by the engine module of
its attention component (harness/arch/components.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from harness.specs.model import ModelSpec

Weights = dict[str, torch.Tensor]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class HFAdapter:
    """A Hugging Face architecture family (e.g. Llama, Qwen2 and Mistral, which share one layout)."""

    family: str
    model_types: tuple[str, ...]
    engine_module: str  # the embedded engine module of the attention component of its models
    # config.json -> the ModelSpec fields this family sets (attention and its own parts)
    spec_fields: Callable[[dict[str, Any], Path], dict[str, Any]]
    # config.json -> what the checkpoint holds that the embedded engine does not implement (read into the spec as
    # engine_gaps, planned and served by HTTP engines); None: such a checkpoint is refused instead
    engine_gaps: Callable[[dict[str, Any]], tuple[str, ...]] | None
    config: Callable[[ModelSpec], dict[str, Any]]  # a spec -> its config.json (harness export)
    to_file: Callable[[ModelSpec, Weights], Weights]  # canonical weights -> the file's tensors by file name
    from_file: Callable[[ModelSpec, Weights, Path], Weights]  # the file's tensors -> canonical float32, checked
    # the file's header shapes by file name -> canonical shapes (checked against the spec before any rank starts)
    canonical_shapes: Callable[[ModelSpec, dict[str, Shape], Path], dict[str, Shape]]
