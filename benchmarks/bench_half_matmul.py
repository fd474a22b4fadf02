"""Half-precision matmuls on the CPU: torch's own float16 / bfloat16 kernel against the engine's rule (operands
widened to float32, summed in float32, rounded once: harness/engine/layers/linear.py), on the tiny models'
shapes, one thread. Prints microseconds per call and the share of output elements the two round differently;
asserts nothing.

    python benchmarks/bench_half_matmul.py [--calls 300]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from harness.engine.layers.linear import Linear, matmul_t

# rows x N x K: a decode step, a prefill of a few prompts, the FFN projections and the output head of the tiny models
SHAPES = ((1, 128, 128), (8, 128, 128), (60, 290, 128), (60, 128, 290), (8, 383, 128), (200, 384, 128))


def per_call(fn: Callable[[], torch.Tensor], calls: int) -> float:
    """Median-free mean microseconds of `calls` calls of fn after a warm-up."""
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| dtype | rows x N x K | torch us | Linear us (weight widened once) | matmul_t us | speed-up (Linear) | "
          "elements rounded differently |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for dtype in (torch.float16, torch.bfloat16):
        for rows, n, k in SHAPES:
            x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
            linear = Linear(w)
            own = per_call(lambda: x @ w.T, args.calls)
            kept = per_call(lambda: linear(x), args.calls)
            wide = per_call(lambda: matmul_t(x, w), args.calls)
            differ = (x @ w.T != linear(x)).float().mean().item()
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} x {n} x {k} | {own:.1f} | {kept:.1f} | {wide:.1f} | "
                  f"{own / kept:.1f}x | {differ:.2%} |", flush=True)


if __name__ == "__main__":
    main()
