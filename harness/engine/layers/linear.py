"""x @ w.T against a weight fixed for the engine's life: through oneDNN with the weight packed once into its
blocked layout where that is faster, through torch's matmul (MKL on the CPU) elsewhere.

Where: a float32 CPU weight w [N, K] times x of R rows, when R x N x K >= PACK_WORK (a prefill's many rows),
or R >= 2 and N x K >= PACK_MIN (a decode step's few rows on a large weight), or N x K >= PACK_ONE_ROW_MIN.
Below that a oneDNN call's fixed cost (~20 us) outweighs its arithmetic. Measured on the 2-core AVX-512
box (docs/benchmarks.md, "Engine against transformers"): smollm2-135m's projections 1.3-1.6x faster at
prefill sizes, its 49152-row output head 2x at one row and 5x at three (MKL takes 2-3 rows as separate
matrix-vector products). The kernels sum in other orders, so results differ from torch's matmul by
rounding; every run of a build uses the same rule.

A float16 or bfloat16 weight on the CPU is multiplied as a GPU's half-precision GEMM does it: the operands
widened to float32 (exactly), the products summed in float32 and the result rounded once to the dtype
(`matmul_t`; a Linear keeps the widened weight). torch's own half-precision CPU kernels agree with that to
a last-place rounding in 0.07-0.2% of the elements (float16; 0-0.01% bfloat16) and take 2-13x longer at 8 rows or
more on the tiny models' shapes (0.5x at one row; `python benchmarks/bench_half_matmul.py`).
"""

from __future__ import annotations

import torch

PACK_WORK = 1 << 24  # rows x weight elements from which a packed oneDNN matmul beats torch's on any weight
PACK_MIN = 1 << 18  # weight elements from which it does for 2+ rows
PACK_ONE_ROW_MIN = 1 << 20  # ... and for a single row
PACK_ROWS_HINT = 1024  # the row count oneDNN tunes the packed layout for (it serves any)
HALF = (torch.float16, torch.bfloat16)  # multiplied through float32 on the CPU (above)


def _widened(t: torch.Tensor) -> bool:
    return t.dtype in HALF and t.device.type == "cpu"


def matmul_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w.T [K, N] -> [..., N] in x's dtype; half precision on the CPU summed in float32 and
    rounded once (above)."""
    if _widened(x) and _widened(w):
        return (x.float() @ w.float().T).to(x.dtype)
    return x @ w.T


def _packable(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.numel() > 0 and torch.backends.mkldnn.is_available())


class Linear:
    """A fixed weight w [N, K] and, where packable, its oneDNN packed copy; calling it on x [..., K] gives
    x @ w.T [..., N]."""

    __slots__ = ("weight", "wide", "packed")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.wide = weight.float() if _widened(weight) else weight  # [N, K]: what the products are taken of
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.wide, PACK_ROWS_HINT) if _packable(self.wide)
                       else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not self.weight and x.dtype == self.weight.dtype:
            return self._product(x.float()).to(x.dtype)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or not self.packs(x.numel() // max(1, x.shape[-1])):
            return x @ self.wide.T
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def packs(self, rows: int) -> bool:
        """Whether `rows` rows go through the packed weight (the rule above)."""
        n = self.weight.numel()
        return rows * n >= PACK_WORK or (rows > 1 and n >= PACK_MIN) or n >= PACK_ONE_ROW_MIN
