"""The generation part of a run with workloads (Job.workloads), on the embedded engine in lockstep.

Every case is generated twice: once in one plain batch (the schedule twin: all at once, whole prompts,
no prefix cache, an ample KV pool) and once as its workload sends it (harness/engine/scheduler.py);
a workload without any route of its own (all at once, nothing else) takes the twin's generation. Each
scheduled generation is then re-prefilled (prompt + new tokens, one forward) for decode_consistency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from harness import contract as c_
from harness.artifacts import Case
from harness.cases import WorkloadCases
from harness.engine.engine import DecodePath, Engine
from harness.engine.scheduler import ServeSettings, ServingLoop


def topk_of(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, V] logits -> ([T, k] int64 ids, [T, k] float32 log-probabilities), best first."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [T, V]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [T, k]
    return top.indices.to(torch.long), top.values.to(torch.float32)


LONG_SEQUENCE = 128  # teacher-forced paths of a workload run: sequences longer than this run in their own batch


def length_buckets(lengths: Sequence[int], limit: int = LONG_SEQUENCE) -> list[list[int]]:
    """Indices of `lengths` in two batches, those up to `limit` tokens and the longer ones, so the short
    prompts are not padded to the long ones' length (one more decode loop, far less padded compute)."""
    short = [i for i, n in enumerate(lengths) if n <= limit]
    long = [i for i, n in enumerate(lengths) if n > limit]
    return [b for b in (short, long) if b]


def teacher_forced(engine: Engine, cases: Sequence[Case]) -> tuple[list[torch.Tensor], list[DecodePath]]:
    """engine.prefill_logits and engine.decode_path of every case, batched by length_buckets."""
    prefill: list[torch.Tensor | None] = [None] * len(cases)
    decode: list[DecodePath | None] = [None] * len(cases)
    for bucket in length_buckets([len(c.sequence_ids) for c in cases]):
        seqs = [list(cases[i].sequence_ids) for i in bucket]
        pre = engine.prefill_logits(seqs)
        dec = engine.decode_path(seqs, [cases[i].decode_start for i in bucket],
                                 [cases[i].probe_positions for i in bucket])
        for j, i in enumerate(bucket):
            prefill[i], decode[i] = pre[j], dec[j]
    return [p for p in prefill if p is not None], [d for d in decode if d is not None]


@dataclass
class WorkloadGeneration:
    """Per case index: the scheduled generation (tokens, top-k ids, logprobs), and the extra tensors
    (twin_*, reprefill_*) and the manifest's per-workload engine stats."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    topk_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    topk_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_workloads(engine: Engine, groups: Sequence[WorkloadCases], top_k: int) -> WorkloadGeneration:
    key = c_.tensor_key
    cases = [case for g in groups for case in g.cases]
    new = {case.index: len(case.sequence_ids) - len(case.prompt_ids) for case in cases}
    twin_loop = ServingLoop(engine)
    twin = twin_loop.generate([list(case.prompt_ids) for case in cases], [new[case.index] for case in cases], top_k)
    out = WorkloadGeneration()
    for j, case in enumerate(cases):
        out.tensors[key(c_.TWIN_TOKENS, case.index)] = torch.tensor(twin.tokens[j], dtype=torch.long)
        out.tensors[key(c_.TWIN_TOPK_IDS, case.index)] = twin.topk_ids[j].clone()  # safetensors: no shared memory
        out.tensors[key(c_.TWIN_TOPK_LOGPROBS, case.index)] = twin.topk_logprobs[j].clone()
    position = {case.index: j for j, case in enumerate(cases)}
    for g in groups:
        settings = ServeSettings.from_mapping(g.workload.engine_settings())
        if settings == ServeSettings():
            for case in g.cases:
                j = position[case.index]
                out.tokens[case.index] = twin.tokens[j]
                out.topk_ids[case.index], out.topk_logprobs[case.index] = twin.topk_ids[j], twin.topk_logprobs[j]
            out.stats[g.workload.name] = {"twin": True, **twin_loop.stats.to_dict()}
            continue
        loop = ServingLoop(engine, settings)
        gen = loop.generate([list(case.prompt_ids) for case in g.cases], [new[case.index] for case in g.cases], top_k)
        for j, case in enumerate(g.cases):
            out.tokens[case.index] = gen.tokens[j]
            out.topk_ids[case.index], out.topk_logprobs[case.index] = gen.topk_ids[j], gen.topk_logprobs[j]
        out.stats[g.workload.name] = {"twin": False, **loop.stats.to_dict()}
    _reprefill(engine, cases, out, top_k)
    return out


def _reprefill(engine: Engine, cases: Sequence[Any], out: WorkloadGeneration, top_k: int) -> None:
    """Top-k of the prefill path over prompt + generated tokens at each generated step (the step's
    input is the prompt's last token, then each new token but the last)."""
    done = [case for case in cases if out.tokens[case.index]]
    sequences = [list(case.prompt_ids) + out.tokens[case.index][:-1] for case in done]
    logits_of: dict[int, torch.Tensor] = {}
    for bucket in length_buckets([len(s) for s in sequences]):
        logits_of.update(zip(bucket, engine.prefill_logits([sequences[i] for i in bucket])))
    for j, case in enumerate(done):
        logits = logits_of[j]
        n = len(out.tokens[case.index])
        ids, lps = topk_of(logits[len(case.prompt_ids) - 1:len(case.prompt_ids) - 1 + n], top_k)  # [n, k]
        out.tensors[c_.tensor_key(c_.REPREFILL_TOPK_IDS, case.index)] = ids
        out.tensors[c_.tensor_key(c_.REPREFILL_TOPK_LOGPROBS, case.index)] = lps
