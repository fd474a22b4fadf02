"""Where a cell's noise comes from: the reference engine's own noise run, or, where that run measures nothing (absent,
failed, or bit-identical to its reference in every tensor both hold: a deterministic engine's scheduling twin), another
engine's reference and noise run on the same checkpoint (docs/tolerances.md#where-the-noise-comes-from)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.records.artifacts import RunArtifacts


@dataclass(frozen=True)
class NoiseRuns:
    """The noise run the bounds of a cell scale from and the run it is measured against (`against`: None for the
    cell's reference itself); `source` says where they come from when it is not the reference engine's own noise
    run against its reference ('' when it is)."""

    run: RunArtifacts | None
    against: RunArtifacts | None = None
    source: str = ""


def measures_nothing(ref: RunArtifacts, noise: RunArtifacts | None) -> str | None:
    """Why `noise` measures no noise against `ref` ('absent', 'failed', 'bit-identical to its reference in all 12
    tensors both hold'), or None when it differs somewhere (or holds no tensor `ref` holds: nothing to judge by)."""
    if noise is None:
        return "absent"
    if not noise.ok:
        return "failed"
    shared = sorted(set(ref.tensors) & set(noise.tensors))
    if not shared:
        return None
    if all(_identical(ref.tensors[key], noise.tensors[key]) for key in shared):
        return f"bit-identical to its reference in all {len(shared)} tensors both hold"
    return None


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bits (NaN equal to NaN at the same place)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]))
