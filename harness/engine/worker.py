"""The per-rank entry point: `python -m harness.engine.worker JOB.json`, started by torchrun (or
directly at world size 1). Joins the process group, builds the engine, runs every case of the job in
lockstep, and rank 0 writes the run directory."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from harness import __version__
from harness.artifacts import Case, write_run
from harness.gsm8k.cell import RESULT_FILE as GSM8K_FILE
from harness.jsonio import read_json, write_json
from harness.cases import build_cases
from harness.engine.engine import Engine, PoolSettings
from harness.engine.faults import fault_flags
from harness.engine.parallel import ParallelState
from harness.engine.speculative import run_speculative_cases, spec_manifest, spec_tensors
from harness.engine.speculator import SpeculativeSettings, speculator_for
from harness.engine.tokenizer import Tokenizer, load_tokenizer
from harness.engine.weights import load_weights, weights_hash
from harness.limits import COLLECTIVE_TIMEOUT_S
from harness.specs.model import model_from_dict
from harness.specs.topology import Topology

ENGINE_VERSION = "1"
INJECT_ENV = "HARNESS_INJECT_RANK_FAILURE"  # "crash:R" or "hang:R": test hook for the launcher's error path


@dataclass(frozen=True)
class Job:
    """Everything a launch needs, written by the runner as job.json in the run directory."""

    model: dict[str, Any]
    topology: dict[str, Any]
    prompts: list[str]
    out_dir: str
    fault: str | None = None
    dtype: str | None = None
    seed: int = 0
    max_new_tokens: int = 16
    decode_prefix_tokens: int = 4
    top_k: int = 5
    pool: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    git_commit: str = ""
    gsm8k: dict[str, Any] | None = None
    speculative: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "Job":
        return cls(**read_json(path))


def _inject_failure(rank: int) -> None:
    spec = os.environ.get(INJECT_ENV, "")
    if not spec:
        return
    mode, _, who = spec.partition(":")
    if who and int(who) == rank:
        print(f"injected failure: {mode} on rank {rank}", flush=True)
        if mode == "crash":
            os._exit(17)
        if mode == "hang":
            time.sleep(10 ** 6)


def _run_gsm8k(job: Job, engine: Engine, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """GSM8K through lm-eval on this engine, in lockstep on every rank (lm-eval imported only here)."""
    if not job.gsm8k:
        return None
    from harness.gsm8k.engine_eval import evaluate_engine
    from harness.gsm8k.settings import gsm8k_settings
    settings = gsm8k_settings(job.gsm8k["settings"])
    return evaluate_engine(engine, tokenizer, settings, job.gsm8k.get("data_path")).to_dict()


def run_job(job: Job) -> None:
    t0 = time.time()
    topo = Topology(tp=job.topology["tp"], dcp=job.topology["dcp"], speculator=job.topology["speculator"],
                    name=job.topology["name"])
    state = ParallelState.from_launcher(topo.tp, topo.dcp, job.device, job.collective_timeout_s)
    t_init = time.time()
    spec = model_from_dict("job", job.model)
    tokenizer = load_tokenizer(spec)
    weights = load_weights(spec)
    engine = Engine(spec, weights, state, fault_flags(job.fault, topo), PoolSettings(**job.pool), job.dtype)
    t_load = time.time()
    _inject_failure(state.rank)
    cases = build_cases(job.prompts, tokenizer, job.seed, job.max_new_tokens, job.decode_prefix_tokens)
    sequences = [list(c.sequence_ids) for c in cases]
    prefill = engine.prefill_logits(sequences)
    decode = engine.decode_path(sequences, [c.decode_start for c in cases], [c.probe_positions for c in cases])
    gen = engine.generate([list(c.prompt_ids) for c in cases], job.max_new_tokens, job.top_k)
    spec_result, spec_entry = None, None
    spec_settings = SpeculativeSettings.from_mapping(job.speculative)
    if topo.speculator != "none":
        speculator = speculator_for(engine, topo.speculator, weights, spec_settings)
        spec_result = run_speculative_cases(engine, speculator, [list(c.prompt_ids) for c in cases],
                                            spec_settings.k, job.max_new_tokens)
        spec_entry = speculator.layout_entry(state.gather_objects(speculator.layout_report()))
    gsm8k = _run_gsm8k(job, engine, tokenizer)
    t_run = time.time()
    layouts = state.gather_objects(engine.layout_report())
    if state.rank == 0:
        tensors: dict[str, torch.Tensor] = {}
        done: list[Case] = []
        for c, p, d, toks, ids, lps in zip(cases, prefill, decode, gen.tokens, gen.topk_ids, gen.topk_logprobs):
            tensors.update({f"prefill_logits.{c.index}": p, f"decode_logits.{c.index}": d.logits,
                            f"hidden.{c.index}": d.hidden, f"attn.{c.index}": d.attn,
                            f"collectives.{c.index}": d.collectives,
                            f"gen_tokens.{c.index}": torch.tensor(toks, dtype=torch.long),
                            f"gen_topk_ids.{c.index}": ids, f"gen_topk_logprobs.{c.index}": lps})
            done.append(replace(c, generated_ids=tuple(toks), generated_text=tokenizer.decode(toks)))
        layout = {"target": {"ranks": layouts, "pool": engine.pool.to_dict()}, "speculator": spec_entry}
        manifest = {
            "status": "ok", "error": None, "topology": topo.to_dict(), "model": spec.to_dict(),
            "fault": job.fault, "seed": job.seed, "dtype": job.dtype or spec.dtype,
            "weights_hash": weights_hash(weights), "engine_version": ENGINE_VERSION,
            "prompts_hash": hashlib.sha256(json.dumps([c.sequence_ids for c in cases]).encode()).hexdigest(),
            "versions": {"harness": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "device": job.device if job.device == "cpu" else torch.cuda.get_device_name(),
            "git_commit": job.git_commit, "host": platform.node(),
            "wall_s": {"init": t_init - t0, "load": t_load - t_init, "run": t_run - t_load,
                       "total": time.time() - t0},
        }
        if spec_result is not None:
            tensors.update(spec_tensors(spec_result, [c.index for c in cases]))  # spec_tokens.{i}, spec_accepted.{i}
            manifest["speculative"] = spec_manifest(spec_result, spec_settings)
        if gsm8k is not None:
            write_json(Path(job.out_dir) / GSM8K_FILE, gsm8k)
        write_run(Path(job.out_dir), manifest, layout, done, tensors)
    state.barrier()
    state.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m harness.engine.worker JOB.json", file=sys.stderr)
        return 2
    run_job(Job.load(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
