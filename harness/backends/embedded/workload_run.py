"""The generation part of a run with workloads (Job.workloads), on the embedded engine in lockstep.

Every case is generated twice: once in one plain batch (the schedule twin: all at once, whole prompts,
no prefix cache, an ample KV pool) and once as its workload sends it (harness/engine/runtime/scheduler.py);
a workload without any route of its own (all at once, nothing else, greedy) takes the twin's generation. Each
scheduled generation is then re-prefilled (prompt + new tokens, one forward) for decode_consistency. A sampling
workload's lane samples (each request from its own seeded generator), and its cases' teacher-forced logits of
both paths are drawn from n times per position by the same sampler (sample_draws)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from harness.cases import WorkloadCases
from harness.engine.runtime.engine import DecodePath, Engine, PrefixLoader, length_buckets
from harness.engine.runtime.sampler import Sampler
from harness.engine.runtime.scheduler import Lane, ServeSettings, ServingLoop, sampler_for
from harness.records import contract as c_
from harness.records.artifacts import Case


def topk_of(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, V] logits -> ([T, k] int64 ids, [T, k] float32 log-probabilities), best first."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)  # [T, V]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [T, k]
    return top.indices.to(torch.long), top.values.to(torch.float32)


def teacher_forced(engine: Engine, cases: Sequence[Case],
                   loader: PrefixLoader | None = None) -> tuple[list[torch.Tensor], list[DecodePath]]:
    """engine.prefill_logits of every case batched by length_buckets, and engine.decode_path in one batch
    (`loader`: a disaggregated run's source of each decode start's KV, by position in `cases`)."""
    prefill: list[torch.Tensor | None] = [None] * len(cases)
    for bucket in length_buckets([len(c.sequence_ids) for c in cases]):
        for i, logits in zip(bucket, engine.prefill_logits([list(cases[i].sequence_ids) for i in bucket])):
            prefill[i] = logits
    decode = engine.decode_path([list(c.sequence_ids) for c in cases], [c.decode_start for c in cases],
                                [c.probe_positions for c in cases], loader)  # one batch: one step per token
    return [p for p in prefill if p is not None], decode


@dataclass
class WorkloadGeneration:
    """Per case index: the scheduled generation (tokens, top-k ids, logprobs), and the extra tensors
    (twin_*, reprefill_*) and the manifest's per-workload engine stats."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    topk_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    topk_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_workloads(engine: Engine, groups: Sequence[WorkloadCases], top_k: int,
                  loader_of: Callable[[str], PrefixLoader] | None = None) -> WorkloadGeneration:
    """One serving loop over every lane at once: the twin (every case, plain settings) and each workload
    with an engine route of its own; the engine batches all their rows per step, as a server would.
    `loader_of` (a disaggregated run): the KV source of a route's prompts (the twin's route "generation",
    a routed workload's its name), each request named by its position among every group's cases."""
    key = c_.tensor_key
    cases = [case for g in groups for case in g.cases]
    new = {case.index: len(case.sequence_ids) - len(case.prompt_ids) for case in cases}
    routed = [g for g in groups if ServeSettings.from_mapping(g.workload.engine_settings()) != ServeSettings()
              or g.workload.sampling is not None]
    at = {case.index: j for j, case in enumerate(cases)}
    lanes = [Lane([list(c.prompt_ids) for c in cases], [new[c.index] for c in cases], ServeSettings(split_long=True),
                  loader=loader_of("generation") if loader_of is not None else None)]
    lanes += [Lane([list(c.prompt_ids) for c in g.cases], [new[c.index] for c in g.cases],
                   replace(ServeSettings.from_mapping(g.workload.engine_settings()), split_long=True),
                   loader=_by_position(loader_of(g.workload.name), [at[c.index] for c in g.cases])
                   if loader_of is not None else None, sampler=sampler_of(engine, g), seeds=g.workload.request_seeds())
              for g in routed]
    (twin, twin_stats), *served = ServingLoop(engine).run(lanes, top_k)
    out = WorkloadGeneration()
    position = {case.index: j for j, case in enumerate(cases)}
    for j, case in enumerate(cases):
        out.tensors[key(c_.TWIN_TOKENS, case.index)] = torch.tensor(twin.tokens[j], dtype=torch.long)
        out.tensors[key(c_.TWIN_TOPK_IDS, case.index)] = twin.topk_ids[j].clone()  # safetensors: no shared memory
        out.tensors[key(c_.TWIN_TOPK_LOGPROBS, case.index)] = twin.topk_logprobs[j].clone()
    for g in groups:
        if g not in routed:
            for case in g.cases:
                j = position[case.index]
                out.tokens[case.index] = twin.tokens[j]
                out.topk_ids[case.index], out.topk_logprobs[case.index] = twin.topk_ids[j], twin.topk_logprobs[j]
            out.stats[g.workload.name] = {"twin": True, **twin_stats.to_dict()}
    for g, (gen, stats) in zip(routed, served):
        for j, case in enumerate(g.cases):
            out.tokens[case.index] = gen.tokens[j]
            if gen.uniforms:
                out.tensors[key(c_.SAMPLE_UNIFORMS, case.index)] = torch.tensor(gen.uniforms[j], dtype=torch.float64)
            out.topk_ids[case.index], out.topk_logprobs[case.index] = gen.topk_ids[j], gen.topk_logprobs[j]
        out.stats[g.workload.name] = {"twin": False, **stats.to_dict()}
    _reprefill(engine, cases, out, top_k)
    return out


def sampler_of(engine: Engine, group: WorkloadCases) -> Sampler | None:
    """The engine's sampler for a workload with sampling settings (None: greedy), with the fault's slip."""
    params = group.workload.sampling
    return None if params is None else sampler_for(engine, params)


PATH_SALT = {c_.SAMPLE_PREFILL: 1, c_.SAMPLE_DECODE: 2}  # each path's draws from generators of their own


def sample_draws(engine: Engine, groups: Sequence[WorkloadCases], prefill: Sequence[torch.Tensor],
                 decode: Sequence[DecodePath]) -> dict[str, torch.Tensor]:
    """sample_prefill.{i} / sample_decode.{i} [W, S, n] of every sampling workload's case i: at each position
    that picks a new token (the prompt's last .. the sequence's last but one), n draws of this rank's sampler
    from that path's logits, history prompt + the teacher-forced tokens so far, one generator per position
    (seeded by the request's seed, the position and the path); every rank's draws, gathered in rank order
    (one gather for them all). `prefill` / `decode` are in the order of every group's cases."""
    mine: dict[str, torch.Tensor] = {}  # key -> this rank's draws [S, n]
    position = 0
    for g in groups:
        sampler = sampler_of(engine, g)
        seeds = g.workload.request_seeds()
        for j, case in enumerate(g.cases):
            at = position + j
            if sampler is None:
                continue
            first, last = len(case.prompt_ids) - 1, len(case.sequence_ids) - 1
            steps = range(first, last)
            prompts = [case.prompt_ids] * len(steps)
            outputs = [case.sequence_ids[first + 1:t + 1] for t in steps]
            start = case.decode_start
            paths = [(c_.SAMPLE_PREFILL, prefill[at][first:last])]  # [S, V]
            if start <= first:  # the decode path covers every sampled position
                paths.append((c_.SAMPLE_DECODE, decode[at].logits[first - start:last - start]))
            for kind, logits in paths:
                gens = [sampler.generator((seeds[j] * 4096 + t) * 4 + PATH_SALT[kind]) for t in steps]
                mine[c_.tensor_key(kind, case.index)] = sampler.sample(logits, prompts, outputs, gens,
                                                                      sampler.params.n)  # [S, n]
        position += len(g.cases)
    if not mine:
        return {}
    ranks = engine.state.gather_objects(mine)  # [W] of key -> [S, n]
    return {key: torch.stack([r[key] for r in ranks]) for key in mine}  # key -> [W, S, n]


def _by_position(loader: PrefixLoader, positions: list[int]) -> PrefixLoader:
    """`loader` for a lane of some cases: its request i is the case at positions[i] among every case."""
    def load(seq_id: int, index: int, tokens: list[int]) -> int:
        return loader(seq_id, positions[index], tokens)
    return load


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
