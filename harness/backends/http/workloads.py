"""An HTTP run with workloads (Job.workloads): each workload's cases sent to the server as the workload
schedules them, and the extra requests the workload checks read.

Per workload, in plan order (harness/cases.py build_workload_cases: the same cases, token ids and indices
as the embedded engine's):
- its cases' teacher-forced top-k (prefill path) and greedy generations, one request per case sent by the
  workload's schedule (http_send: one-at-a-time, all-at-once, or staggered waves of `join_per_step`), so the
  server's batch composition really changes; each request's order and times are recorded;
- for a workload with a route (Workload.route), the schedule twin: the same prompts generated once more in
  one request (one batch, twin_*);
- every generation re-prefilled (prompt + generated tokens, one scoring request, reprefill_topk_*) for
  decode_consistency;
- a sampled workload (Workload.sampling): its generations sampled, each request with its seed, and at every
  teacher-forced position that picks a new token (the prompt's last .. the sequence's last but one) n draws of the
  next token, the prompt and the teacher-forced tokens so far sent as one prompt (the prefill path; the penalties see
  them all as prompt), as sample_prefill [1, S, n]: the server answers its rank 0's draws. The draws' seeds depend on
  the topology too, so the reference's draws and the parallel run's are independent samples (the distribution
  check's two-sample test, harness/compare/sampling.py). The noise twin sends no draws.
A noise twin (a sequential job) sends every request one at a time. What the server did inside (its batches,
prefix-cache hits, chunks, preemptions) is not visible over HTTP: the workload's stats hold only what the
client saw (`source: client`, the most requests open at once), and the route checks say so
(harness/checks/workload_checks.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from harness.backends.http.collect import Collected, send_cases
from harness.backends.http.dialects import Dialect, Scored
from harness.backends.http.send import ONE_AT_A_TIME, SendLog, SendSchedule
from harness.cases import WorkloadCases, build_cases, build_workload_cases, prompts_hash, workload_manifest
from harness.formats.tokenizer import Tokenizer, load_tokenizer, tokenizer_hash
from harness.formats.weights import load_weights, weights_hash
from harness.records import contract as c
from harness.records.artifacts import Case
from harness.records.contract import Job
from harness.specs.sampling import SamplingParams
from harness.specs.workload import WorkloadPlan


@dataclass
class WorkloadAnswers:
    """Everything the workloads' requests answered: tensors by contract key, the cases with their
    generations, the non-finite logprobs (contract.MANIFEST_LOGPROB_VALUES) and the manifest's
    `workloads` entry (workload_manifest, each with its stats and request record)."""

    cases: list[Case] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nonfinite: list[dict[str, Any]] = field(default_factory=list)
    manifest: list[dict[str, Any]] = field(default_factory=list)


def workload_groups(job: Job, tokenizer: Tokenizer) -> list[WorkloadCases]:
    """The job's workloads and their cases, as every backend builds them."""
    return build_workload_cases(WorkloadPlan(job.workloads), job.prompts, tokenizer, job.seed,
                                job.decode_prefix_tokens)


def case_groups(job: Job, tokenizer: Tokenizer) -> list[tuple[list[Case], int]]:
    """The job's cases in groups that generate alike: (cases, new tokens) per workload, or the suite's
    prompts as one group of max_new_tokens without workloads."""
    if not job.workloads:
        return [(build_cases(job.prompts, tokenizer, job.seed, job.max_new_tokens, job.decode_prefix_tokens),
                 job.max_new_tokens)]
    return [(list(g.cases), g.workload.new_tokens) for g in workload_groups(job, tokenizer)]


def reprefill_rows(scored: Scored, prompt_len: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a score of prompt + generated tokens that predict each generated token: [steps, k] ids
    and logprobs (row t of a score predicts token t + 1, so generated step j is row prompt_len - 1 + j)."""
    rows = slice(prompt_len - 1, prompt_len - 1 + steps)
    return scored.ids[rows].clone(), scored.logprobs[rows].clone()  # [steps, k] each


def draw_seed(topology: str, request_seed: int, step: int, n: int) -> int:
    """The seed of one position's draws (draw j: seed + j), distinct per topology, request and step: n times a 40-bit
    hash, so two positions' seed ranges do not overlap (but by a hash collision)."""
    digest = hashlib.sha256(f"{topology}/{request_seed}/{step}".encode()).digest()
    return int.from_bytes(digest[:5], "big") * n


def send_draws(dialect: Dialect, cases: Sequence[Case], params: SamplingParams, seeds: Sequence[int],
               topology: str) -> dict[str, torch.Tensor]:
    """sample_prefill.{i} [1, S, n] of every case: n draws at each position that picks a new token (module
    docstring)."""
    out: dict[str, torch.Tensor] = {}
    for case, seed in zip(cases, seeds):
        first, last = len(case.prompt_ids) - 1, len(case.sequence_ids) - 1
        draws = [dialect.draw(case.sequence_ids[:t + 1], params, draw_seed(topology, seed, t, params.n), params.n)
                 for t in range(first, last)]
        out[c.tensor_key(c.SAMPLE_PREFILL, case.index)] = torch.tensor(draws, dtype=torch.long).reshape(
            1, len(draws), params.n)
    return out


def _nonfinite(index: int, kind: str, bad: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [{"case": index, "kind": kind, **b} for b in bad]


def collect_workloads(job: Job, dialect: Dialect, k: int, together: bool) -> Collected:
    """Send every workload of `job` (module docstring); `k`: the score requests' top-k, `together`: whether
    the one-request parts (twin, re-prefill) go as one request or one by one (the noise twin)."""
    tokenizer = load_tokenizer(job.model)
    answers = send_workloads(job, tokenizer, dialect, k, together)
    return Collected(cases=answers.cases, tensors=answers.tensors, weights_hash=weights_hash(load_weights(job.model)),
                     prompts_hash=prompts_hash(answers.cases), tokenizer_hash=tokenizer_hash(tokenizer),
                     nonfinite=tuple(answers.nonfinite), workloads=answers.manifest)


def send_workloads(job: Job, tokenizer: Tokenizer, dialect: Dialect, k: int, together: bool) -> WorkloadAnswers:
    """Every workload's requests and their answers (collect_workloads)."""
    groups = workload_groups(job, tokenizer)
    out = WorkloadAnswers()
    entries = workload_manifest(groups)
    key = c.tensor_key
    for group, entry in zip(groups, entries):
        w, cases = group.workload, list(group.cases)
        schedule = (SendSchedule.from_workload(w.to_dict()) if together else SendSchedule(ONE_AT_A_TIME))
        log = SendLog(schedule)
        seeds = w.request_seeds()
        scored, generated = send_cases(dialect, cases, k, w.new_tokens, job.top_k, together, log, w.sampling, seeds)
        if w.sampling is not None and together:
            out.tensors.update(send_draws(dialect, cases, w.sampling, seeds, job.topology.name))
        twin = (dialect.generate([case.prompt_ids for case in cases], w.new_tokens, job.top_k, together)
                if w.route else generated)
        reprefill = dialect.score([case.prompt_ids + tuple(int(t) for t in g.tokens) for case, g in
                                   zip(cases, generated)], k, together)
        for case, s, g, t, r in zip(cases, scored, generated, twin, reprefill):
            i = case.index
            out.tensors.update({key(c.PREFILL_TOPK_IDS, i): s.ids, key(c.PREFILL_TOPK_LOGPROBS, i): s.logprobs,
                                key(c.GEN_TOKENS, i): g.tokens, key(c.GEN_TOPK_IDS, i): g.ids,
                                key(c.GEN_TOPK_LOGPROBS, i): g.logprobs})
            out.tensors.update({key(c.TWIN_TOKENS, i): t.tokens.clone(), key(c.TWIN_TOPK_IDS, i): t.ids.clone(),
                                key(c.TWIN_TOPK_LOGPROBS, i): t.logprobs.clone()})  # safetensors: no shared memory
            ids, lps = reprefill_rows(r, len(case.prompt_ids), int(g.tokens.numel()))
            out.tensors.update({key(c.REPREFILL_TOPK_IDS, i): ids, key(c.REPREFILL_TOPK_LOGPROBS, i): lps})
            out.nonfinite += (_nonfinite(i, c.PREFILL_TOPK_LOGPROBS, s.nonfinite)
                              + _nonfinite(i, c.GEN_TOPK_LOGPROBS, g.nonfinite)
                              + (_nonfinite(i, c.TWIN_TOPK_LOGPROBS, t.nonfinite) if w.route else [])
                              + _nonfinite(i, c.REPREFILL_TOPK_LOGPROBS, r.nonfinite))
            tokens = [int(x) for x in g.tokens]
            out.cases.append(replace(case, generated_ids=tuple(tokens), generated_text=tokenizer.decode(tokens)))
        record = log.to_dict()
        stats = {"twin": not w.route, "source": "client",
                 "max_in_flight_seen": record["max_in_flight_seen"].get("generate", 0)}
        out.manifest.append({**entry, "stats": stats, "requests": record})
    return out
