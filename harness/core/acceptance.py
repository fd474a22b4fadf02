"""Acceptance statistics of speculative decoding, from per-prompt accepted draft-token counts: the
histogram of verify steps per count, the mean accepted length and the distance of two histograms.
Pure: the engine records them, the acceptance checks and baselines compare them."""

from __future__ import annotations

from typing import Sequence

from harness.core.errors import RunError


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


def accepted_per_position(hist: Sequence[int]) -> list[int]:
    """Verify steps that accepted draft position p = 1..k, from a histogram over accepted counts 0..k: a
    chain's drafts are accepted as a prefix, so position p is accepted by every step that accepted p or more
    ([k] counts; each verify step drafted every position)."""
    return [sum(hist[p:]) for p in range(1, len(hist))]


def histogram_from_positions(steps: int, per_position: Sequence[int]) -> list[int]:
    """The inverse of accepted_per_position: verify steps per accepted count 0..k from the number of verify
    steps and the accepted count of each draft position (vLLM's spec_decode_num_drafts and
    spec_decode_num_accepted_tokens_per_pos counters). Counts that are not a prefix acceptance (a later
    position accepted more often than an earlier one, or more than the steps) are a RunError."""
    counts = [steps, *per_position]
    if any(b > a for a, b in zip(counts, counts[1:])) or min(counts, default=0) < 0:
        raise RunError(f"per-position accepted counts {list(per_position)} over {steps} verify steps do not "
                       "fall with the position: not a prefix acceptance")
    return [a - b for a, b in zip(counts, [*per_position, 0])]


# ---- lossless ----------------------------------------------------------------------------------------------
