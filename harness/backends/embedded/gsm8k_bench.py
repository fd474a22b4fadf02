"""Benchmark: GSM8K questions per minute of the tp1 engine against transformers' `generate`, in the
same run, on the same questions, batch size and stop rules.

    python -m harness.backends.embedded.gsm8k_bench --model smollm2-135m --limit 16 --batch 16 [--json FILE] \
        [--device cuda]

Both run lm-eval's task through the harness LM: the engine with continuous batching and stop strings
checked during generation, transformers in static batches of --batch (left-padded) with the same stop
tokens and stop strings as a stopping criterion. Prints questions/minute, generated tokens/second and
the score of each, and the fraction of identical generations. --json writes {batch, n,
engine_questions_per_min, hf_questions_per_min, same_generations, ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from harness.core.errors import HarnessError
from harness.core.fmt import table
from harness.engine.runtime.generator import StringStop, stop_string_check
from harness.engine.runtime.single import LocalGenerator
from harness.formats.hf.write import save_hf_checkpoint
from harness.formats.locate import load_model
from harness.formats.tokenizer import Tokenizer
from harness.formats.weights import load_weights
from harness.gsm8k.data import resolve_source
from harness.gsm8k.lm import Generator, HarnessLM
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.stats import agreement_rate
from harness.gsm8k.tasks import evaluate_with
from harness.specs.pool import PoolSettings

GIB = 1024 ** 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.backends.embedded.gsm8k_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="gsm8k", help="lm-eval GSM8K variant")
    p.add_argument("--limit", type=int, default=16, help="first N test questions")
    p.add_argument("--num-fewshot", type=int, default=None, help="default: the variant's own")
    p.add_argument("--batch", type=int, default=16, help="sequences generated at once (both engines)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV slot length (prompt + generation)")
    p.add_argument("--kv-budget-gib", type=float, default=2.0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--no-hf", action="store_true", help="time the engine only")
    p.add_argument("--compare-prefix-reuse", action="store_true",
                   help="also time the engine with shared-prefix KV reuse off, and compare its generations")
    p.add_argument("--gsm8k-path", default=None, help="folder with test.jsonl and train.jsonl")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here")
    return p.parse_args(argv)


class _FinishSteps:
    """transformers StoppingCriteria: a row stops at a stop token or a stop string in its new text;
    records how many new tokens each row had when it stopped."""

    def __init__(self, prompt_width: int, rows: int, stop_ids: set[int], strings: StringStop | None) -> None:
        self.width = prompt_width
        self.stop_ids = stop_ids
        self.strings = strings
        self.lengths: list[int | None] = [None] * rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = []
        for r, row in enumerate(input_ids.tolist()):
            new = row[self.width:]
            if self.lengths[r] is None and new and (new[-1] in self.stop_ids
                                                    or (self.strings is not None and self.strings(r, new))):
                self.lengths[r] = len(new)
            done.append(self.lengths[r] is not None)
        return torch.tensor(done, device=input_ids.device)


class HFGenerator:
    """transformers' greedy `generate` behind the GSM8K LM's Generator protocol (static batches)."""

    def __init__(self, model: Any, tokenizer: Tokenizer, device: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.rank = 0
        self.world_size = 1

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: set[int],
                 stop_strings: Sequence[str] = (), max_batch: int | None = None) -> list[list[int]]:
        from transformers import StoppingCriteriaList

        step = max_batch or len(prompts)
        out: list[list[int]] = []
        for i in range(0, len(prompts), step):
            chunk = prompts[i:i + step]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(chunk):  # left padding
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            finish = _FinishSteps(width, len(chunk), stop_token_ids, stop_string_check(self.tokenizer, stop_strings))
            with torch.no_grad():
                gen = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                          max_new_tokens=max_new_tokens, pad_token_id=0,
                                          stopping_criteria=StoppingCriteriaList([finish]))
            for r in range(len(chunk)):
                new = gen[r, width:].tolist()
                out.append(new[:finish.lengths[r] or max_new_tokens])
        return out


def measure(generator: Generator, args: argparse.Namespace) -> tuple[dict[str, Any], GSM8KResult]:
    lm = HarnessLM(generator, batch_size=args.batch, max_gen_toks=args.max_new_tokens, max_length=args.max_seq_len)
    start = time.perf_counter()
    result = evaluate_with(lm, args.task, resolve_source(args.gsm8k_path), limit=args.limit,
                           num_fewshot=args.num_fewshot)
    wall = time.perf_counter() - start
    return {"n": result.n, "wall_s": wall, "questions_per_min": 60.0 * result.n / wall,
            "generated_tokens": lm.generated_tokens, "tokens_per_s": lm.generated_tokens / wall,
            "strict_match": result.scores.get("strict-match", float("nan"))}, result


def _hf_generator(engine_gen: LocalGenerator, args: argparse.Namespace, folder: Path) -> HFGenerator:
    from transformers import AutoModelForCausalLM

    spec = load_model(args.model)
    save_hf_checkpoint(spec, load_weights(spec), folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
    return HFGenerator(model, engine_gen.tokenizer, args.device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        start = time.perf_counter()
        generator = LocalGenerator(load_model(args.model), device=args.device,
                                   pool=PoolSettings(budget_bytes=int(args.kv_budget_gib * GIB),
                                                     max_seq_len=args.max_seq_len))
        load_s = time.perf_counter() - start
        generator.generate([generator.tokenizer.encode("Warm up the engine.")], 4, set())
        resolve_source(args.gsm8k_path)  # fail early on a bad data folder
        engine_row, engine_result = measure(generator, args)
        plain_row: dict[str, Any] | None = None
        same_plain = float("nan")
        if args.compare_prefix_reuse:
            generator.prefix_cache = False
            plain_row, plain_result = measure(generator, args)
            generator.prefix_cache = True
            same_plain = agreement_rate([r.generation for r in engine_result.records],
                                        [r.generation for r in plain_result.records])
        hf_row: dict[str, Any] | None = None
        same = float("nan")
        if not args.no_hf:
            with tempfile.TemporaryDirectory() as tmp:
                hf_row, hf_result = measure(_hf_generator(generator, args, Path(tmp)), args)
            same = agreement_rate([r.generation for r in engine_result.records],
                                  [r.generation for r in hf_result.records])
    except HarnessError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} {args.task} limit={args.limit} batch={args.batch} on {args.device}, "
          f"{torch.get_num_threads()} threads (model load {load_s:.1f} s)")
    rows = ([("engine", engine_row)] + ([("engine, no prefix reuse", plain_row)] if plain_row is not None else [])
            + ([("transformers", hf_row)] if hf_row is not None else []))
    print(table(["generator", "n", "wall_s", "questions/min", "tokens/s", "strict-match"],
                [[name, str(r["n"]), f"{r['wall_s']:.1f}", f"{r['questions_per_min']:.2f}", f"{r['tokens_per_s']:.1f}",
                  f"{r['strict_match']:.3f}"] for name, r in rows]))
    if hf_row is not None:
        print(f"same generations: {same:.0%}; engine / transformers: "
              f"{engine_row['questions_per_min'] / hf_row['questions_per_min']:.2f}x")
    if plain_row is not None:
        print(f"prefix reuse: same generations {same_plain:.0%}; with / without: "
              f"{engine_row['questions_per_min'] / plain_row['questions_per_min']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "model": args.model, "task": args.task, "device": args.device, "threads": torch.get_num_threads(),
            "batch": args.batch, "n": engine_row["n"], "engine_questions_per_min": engine_row["questions_per_min"],
            "hf_questions_per_min": hf_row["questions_per_min"] if hf_row else None,
            "same_generations": same if hf_row else None, "engine": engine_row, "hf": hf_row, "load_s": load_s,
            "engine_no_prefix_reuse": plain_row, "same_generations_prefix_reuse": same_plain if plain_row else None,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
