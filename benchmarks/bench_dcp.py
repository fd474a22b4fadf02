"""Milliseconds per generated token of the engine at tp<N> against tp<N>dcp<N> (same world size, same
prompts), each launched under torchrun on gloo (CPU) or nccl (--device cuda). Prints numbers and the
DCP / TP ratio; asserts nothing.

    python benchmarks/bench_dcp.py [--model tiny-gqa] [--tp 4] [--batch 8] [--prompt-len 256] [--new 32]

Under torchrun (the same file, --rank-main) every rank builds its engine, warms up, and times greedy
generation best of --repeats; rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def _rank_main(args: argparse.Namespace) -> None:
    from harness.engine.runtime.engine import Engine
    from harness.engine.runtime.parallel import ParallelState
    from harness.engine.runtime.scheduler import generate
    from harness.formats.locate import load_model
    from harness.formats.weights import load_weights
    from harness.specs.pool import PoolSettings

    spec = load_model(args.model)
    state = ParallelState.from_launcher(args.tp, args.dcp, args.device, 600.0)
    engine = Engine(spec, load_weights(spec), state,
                    pool=PoolSettings(budget_bytes=1 << 30, max_seq_len=args.prompt_len + args.new))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(spec.vocab, 256), (args.batch, args.prompt_len), generator=g).tolist()
    generate(engine, prompts[:1], 2)  # warm-up

    def timed(new: int) -> float:
        state.barrier()
        t = time.perf_counter()
        generate(engine, prompts, new)
        return time.perf_counter() - t

    prefill = min(timed(1) for _ in range(args.repeats))
    total = min(timed(args.new) for _ in range(args.repeats))
    if state.rank == 0:
        per_token_ms = 1000 * (total - prefill) / (args.batch * (args.new - 1))
        print(json.dumps({"topology": f"tp{args.tp}" + (f"dcp{args.dcp}" if args.dcp > 1 else ""),
                          "ms_per_token": per_token_ms, "prefill_s": prefill}), flush=True)
    state.shutdown()


def _launch(args: argparse.Namespace, dcp: int) -> dict[str, float]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}",
            __file__, "--rank-main", "--dcp", str(dcp)] + _forward(args)
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--tp", str(args.tp), "--batch", str(args.batch), "--prompt-len",
            str(args.prompt_len), "--new", str(args.new), "--repeats", str(args.repeats), "--device", args.device]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-gqa")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        _rank_main(args)
        return
    tp, dcp = _launch(args, 1), _launch(args, args.tp)
    print(f"{args.model} batch {args.batch} prompt {args.prompt_len} new {args.new}, best of {args.repeats}")
    for row in (tp, dcp):
        print(f"  {row['topology']:<10} {row['ms_per_token']:8.2f} ms per generated token, prefill "
              f"{1000 * row['prefill_s']:8.1f} ms")
    print(f"  dcp / tp: {dcp['ms_per_token'] / tp['ms_per_token']:.2f}x per generated token, "
          f"{dcp['prefill_s'] / tp['prefill_s']:.2f}x prefill")


if __name__ == "__main__":
    main()
