"""Greedy generations of every shipped model family and topology family, as token ids.

`python -m tests.generation_fixture --record OUT.json` writes them: plain generation (the serving loop
at default settings) and, for -draft / -mtp topologies, speculative generation with its acceptance
counts. tests/data/generations.json is this script's output from the engine before its three generation
loops (Engine.generate, the serving loop, the speculative loop) became the one serving loop (there,
"shared" is the former shared-prefix copy and "shared_plain" generation without it): test_engine_generate.py
checks that the one loop gives the same tokens and acceptance counts. One launch per (tp, dcp) world (the
fork launcher, gloo), every case of that world built in turn on the ranks; tp1 runs in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.core.limits import COLLECTIVE_TIMEOUT_S
from harness.engine.fault import FaultFlags
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import ServeSettings, ServingLoop, generate, run_speculative_cases
from harness.engine.speculative.speculator import speculator_for
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.launcher.launch import thread_env
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import parse_topology_name

FIXTURE = Path(__file__).parent / "data" / "generations.json"
# (model, topology): dense GQA, odd GQA (GCD duplication), MQA, head_dim 64, the bf16/fp16 ones, MLA, the
# hybrid (linear attention + MoE, EP) and the speculators, over TP, DCP (round-robin, interleaved,
# contiguous, Q replicated), EP, -draft and -mtp
CASES: tuple[tuple[str, str], ...] = (
    ("tiny-gqa", "tp1"), ("tiny-mla", "tp1"), ("tiny-hybrid", "tp1"), ("smollm2-135m", "tp1"),
    ("tiny-gqa", "tp1-draft"), ("tiny-gqa", "tp1-mtp"),
    ("tiny-gqa", "tp2"), ("tiny-mqa", "tp2"), ("tiny-hd64", "tp2"), ("tiny-bf16-big", "tp2"),
    ("tiny-fp16-big", "tp2"), ("tiny-mla-bf16", "tp2"), ("tiny-hybrid-bf16", "tp2"), ("tiny-hybrid", "tp2ep2"),
    ("tiny-hybrid", "tp2-mtp"), ("tiny-gqa", "tp2-draft"),
    ("tiny-gqa", "tp2dcp2"), ("tiny-gqa", "tp2dcp2i2"), ("tiny-mla", "tp2dcp2"), ("tiny-mla", "tp2dcp2c"),
    ("tiny-mla", "tp2dcp2q"), ("tiny-mla-bf16", "tp2dcp2i4"), ("tiny-gqa", "tp2dcp2-mtp"),
    ("tiny-kv6", "tp4"), ("tiny-gqa", "tp4-draft"),
    ("tiny-kv6", "tp4dcp2"), ("tiny-hybrid", "tp4dcp2ep4-mtp"), ("tiny-gqa", "tp4dcp4-draft"),
)
MAX_NEW = 8
POOL = {"budget_bytes": 16 << 20, "max_seq_len": 256}


def prompts(vocab: int) -> dict[str, list[list[int]]]:
    """Two prompt sets in the model's vocabulary: mixed lengths (one past 128, so a plain prefill runs
    as two length buckets), and prompts sharing a 32-token prefix (two KV blocks: the shared-prefix path)."""
    def ids(seed: int, n: int) -> list[int]:
        return [(seed * 7919 + i * 104729 + (i * i) * 31) % (vocab - 1) + 1 for i in range(n)]
    prefix = ids(5, 32)
    return {"mixed": [ids(1, 5), ids(2, 17), ids(3, 33), ids(4, 140)],
            "shared": [prefix + ids(6, 3), prefix + ids(7, 9), prefix + ids(8, 1)]}


def run_case(state: ParallelState, model: str, topology: str) -> dict[str, Any]:
    topo = parse_topology_name(topology)
    spec = load_model(model)
    weights = load_weights(spec)
    engine = Engine(spec, weights, state, FaultFlags(), PoolSettings(**POOL), ep=topo.ep,
                    speculator=topo.speculator, placement=topo.placement, q_replicated=topo.q_replicated)
    batches = prompts(spec.vocab)
    # mixed and shared_plain: default settings; shared: the prompts' common prefix computed once (prefix
    # cache: where it takes whole blocks of the prefix, prefix_hits > 0, it splits the prefill there)
    out: dict[str, Any] = {"mixed": generate(engine, batches["mixed"], MAX_NEW).tokens,
                           "shared_plain": generate(engine, batches["shared"], MAX_NEW).tokens}
    loop = ServingLoop(engine, ServeSettings(prefix_cache=True))
    out["shared"] = loop.generate(batches["shared"], [MAX_NEW] * len(batches["shared"])).tokens
    out["prefix_hits"] = loop.stats.prefix_hits
    if topo.speculator != "none":
        settings = SpeculativeSettings()
        speculator = speculator_for(engine, topo.speculator, weights, settings)
        result = run_speculative_cases(engine, speculator, batches["mixed"], settings.k, MAX_NEW)
        out["speculative"] = {"tokens": result.tokens, "accepted": result.accepted}
    return out


def main(argv: list[str] | None = None) -> int:
    """As a launched rank: CONFIG.json {"tp", "dcp", "cases": [[model, topology]], "out"}."""
    config = json.loads(Path((sys.argv[1:] if argv is None else argv)[0]).read_text())
    state = ParallelState.from_launcher(config["tp"], config["dcp"], "cpu", COLLECTIVE_TIMEOUT_S)
    results = {f"{m} {t}": run_case(state, m, t) for m, t in config["cases"]}
    state.barrier()
    state.shutdown()
    if state.rank == 0:
        Path(config["out"]).write_text(json.dumps(results))
    return 0


def record(cases: tuple[tuple[str, str], ...] = CASES, timeout_s: float = 1800) -> dict[str, Any]:
    """Every case's generations: tp1 here, the others one launch per (tp, dcp)."""
    results: dict[str, Any] = {}
    worlds: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for model, topology in cases:
        topo = parse_topology_name(topology)
        if topo.tp == 1:
            results[f"{model} {topology}"] = run_case(ParallelState.single(), model, topology)
        else:
            worlds.setdefault((topo.tp, topo.dcp), []).append((model, topology))
    for (tp, dcp), members in worlds.items():
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps({"tp": tp, "dcp": dcp, "cases": members, "out": f"{tmp}/out.json"}))
            cmd = [sys.executable, "-m", "harness.launcher.forkrun", f"--nproc={tp}",
                   "--module=tests.generation_fixture", "--", str(config)]
            env = {**os.environ, **thread_env(tp, dict(os.environ))}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"tp{tp}dcp{dcp}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            results.update(json.loads((Path(tmp) / "out.json").read_text()))
    return {f"{m} {t}": results[f"{m} {t}"] for m, t in cases}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--record":
        Path(sys.argv[2]).write_text(json.dumps({"max_new_tokens": MAX_NEW, "pool": POOL,
                                                 "cases": record()}, indent=None) + "\n")
        sys.exit(0)
    sys.exit(main())
