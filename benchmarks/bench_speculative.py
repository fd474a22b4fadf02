"""Greedy decoding tokens/s at tp1 with and without speculation (draft model and MTP module), in this
process, on a synthetic model. Prints numbers; asserts nothing.

    python benchmarks/bench_speculative.py [--model tiny-gqa] [--batches 1 8] [--k 1 3 5]

The tiny models' speculator is as deep as the target (speculator_layers = layers; see
harness/engine/speculative/speculator.py), so a step costs about k speculator forwards plus one target forward:
speculation pays off only when the accepted length outweighs that. Both columns time whole
generations (prefill included) of the same prompts; speculative output equals plain greedy output.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable, TypeVar

import torch

from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate, run_speculative_cases
from harness.engine.speculative.speculator import speculator_for
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings

PROMPT_LEN = 32
NEW_TOKENS = 64
T = TypeVar("T")


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 256), (batch, PROMPT_LEN), generator=g).tolist()


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Best wall time of `repeats` calls (a shared machine's noise only ever adds time) and the result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    assert out is not None
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gqa")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--speculator-layers", type=int, default=0, help="0: as deep as the target")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    args = parser.parse_args()
    spec = load_model(args.model)
    spec = dataclasses.replace(spec, speculator_layers=args.speculator_layers or spec.layers)
    weights = load_weights(spec)
    pool = PoolSettings(budget_bytes=64 << 20, max_seq_len=PROMPT_LEN + NEW_TOKENS + max(args.k) + 8)
    target = Engine(spec, weights, ParallelState.single(), pool=pool)
    print(f"{spec.name}: {spec.layers} layers, speculator {spec.speculator_layers} layer(s), "
          f"{NEW_TOKENS} new tokens after {PROMPT_LEN}-token prompts, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'speculator':>10} {'k':>2} {'tok/s':>9} {'speedup':>8} {'mean acc len':>12} {'lossless':>8}")
    for batch in args.batches:
        ps = prompts(batch, spec.vocab)
        generate(target, ps[:1], 4)  # warm-up
        plain_s, plain = timed(lambda: generate(target, ps, NEW_TOKENS), args.repeats)
        base = batch * NEW_TOKENS / plain_s
        print(f"{batch:>5} {'none':>10} {'-':>2} {base:>9.1f} {1.0:>8.2f} {'-':>12} {'-':>8}")
        for kind in ("draft", "mtp"):
            for k in args.k:
                sp = speculator_for(target, kind, weights, SpeculativeSettings(k=k))
                spec_s, result = timed(lambda: run_speculative_cases(target, sp, ps, k, NEW_TOKENS), args.repeats)
                rate = batch * NEW_TOKENS / spec_s
                lossless = result.tokens == plain.tokens
                print(f"{batch:>5} {kind:>10} {k:>2} {rate:>9.1f} {rate / base:>8.2f} "
                      f"{result.mean_accepted_length:>12.2f} {str(lossless):>8}")


if __name__ == "__main__":
    main()
