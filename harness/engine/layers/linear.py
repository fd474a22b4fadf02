"""x @ w.T against a weight fixed for the engine's life: through oneDNN with the weight packed once into its
blocked layout where that is faster, through torch's matmul (MKL on the CPU) elsewhere.

Where: a float32 CPU weight w [N, K] times x of R rows, when R x N x K >= PACK_WORK (a prefill's many rows),
or R >= 2 and N x K >= PACK_MIN (a decode step's few rows on a large weight), or N x K >= PACK_ONE_ROW_MIN.
Below that a oneDNN call's fixed cost (~20 us) outweighs its arithmetic. Measured on the 2-core AVX-512
box (docs/benchmarks.md, "Engine against transformers"): smollm2-135m's projections 1.3-1.6x faster at
prefill sizes, its 49152-row output head 2x at one row and 5x at three (MKL takes 2-3 rows as separate
matrix-vector products). The kernels sum in other orders, so results differ from torch's matmul by
rounding; every run of a build uses the same rule.
"""

from __future__ import annotations

import torch

PACK_WORK = 1 << 24  # rows x weight elements from which a packed oneDNN matmul beats torch's on any weight
PACK_MIN = 1 << 18  # weight elements from which it does for 2+ rows
PACK_ONE_ROW_MIN = 1 << 20  # ... and for a single row
PACK_ROWS_HINT = 1024  # the row count oneDNN tunes the packed layout for (it serves any)


def _packable(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() > 0 and torch.backends.mkldnn.is_available())


class Linear:
    """A fixed weight w [N, K] and, where packable, its oneDNN packed copy; calling it on x [..., K] gives
    x @ w.T [..., N]."""

    __slots__ = ("weight", "packed")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if _packable(weight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or not self.packs(x.numel() // max(1, x.shape[-1])):
            return x @ self.weight.T
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def packs(self, rows: int) -> bool:
        """Whether `rows` rows go through the packed weight (the rule above)."""
        n = self.weight.numel()
        return rows * n >= PACK_WORK or (rows > 1 and n >= PACK_MIN) or n >= PACK_ONE_ROW_MIN
