"""What the workloads cost, printed as numbers (asserts nothing):

1. per workload, the embedded engine's CPU seconds at tp1 for its generation as it schedules it and for
   its teacher-forced paths (prefill + decode path), and the serving loop's steps;
2. prefix-cache hit vs miss: prefill time of prompts that share a prefix, cached vs computed;
3. chunked vs whole prefill of one long prompt;
4. with --suite-runs, the wall and CPU time of `harness run --suite S --topo T` with the suite's default
   workloads and with only the suite's prompts (`--workload prompts`), each from a fresh cache.

    python benchmarks/bench_workloads.py [--model tiny-gqa] [--long 136] [--suite-runs dcp:tp4dcp4,tp:tp2]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Callable

import torch

from harness.cases import build_workload_cases
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import ServeSettings, ServingLoop
from harness.formats.locate import load_model
from harness.formats.tokenizer import load_tokenizer
from harness.formats.weights import load_weights
from harness.specs.pool import PoolSettings
from harness.specs.workload import WORKLOADS, WorkloadPlan


def cpu_s(fn: Callable[[], object]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def best(fn: Callable[[], object], repeats: int = 3) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def per_workload(engine: Engine, long: int) -> None:
    tok = load_tokenizer(engine.spec)
    print(f"{'workload':<16} {'cases':>5} {'tokens':>7} {'steps':>5} {'gen CPU s':>9} {'teacher-forced CPU s':>20}")
    for w in WORKLOADS.values():
        if w.suite_prompts:
            continue
        (group,) = build_workload_cases(WorkloadPlan((w.resolved(long, 16),)), [], tok, 0, 4)
        cases = list(group.cases)
        prompts = [list(c.prompt_ids) for c in cases]
        new = [len(c.sequence_ids) - len(c.prompt_ids) for c in cases]
        loop = ServingLoop(engine, replace(ServeSettings.from_mapping(w.engine_settings()), split_long=True))  # as runs
        gen = cpu_s(lambda: loop.generate(prompts, new))
        seqs = [list(c.sequence_ids) for c in cases]
        tf = cpu_s(lambda: (engine.prefill_logits(seqs), engine.decode_path(seqs, [c.decode_start for c in cases],
                                                                           [c.probe_positions for c in cases])))
        tokens = sum(len(s) for s in seqs)
        print(f"{w.name:<16} {len(cases):>5} {tokens:>7} {loop.stats.steps:>5} {gen:>9.3f} {tf:>20.3f}")


def prefix_hit_vs_miss(engine: Engine, prefix: int) -> None:
    g = torch.Generator().manual_seed(0)
    head = torch.randint(1, engine.spec.vocab, (prefix,), generator=g).tolist()
    prompts = [head + torch.randint(1, engine.spec.vocab, (8,), generator=g).tolist() for _ in range(4)]

    def run(cache: bool) -> None:
        loop = ServingLoop(engine, ServeSettings(schedule="staggered", prefix_cache=cache))
        loop.generate(prompts, [1] * len(prompts))

    miss, hit = best(lambda: run(False)), best(lambda: run(True))
    print(f"prefix cache, 4 prompts of {prefix}+8 tokens, one new token each: miss {miss * 1e3:.1f} ms, "
          f"hit {hit * 1e3:.1f} ms ({miss / hit:.2f}x)")


def chunked_vs_whole(engine: Engine, length: int, chunk: int) -> None:
    g = torch.Generator().manual_seed(1)
    prompt = [torch.randint(1, engine.spec.vocab, (length,), generator=g).tolist()]

    def run(budget: int) -> None:
        ServingLoop(engine, ServeSettings(chunk_tokens=budget)).generate(prompt, [1])

    whole, chunked = best(lambda: run(0)), best(lambda: run(chunk))
    print(f"prefill of {length} tokens: whole {whole * 1e3:.1f} ms, chunks of {chunk} {chunked * 1e3:.1f} ms "
          f"({chunked / whole:.2f}x)")


def suite_run(suite: str, topo: str, workload: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the harness and its children) of one `harness run` from a fresh cache."""
    with tempfile.TemporaryDirectory() as work:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "harness", "run", "--suite", suite, "--topo", topo, "--out",
                        f"{work}/out", "--cache-dir", f"{work}/cache", *workload], check=False,
                       capture_output=True, env={**os.environ})
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-gqa")
    p.add_argument("--long", type=int, default=136, help="long_context of the workloads")
    p.add_argument("--suite-runs", default="", help="comma list of SUITE:TOPO to time with and without workloads")
    args = p.parse_args()
    torch.set_num_threads(1)
    spec = load_model(args.model)
    engine = Engine(spec, load_weights(spec), ParallelState.single(), pool=PoolSettings(max_seq_len=4 * args.long))
    print(f"model {spec.name}, tp1, 1 thread, long_context {args.long}")
    per_workload(engine, args.long)
    prefix_hit_vs_miss(engine, 4 * args.long // 2)
    chunked_vs_whole(engine, 2 * args.long, 48)
    for item in filter(None, args.suite_runs.split(",")):
        suite, topo = item.split(":")
        base = suite_run(suite, topo, ["--workload", "prompts"])
        full = suite_run(suite, topo, [])
        print(f"harness run --suite {suite} --topo {topo}: prompts only {base[0]:.1f} s wall / {base[1]:.1f} s CPU; "
              f"default workloads {full[0]:.1f} s / {full[1]:.1f} s ({full[0] / base[0]:.2f}x wall, "
              f"{full[1] / base[1]:.2f}x CPU)")


if __name__ == "__main__":
    main()
