"""Prefill and decode tokens/s of the reference engine at tp1, next to transformers' generate on the
same weights, in the same run: engine and transformers timings interleaved (one of each per round, so
load changes hit both alike), the median of --repeats rounds each. Prints numbers; asserts nothing.

    python benchmarks/bench_engine.py [--models tiny-gqa smollm2-135m] [--batches 1 16] [--json FILE]

--json writes a list of {model, batch, engine_prefill, engine_decode, hf_prefill, hf_decode} (tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from harness.engine.runtime.engine import TORCH_DTYPES, Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate
from harness.formats.hf.write import save_hf_checkpoint
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.specs.pool import PoolSettings

PROMPT_LEN = 64
NEW_TOKENS = 32


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 256), (batch, PROMPT_LEN), generator=g).tolist()


def median(values: list[float]) -> float:
    return statistics.median(values)


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def engine_timers(engine: Engine, batch: list[list[int]]) -> tuple[Callable[[], float], Callable[[], float]]:
    """(prefill seconds, generate seconds) timers of the engine on `batch`."""
    return (lambda: _timed(lambda: engine.prefill_logits(batch)),
            lambda: _timed(lambda: generate(engine, batch, NEW_TOKENS)))


def hf_timers(model: Any, batch: list[list[int]], device: str) -> tuple[Callable[[], float], Callable[[], float]]:
    """(prefill seconds, generate seconds) timers of transformers on `batch`."""
    ids = torch.tensor(batch, device=device)

    def prefill() -> float:
        with torch.no_grad():
            return _timed(lambda: _sync(model(ids), device))

    def generate_s() -> float:
        with torch.no_grad():
            return _timed(lambda: _sync(model.generate(
                ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                attention_mask=torch.ones_like(ids), pad_token_id=0), device))
    return prefill, generate_s


def interleaved(engine: Engine, model: Any, batch: list[list[int]], repeats: int,
                device: str) -> tuple[float, float, float, float]:
    """Engine and transformers (prefill, decode) tokens/s, timed in alternation, medians of `repeats`
    rounds; decode time = generate time - prefill time."""
    timers = engine_timers(engine, batch) + hf_timers(model, batch, device)
    times: list[list[float]] = [[] for _ in timers]
    for _ in range(repeats):
        for spent, timer in zip(times, timers):
            spent.append(timer())
    e_pre, e_gen, h_pre, h_gen = (median(t) for t in times)
    prompt_tokens, new_tokens = len(batch) * PROMPT_LEN, len(batch) * (NEW_TOKENS - 1)
    return (prompt_tokens / e_pre, new_tokens / max(1e-9, e_gen - e_pre),
            prompt_tokens / h_pre, new_tokens / max(1e-9, h_gen - h_pre))


def _sync(out: object, device: str) -> object:
    if device == "cuda":
        torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny-gqa", "smollm2-135m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each number is their median")
    parser.add_argument("--dtype", default="float32", choices=tuple(TORCH_DTYPES))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} device={args.device} prompt={PROMPT_LEN} "
          f"new={NEW_TOKENS} median of {args.repeats} interleaved rounds; load: {os.getloadavg()[0]:.1f}")
    print(f"{'model':<14} {'batch':>5} {'engine prefill':>15} {'engine decode':>14} {'hf prefill':>11} "
          f"{'hf decode':>10} {'prefill x':>9} {'decode x':>8}  (tokens/s)")
    rows: list[dict[str, Any]] = []
    for name in args.models:
        spec = load_model(name)
        weights = load_weights(spec)
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_hf_checkpoint(spec, weights, Path(tmp))
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=TORCH_DTYPES[args.dtype]).to(args.device).eval()
            for b in args.batches:
                engine = Engine(spec, weights, ParallelState.single(args.device), dtype=args.dtype,
                                pool=PoolSettings(budget_bytes=1 << 30, max_seq_len=PROMPT_LEN + NEW_TOKENS))
                batch = prompts(b, spec.vocab)
                interleaved(engine, hf, batch[:1], 1, args.device)  # warm-up
                ep, ed, hp, hd = interleaved(engine, hf, batch, args.repeats, args.device)
                rows.append({"model": name, "batch": b, "engine_prefill": ep, "engine_decode": ed,
                             "hf_prefill": hp, "hf_decode": hd})
                print(f"{name:<14} {b:>5} {ep:>15.0f} {ed:>14.0f} {hp:>11.0f} {hd:>10.0f} {ep / hp:>9.2f} "
                      f"{ed / hd:>8.2f}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
