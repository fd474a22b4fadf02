"""GSM8K questions per minute of the tp1 embedded engine, transformers' `generate` and vLLM's server, side by
side in one process, on the same questions, batch, dtype and stop rules. Prints markdown; asserts nothing.

    python benchmarks/bench_gsm8k.py [harness.backends.embedded.gsm8k_bench's options] [--no-vllm]
        [--order engine,vllm,hf]
    HARNESS_VLLM_PYTHON=/work/main/.venv-vllm/bin/python python benchmarks/bench_gsm8k.py --limit 16 --batch 16 \\
        --num-fewshot 5 --max-new-tokens 256 --max-seq-len 1536 --no-hf

The engine and transformers run as `python -m harness.backends.embedded.gsm8k_bench` runs them (its `measure`);
vLLM, when its
interpreter is found (engines/vllm.yaml: `HARNESS_VLLM_PYTHON`), is one server of the model at tp1 in the engine's
dtype, started before its timing begins (its start-up is printed apart), each batch of --batch prompts one
request of token ids through the harness's vLLM dialect (harness/backends/http/gsm8k.py), stopped at the same
stop tokens and cut at the same stop strings. `--order` runs the generators in that order (a loaded box drifts).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from harness.backends.embedded.gsm8k_bench import GIB, _hf_generator, measure, parse_args
from harness.backends.http.backend import HttpBackend, missing_modules
from harness.backends.http.dialects import Dialect
from harness.backends.http.gsm8k import HttpGenerator
from harness.core.errors import HarnessError
from harness.engine.runtime.single import LocalGenerator
from harness.formats.locate import load_model
from harness.gsm8k.records import GSM8KResult
from harness.gsm8k.stats import agreement_rate
from harness.records.contract import Job
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology

SERVER_TIMEOUT_S = 3600.0


def _vllm(args: argparse.Namespace, generator: LocalGenerator, folder: Path) -> tuple[dict[str, Any], GSM8KResult]:
    backend = HttpBackend("vllm")
    spec = load_model(args.model)
    job = Job(model=spec, topology=Topology(tp=1), prompts=(), out_dir=str(folder), dtype=spec.dtype,
              pool=PoolSettings(budget_bytes=int(args.kv_budget_gib * GIB), max_seq_len=args.max_seq_len))
    started = time.perf_counter()

    def ask(dialect: Dialect) -> tuple[dict[str, Any], GSM8KResult]:
        return measure(HttpGenerator(dialect, generator.tokenizer), args)

    ready_s, (row, result) = backend.ask_server(job, folder / "server.log", SERVER_TIMEOUT_S, ask)
    row["server_ready_s"] = ready_s
    row["server_total_s"] = time.perf_counter() - started
    return row, result


def main(argv: list[str]) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--no-vllm", action="store_true")
    extra.add_argument("--order", default="engine,vllm,hf", help="comma list of engine, vllm, hf")
    ours, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    order = [name for name in ours.order.split(",") if name]
    if sorted(set(order)) != sorted(order) or not set(order) <= {"engine", "vllm", "hf"}:
        raise SystemExit(f"--order {ours.order!r}: a comma list of distinct engine, vllm, hf")
    vllm_python = HttpBackend("vllm").spec.interpreter()
    has_vllm = not ours.no_vllm and Path(vllm_python).exists() and not missing_modules(vllm_python, ["vllm"])
    if not has_vllm and not ours.no_vllm:
        print(f"vLLM not found at {vllm_python} (set HARNESS_VLLM_PYTHON): measured without it", file=sys.stderr)
    generator = LocalGenerator(load_model(args.model), device=args.device,
                               pool=PoolSettings(budget_bytes=int(args.kv_budget_gib * GIB),
                                                 max_seq_len=args.max_seq_len))
    generator.generate([generator.tokenizer.encode("Warm up the engine.")], 4, set())
    rows: dict[str, tuple[dict[str, Any], GSM8KResult]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in order:
                if name == "engine":
                    rows[name] = measure(generator, args)
                elif name == "hf" and not args.no_hf:
                    rows[name] = measure(_hf_generator(generator, args, Path(tmp) / "hf"), args)
                elif name == "vllm" and has_vllm:
                    rows[name] = _vllm(args, generator, Path(tmp) / "vllm")
                print(f"{name}: done", file=sys.stderr, flush=True)
    except HarnessError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} {args.task} limit={args.limit} batch={args.batch} fewshot={args.num_fewshot} "
          f"max_new_tokens={args.max_new_tokens} on {args.device}, {torch.get_num_threads()} threads")
    print("| generator | n | wall s | questions/min | tokens/s | strict-match | same generations as the engine |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    engine = rows.get("engine")
    for name, (row, result) in rows.items():
        same = (agreement_rate([r.generation for r in engine[1].records], [r.generation for r in result.records])
                if engine is not None else float("nan"))
        print(f"| {name} | {row['n']} | {row['wall_s']:.1f} | {row['questions_per_min']:.2f} | "
              f"{row['tokens_per_s']:.1f} | {row['strict_match']:.3f} | {same:.0%} |")
    if "vllm" in rows:
        print(f"vLLM server: ready in {rows['vllm'][0]['server_ready_s']:.1f} s (not in its questions/min)")
    if engine is not None:
        for name in ("vllm", "hf"):
            if name in rows:
                print(f"engine / {name}: {engine[0]['questions_per_min'] / rows[name][0]['questions_per_min']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
