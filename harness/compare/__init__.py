"""Compare a parallel run with the reference: pure functions from run artifacts to verdicts."""

from harness.compare.cell import PARITY_CHECKS, compare_cell
from harness.compare.generation import check_generation
from harness.compare.layout_check import check_layout, check_layout_with_pool
from harness.compare.localize import localize
from harness.compare.logits import check_logits
from harness.compare.settings import (CheckSettings, GenerationSettings, LayoutSettings, LocalizationSettings,
                                      LogitsSettings)

__all__ = ["PARITY_CHECKS", "CheckSettings", "GenerationSettings", "LayoutSettings", "LocalizationSettings",
           "LogitsSettings", "check_generation", "check_layout", "check_layout_with_pool", "check_logits",
           "compare_cell", "localize"]
