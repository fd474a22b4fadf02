"""The per-rank entry point: `python -m harness.backends.embedded.worker JOB.json`, started by torchrun (or
directly at world size 1). Joins the process group, builds the engine, runs every case of the job in
lockstep, and rank 0 writes the run directory.

`--topk K` is the top-k-only mode (backend `embedded-topk`): the run withholds full logits, hidden
states and attention outputs and writes the top-K log-probabilities of both teacher-forced paths
instead, as an engine that only returns top-k logprobs would (harness/records/contract.py)."""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from harness import __version__
from harness.backends.embedded.worker_pd import PD_ROLES, DecodeSide, run_prefill_world
from harness.backends.embedded.workload_run import run_workloads, sample_draws, teacher_forced
from harness.cases import WorkloadCases, build_cases, build_workload_cases, prompts_hash, workload_manifest
from harness.core.jsonio import write_json
from harness.engine import ENGINE_VERSION
from harness.engine.runtime.construct import build_engine
from harness.engine.runtime.engine import Engine, Generation, PrefixLoader
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate, run_speculative_cases
from harness.engine.speculative.decoding import SpecResult, spec_manifest, spec_tensors
from harness.engine.speculative.speculator import Speculator
from harness.formats.tokenizer import Tokenizer, tokenizer_hash
from harness.formats.weights import weights_hash
from harness.records import contract as c_
from harness.records.artifacts import Case, write_run
from harness.records.contract import Job
from harness.records.rankreport import entry_json
from harness.specs.speculative import SpeculativeSettings
from harness.specs.workload import WorkloadPlan

INJECT_ENV = "HARNESS_INJECT_RANK_FAILURE"  # "crash|hang|kill|stop:R": test hook for the launcher's error path


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, V] logits -> ([T, k] int64 ids, [T, k] float32 log-probabilities), best first."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [T, V]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [T, k]
    return top.indices.to(torch.long), top.values.to(torch.float32)


def _case_tensors(index: int, prefill: torch.Tensor, decode: Any, topk_only: int | None) -> dict[str, torch.Tensor]:
    """The teacher-forced tensors of one case: full logits, hidden states and attention outputs, or
    in the top-k-only mode only the top-k log-probabilities of both paths."""
    key = c_.tensor_key
    if topk_only is None:
        return {key(c_.PREFILL_LOGITS, index): prefill, key(c_.DECODE_LOGITS, index): decode.logits,
                key(c_.HIDDEN, index): decode.hidden, key(c_.ATTN, index): decode.attn,
                key(c_.COLLECTIVES, index): decode.collectives}
    pre_ids, pre_lps = topk_logprobs(prefill, topk_only)
    dec_ids, dec_lps = topk_logprobs(decode.logits, topk_only)
    return {key(c_.PREFILL_TOPK_IDS, index): pre_ids, key(c_.PREFILL_TOPK_LOGPROBS, index): pre_lps,
            key(c_.DECODE_TOPK_IDS, index): dec_ids, key(c_.DECODE_TOPK_LOGPROBS, index): dec_lps}


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
        if mode in ("kill", "stop"):  # as `kill -9` / `kill -STOP` of the rank from outside
            os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


def _run_gsm8k(job: Job, engine: Engine, tokenizer: Tokenizer) -> dict[str, Any] | None:
    """GSM8K through lm-eval on this engine, in lockstep on every rank (lm-eval imported only here)."""
    if not job.gsm8k:
        return None
    from harness.backends.embedded.gsm8k import evaluate_engine
    from harness.gsm8k.settings import gsm8k_settings
    settings = gsm8k_settings(job.gsm8k.settings)
    return evaluate_engine(engine, tokenizer, settings, job.gsm8k.data_path).to_dict()


def run_job(job: Job, topk_only: int | None = None, pd_role: str | None = None, pd_store: Path | None = None,
            batch_invariant: bool = False) -> None:
    """One rank's run of `job` (`batch_invariant`: the engine's batch-invariant mode, every request's forward
    alone). `pd_role` (a disaggregated topology's two launches): `prefill` runs the
    prefill world (its prompts' KV into `pd_store`, worker_pd.run_prefill_world), `decode` this run with
    each prompt's KV loaded from `pd_store` (worker_pd.DecodeSide)."""
    if pd_role == "prefill" and pd_store is not None:
        run_prefill_world(job, pd_store)
        return
    t0 = time.time()
    topo = job.topology
    state = ParallelState.from_launcher(topo.tp, topo.dcp, job.device, job.collective_timeout_s)
    t_init = time.time()
    spec = job.model
    spec_settings = job.speculative or SpeculativeSettings()
    built = build_engine(state, spec, topo, job.fault, job.pool, job.dtype, spec_settings)
    engine, tokenizer, weights, speculator = built.engine, built.tokenizer, built.weights, built.speculator
    engine.batch_invariant = batch_invariant
    t_load = time.time()
    _inject_failure(state.rank)
    groups = (build_workload_cases(WorkloadPlan(job.workloads), job.prompts, tokenizer, job.seed,
                                   job.decode_prefix_tokens) if job.workloads else [])
    cases = ([case for g in groups for case in g.cases] if groups else
             build_cases(job.prompts, tokenizer, job.seed, job.max_new_tokens, job.decode_prefix_tokens))
    sequences = [list(c.sequence_ids) for c in cases]
    pd = DecodeSide.open(job, engine, pd_store) if pd_role == "decode" and pd_store is not None else None
    if pd is not None:
        pd.prefetch(len(cases))
    if groups:
        prefill, decode = teacher_forced(engine, cases, pd.loader("decode_path") if pd is not None else None)
    else:
        prefill = engine.prefill_logits(sequences)
        decode = engine.decode_path(sequences, [c.decode_start for c in cases], [c.probe_positions for c in cases],
                                    pd.loader("decode_path") if pd is not None else None)
    served = run_workloads(engine, groups, job.top_k, pd.loader if pd is not None else None) if groups else None
    draws = sample_draws(engine, groups, prefill, decode) if groups else {}
    gen = (Generation([served.tokens[c.index] for c in cases], [served.topk_ids[c.index] for c in cases],
                      [served.topk_logprobs[c.index] for c in cases]) if served is not None
           else generate(engine, [list(c.prompt_ids) for c in cases], job.max_new_tokens, job.top_k,
                         loader=pd.loader("generation") if pd is not None else None))
    spec_result, spec_entry = None, None
    if speculator is not None:
        spec_result = _speculate(engine, speculator, groups, cases, spec_settings.k, job.max_new_tokens,
                                 pd.loader("speculative") if pd is not None else None)
        spec_entry = speculator.layout_entry(state.gather_objects(speculator.layout_report()))
    gsm8k = _run_gsm8k(job, engine, tokenizer)
    t_run = time.time()
    layouts = state.gather_objects(engine.layout_report())
    if state.rank == 0:
        tensors: dict[str, torch.Tensor] = {}
        done: list[Case] = []
        for c, p, d, toks, ids, lps in zip(cases, prefill, decode, gen.tokens, gen.topk_ids, gen.topk_logprobs):
            tensors.update(_case_tensors(c.index, p, d, topk_only))
            tensors.update({c_.tensor_key(c_.GEN_TOKENS, c.index): torch.tensor(toks, dtype=torch.long),
                            c_.tensor_key(c_.GEN_TOPK_IDS, c.index): ids,
                            c_.tensor_key(c_.GEN_TOPK_LOGPROBS, c.index): lps})
            done.append(replace(c, generated_ids=tuple(toks), generated_text=tokenizer.decode(toks)))
        layout = {"target": entry_json(layouts, engine.pool.to_dict()), "speculator": spec_entry}
        manifest = {
            "status": "ok", "error": None, "topology": topo.to_dict(), "model": spec.to_dict(),
            "fault": job.fault, "seed": job.seed, "dtype": job.dtype or spec.dtype,
            c_.MANIFEST_WEIGHTS_HASH: weights_hash(weights), "engine_version": ENGINE_VERSION,
            c_.MANIFEST_PROMPTS_HASH: prompts_hash(cases),
            c_.MANIFEST_TOKENIZER_HASH: tokenizer_hash(tokenizer), "topk_only": topk_only,
            "versions": {"harness": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "device": job.device if job.device == "cpu" else torch.cuda.get_device_name(),
            "git_commit": job.git_commit, "host": platform.node(), "threads_per_rank": torch.get_num_threads(),
            "collectives": state.collectives_path,
            "wall_s": {"init": t_init - t0, "load": t_load - t_init, "run": t_run - t_load,
                       "total": time.time() - t0},
        }
        if served is not None:
            tensors.update(served.tensors)  # twin_*.{i}, reprefill_topk_*.{i}
            tensors.update(draws)  # sample_prefill.{i}, sample_decode.{i} of sampling workloads
            manifest["workloads"] = [{**entry, "stats": served.stats[entry["name"]]}
                                     for entry in workload_manifest(groups)]
        if spec_result is not None:
            tensors.update(spec_tensors(spec_result, [c.index for c in cases]))  # spec_tokens.{i}, spec_accepted.{i}
            manifest["speculative"] = spec_manifest(spec_result, spec_settings)
        if gsm8k is not None:
            write_json(Path(job.out_dir) / c_.GSM8K_FILE, gsm8k)
        write_run(Path(job.out_dir), manifest, layout, done, tensors)
    if pd is not None:
        pd.finish(Path(job.out_dir))
    state.barrier()
    state.shutdown()


def _speculate(engine: Engine, speculator: Speculator, groups: Sequence[WorkloadCases], cases: Sequence[Case], k: int,
               max_new_tokens: int, loader: PrefixLoader | None = None) -> SpecResult:
    """Greedy speculative generation of every case, each workload's cases for that workload's new tokens
    (as its plain generation), in case order (`loader`: a disaggregated run's KV source, by case position)."""
    batches = ([(g.cases, g.workload.new_tokens or max_new_tokens) for g in groups] if groups
               else [(tuple(cases), max_new_tokens)])
    at = {c.index: j for j, c in enumerate(cases)}
    parts = [run_speculative_cases(engine, speculator, [list(c.prompt_ids) for c in batch], k, n,
                                   loader=_at_positions(loader, [at[c.index] for c in batch]) if loader else None)
             for batch, n in batches if batch]
    return SpecResult(kind=parts[0].kind, k=parts[0].k, tokens=[t for p in parts for t in p.tokens],
                      accepted=[a for p in parts for a in p.accepted], wall_s=sum(p.wall_s for p in parts),
                      drafts=[d for p in parts for d in p.drafts])


def _at_positions(loader: PrefixLoader, positions: list[int]) -> PrefixLoader:
    """`loader` for a batch of some cases: its prompt i is the case at positions[i] among every case."""
    def load(seq_id: int, index: int, tokens: list[int]) -> int:
        return loader(seq_id, positions[index], tokens)
    return load


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.backends.embedded.worker")
    parser.add_argument("job", type=Path, help="job.json written by the launcher")
    parser.add_argument("--topk", type=int, default=None, metavar="K",
                        help="top-k-only mode: write top-K logprobs instead of full logits and hidden states")
    parser.add_argument("--pd-role", choices=PD_ROLES, default=None,
                        help="a disaggregated topology's world: prefill (KV into the store) or decode (KV from it)")
    parser.add_argument("--pd-store", type=Path, default=None, help="the KV store folder of a disaggregated run")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the batch-invariant mode: every request's forward runs alone (embedded:batch-invariant)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.topk is not None and args.topk < 1:
        parser.error(f"--topk={args.topk} must be >= 1")
    if (args.pd_role is None) != (args.pd_store is None):
        parser.error("--pd-role and --pd-store go together")
    run_job(Job.load(args.job), args.topk, args.pd_role, args.pd_store, args.batch_invariant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
