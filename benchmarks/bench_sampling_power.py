"""The sampling_distribution check's false-positive rate and power, measured by simulation with its own test
(harness/compare/sampling.py: chi_square_p at alpha / tests, Bonferroni over a cell's tests).

Each trial draws a processed distribution like the sampling workload's on the tiny models (a support of 10 tokens,
logits ~ N(0, 1.5^2)), then n draws from it (the null) or from a shifted one, and tests one position at the cell's
per-test threshold (alpha / 64: the sampling workload's 4 sends x 8 steps x 2 paths). Prints the per-cell false-
positive rate under the null (the share of p-values below a few levels: Pearson's approximation in its tail) and, per
shift and n, the share of single positions that FAIL (a cell of 64 positions FAILs when any does, so a shift every
position carries is caught at least that often).

    python benchmarks/bench_sampling_power.py [--trials 200] [--null 20000]
"""

from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

from harness.compare.sampling import chi_square_p
from harness.compare.settings import SamplingSettings

SUPPORT = 10
TESTS = 64
Shift = Callable[[np.ndarray], np.ndarray]


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def _move_top(mass: float) -> Shift:
    """`mass` of the most probable token's probability moved to the others in proportion."""
    def shift(x: np.ndarray) -> np.ndarray:
        p = _softmax(x)
        top = int(p.argmax())
        taken = min(mass, p[top])
        q = p * (1 + taken / (1 - p[top]))
        q[top] = p[top] - taken
        return q
    return shift


def _temperature(factor: float) -> Shift:
    return lambda x: _softmax(x / factor)


def _drop_last(x: np.ndarray) -> np.ndarray:
    """The least probable kept token masked (an off-by-one cut-off: top-k of k - 1), the rest renormalized."""
    p = _softmax(x)
    p[int(p.argmin())] = 0.0
    return p / p.sum()


SHIFTS: dict[str, Shift] = {
    "temperature x 1.1": _temperature(1.1), "temperature x 1.25": _temperature(1.25),
    "temperature x 1.5": _temperature(1.5), "top token -0.02": _move_top(0.02), "top token -0.05": _move_top(0.05),
    "top token -0.10": _move_top(0.10), "least token masked": _drop_last,
}


def detect_rate(rng: np.random.Generator, shift: Shift | None, n: int, trials: int, threshold: float) -> float:
    hits = 0
    for _ in range(trials):
        x = rng.normal(0.0, 1.5, SUPPORT)
        p = _softmax(x)
        q = p if shift is None else shift(x)
        counts = np.bincount(rng.choice(SUPPORT, n, p=q), minlength=SUPPORT)
        hits += chi_square_p(counts, p) < threshold
    return hits / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200, help="positions per (shift, n)")
    parser.add_argument("--null", type=int, default=20000, help="positions drawn from the distribution itself")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = SamplingSettings()
    threshold = settings.alpha / TESTS
    rng = np.random.default_rng(args.seed)
    null = []
    for _ in range(args.null):
        x = rng.normal(0.0, 1.5, SUPPORT)
        p = _softmax(x)
        null.append(chi_square_p(np.bincount(rng.choice(SUPPORT, 400, p=p), minlength=SUPPORT), p,
                                 settings.min_expected))
    values = np.asarray(null)
    print(f"alpha {settings.alpha:g} per cell over {TESTS} tests: per-test threshold {threshold:.2e}; bins pooled "
          f"below {settings.min_expected:g} expected draws")
    print(f"null (n=400, {args.null} positions): share of p-values below 1e-2, 1e-3, 1e-4: "
          + ", ".join(f"{(values < t).mean():.2e}" for t in (1e-2, 1e-3, 1e-4))
          + f"; below the threshold: {(values < threshold).mean():.2e}")
    ns = (100, 200, 400, 800, 1600)
    print(f"\nshare of single positions FAILing (support of {SUPPORT} tokens, p < {threshold:.2e})")
    print(f"{'shift':<22}" + "".join(f"{'n=' + str(n):>9}" for n in ns))
    for name, shift in SHIFTS.items():
        print(f"{name:<22}" + "".join(f"{detect_rate(rng, shift, n, args.trials, threshold):>9.2f}" for n in ns))


if __name__ == "__main__":
    main()
