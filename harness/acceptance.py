"""Acceptance statistics of speculative decoding, from per-prompt accepted draft-token counts: the
histogram of verify steps per count, the mean accepted length and the distance of two histograms.
Pure: the engine records them, the acceptance checks and baselines compare them."""

from __future__ import annotations

from typing import Sequence

from harness.errors import RunError


def histogram(accepted: Sequence[Sequence[int]], k: int) -> list[int]:
    """Verify steps per accepted draft-token count 0..k, over all prompts."""
    counts = [0] * (k + 1)
    for steps in accepted:
        for a in steps:
            if not 0 <= a <= k:
                raise RunError(f"accepted count {a} outside 0..{k}")
            counts[a] += 1
    return counts


def mean_accepted_length(accepted: Sequence[Sequence[int]]) -> float:
    """Mean of (accepted + 1) over all verify steps; NaN without steps."""
    flat = [a for steps in accepted for a in steps]
    return sum(a + 1 for a in flat) / len(flat) if flat else float("nan")


def total_variation(p: Sequence[int], q: Sequence[int]) -> float:
    """Total-variation distance of two histograms (normalised); 0 when both are empty."""
    sp, sq = sum(p), sum(q)
    if not sp or not sq:
        return 0.0 if sp == sq else 1.0
    return 0.5 * sum(abs(a / sp - b / sq) for a, b in zip(p, q))


# ---- lossless ----------------------------------------------------------------------------------------------
