"""Prefill and decode tokens/s of the reference engine at tp1, next to transformers' generate on the
same weights, in the same run. Prints numbers; asserts nothing.

    python benchmarks/bench_engine.py [--models tiny-gqa smollm2-135m] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from harness.engine.checkpoint import save_hf_checkpoint
from harness.engine.engine import Engine, PoolSettings
from harness.engine.parallel import ParallelState
from harness.engine.weights import load_weights
from harness.specs.model import load_model

PROMPT_LEN = 64
NEW_TOKENS = 32


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 256), (batch, PROMPT_LEN), generator=g).tolist()


def bench_engine(engine: Engine, batch: list[list[int]]) -> tuple[float, float]:
    t = time.perf_counter()
    engine.prefill_logits(batch)
    prefill = len(batch) * PROMPT_LEN / (time.perf_counter() - t)
    t = time.perf_counter()
    engine.generate(batch, NEW_TOKENS)
    total = time.perf_counter() - t
    decode = len(batch) * (NEW_TOKENS - 1) / max(1e-9, total - len(batch) * PROMPT_LEN / prefill)
    return prefill, decode


def bench_transformers(folder: Path, batch: list[list[int]]) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor(batch)
    with torch.no_grad():
        t = time.perf_counter()
        model(ids)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                       attention_mask=torch.ones_like(ids), pad_token_id=0)
        total = time.perf_counter() - t
    return len(batch) * PROMPT_LEN / prefill_s, len(batch) * (NEW_TOKENS - 1) / max(1e-9, total - prefill_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["tiny-gqa", "smollm2-135m"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{'model':<14} {'batch':>5} {'engine prefill':>15} {'engine decode':>14} {'hf prefill':>11} {'hf decode':>10}  (tokens/s)")
    for name in args.models:
        spec = load_model(name)
        weights = load_weights(spec)
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_hf_checkpoint(spec, weights, Path(tmp))
            for b in args.batches:
                engine = Engine(spec, weights, ParallelState.single(),
                                pool=PoolSettings(budget_bytes=1 << 30, max_seq_len=PROMPT_LEN + NEW_TOKENS))
                batch = prompts(b, spec.vocab)
                bench_engine(engine, batch[:1])  # warm-up
                ep, ed = bench_engine(engine, batch)
                hp, hd = bench_transformers(folder, batch)
                print(f"{name:<14} {b:>5} {ep:>15.0f} {ed:>14.0f} {hp:>11.0f} {hd:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
