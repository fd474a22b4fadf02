"""Compare a parallel run with the reference: pure functions from run artifacts to verdicts.

The names below are imported on first use (PEP 562), so importing one light submodule (e.g.
harness.compare.settings, which the CLI's baseline command needs) does not import torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"PARITY_CHECKS": "cell", "compare_cell": "cell", "check_generation": "generation",
          "check_layout": "layout_check", "check_layout_with_pool": "layout_check", "localize": "localize",
          "check_logits": "logits", "CheckSettings": "settings", "GenerationSettings": "settings",
          "LayoutSettings": "settings", "LocalizationSettings": "settings", "LogitsSettings": "settings"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'harness.compare' has no attribute {name!r}")
    return getattr(importlib.import_module(f"harness.compare.{_WHERE[name]}"), name)
