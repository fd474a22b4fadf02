"""Benchmark: GSM8K questions per minute at tp1, batch 1 against batched generation.

    python -m harness.gsm8k.bench --model smollm2-135m --limit 20 --batch-sizes 1,8 [--device cuda]

Runs lm-eval's task through the harness LM on the in-process tp1 engine once per batch size, prints
questions/minute, generated tokens/second and the score, and checks that every batch size produced
the same generations (batching must not change greedy output). --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from harness.engine.engine import PoolSettings
from harness.engine.single import LocalGenerator
from harness.errors import HarnessError
from harness.fmt import table
from harness.gsm8k.data import resolve_source
from harness.gsm8k.lm import HarnessLM
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.stats import agreement_rate
from harness.gsm8k.tasks import evaluate_with
from harness.specs.model import load_model

GIB = 1024 ** 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.gsm8k.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="gsm8k", help="lm-eval GSM8K variant")
    p.add_argument("--limit", type=int, default=20, help="first N test questions")
    p.add_argument("--num-fewshot", type=int, default=None, help="default: the variant's own")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated, e.g. 1,8")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV slot length (prompt + generation)")
    p.add_argument("--kv-budget-gib", type=float, default=2.0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--gsm8k-path", default=None, help="folder with test.jsonl and train.jsonl")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    return p.parse_args(argv)


def measure(generator: LocalGenerator, args: argparse.Namespace, batch_size: int) -> tuple[dict[str, Any], GSM8KResult]:
    lm = HarnessLM(generator, batch_size=batch_size, max_gen_toks=args.max_new_tokens,
                   max_length=args.max_seq_len)
    start = time.perf_counter()
    result = evaluate_with(lm, args.task, resolve_source(args.gsm8k_path), limit=args.limit,
                           num_fewshot=args.num_fewshot)
    wall = time.perf_counter() - start
    row = {"batch_size": batch_size, "n": result.n, "wall_s": wall, "questions_per_min": 60.0 * result.n / wall,
           "generated_tokens": lm.generated_tokens, "tokens_per_s": lm.generated_tokens / wall,
           "scores": dict(result.scores)}
    return row, result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    try:
        start = time.perf_counter()
        generator = LocalGenerator(load_model(args.model), device=args.device,
                                   pool=PoolSettings(budget_bytes=int(args.kv_budget_gib * GIB),
                                                     max_seq_len=args.max_seq_len))
        load_s = time.perf_counter() - start
        generator.generate([generator.tokenizer.encode("Warm up the engine.")], 4, set())
        resolve_source(args.gsm8k_path)  # fail early on a bad data folder
        runs = [measure(generator, args, size) for size in sizes]
    except HarnessError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    first = runs[0][1]
    for row, result in runs:
        row["generation_agreement_with_first"] = agreement_rate([r.generation for r in first.records],
                                                                [r.generation for r in result.records])
    rows = [row for row, _ in runs]
    print(f"{args.model} {args.task} limit={args.limit} on {args.device} (model load {load_s:.1f} s)")
    print(table(["batch", "n", "wall_s", "questions/min", "tokens/s", "strict-match", "same generations"],
                [[str(r["batch_size"]), str(r["n"]), f"{r['wall_s']:.1f}", f"{r['questions_per_min']:.2f}",
                  f"{r['tokens_per_s']:.1f}", f"{r['scores'].get('strict-match', float('nan')):.3f}",
                  f"{r['generation_agreement_with_first']:.0%}"] for r in rows]))
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "task": args.task, "limit": args.limit,
                                         "device": args.device, "load_s": load_s, "runs": rows}, indent=2))
    return 0 if all(r["generation_agreement_with_first"] == 1.0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
