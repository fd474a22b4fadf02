"""Checks of speculative decoding (-draft / -mtp cells): lossless output and acceptance.

Run-directory inputs (written by the worker; see harness.engine.speculative.decoding):
  tensors  spec_tokens.{i}    [N] int64   greedy tokens generated with the speculator
           spec_accepted.{i}  [S] int64   accepted draft tokens (0..k) at each verify step
           spec_drafts.{i}    [S, k] int64 the proposals of each verify step (optional: localization)
           gen_tokens.{i}, gen_topk_ids.{i}, gen_topk_logprobs.{i}: plain greedy decoding, same run
  manifest "speculative": {"kind", "k", ...}

lossless: the speculator never changes greedy output, so spec_tokens must equal the same run's
  gen_tokens. A divergence is benign only at a near tie of the plain run (the speculative token is
  in its top-k with a logprob gap <= near_tie): verification runs the extend path, whose logits
  differ from one-token decode steps by float rounding.
acceptance: against the reference topology's run with the same speculator (tp1-draft / tp1-mtp).
  Accepted length of a step = accepted draft tokens + 1 (tokens committed per target forward).
  Both runs decode the same prompts to the same tokens (lossless), so they are paired, not samples:
  a correct parallel run proposes exactly what the reference proposed, up to float near ties of the
  speculator, and its per-step accept trace is the reference's. Hence two gates:
    - mean drop: FAIL when mean accepted length < reference - max(abs_floor, rel_floor x reference);
    - trace: FAIL when more than trace_fail_fraction of the prompts have an accept trace that differs
      from the reference's (the speculator computes something else, even when the mean holds: e.g.
      an MTP fed the wrong hidden states on a synthetic model, where the hidden carries little);
  and WARN when the histograms' total-variation distance exceeds tv_warn without a FAIL.
  A collapsed drafter leaves every accuracy gate green: this check is the only place it shows.
  The first differing verify step is localized (prompt, step, new-token index, what each run proposed,
  accepted and committed). An engine with only aggregate counters (HTTP: vLLM's spec-decode counters)
  gets the mean-drop gate alone. The stored baseline (harness/baselines/acceptance_baseline.py) is the
  acceptance check's second result, acceptance_baseline: it sees bugs the reference shares.
speculative_logprobs / speculative_consistency (an HTTP speculative server's answers, spec_topk_* and
  spec_reprefill_topk_*): each generated step's token and top-k logprobs against the plain server of the
  same setting (gen_*: tokens equal but at near ties of the plain run, top-1 logprob within the bound along
  the common tokens), and against a re-prefill of prompt + those tokens on the speculative server itself
  (the decode-time top-k that verification returned vs the prefill path's: the same context, so the same
  distribution). Noise: the same comparisons in the reference run (harness/compare/parity/schedule.py grade).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from harness.compare.parity.bounds import Bound
from harness.compare.parity.generation import first_divergence, noise_gap_error, top2_gaps
from harness.compare.parity.jumps import NO_EVIDENCE, JumpEvidence, JumpTest
from harness.compare.parity.schedule import (
    GEN,
    Pair,
    Steps,
    compare_consistency,
    compare_schedules,
    engine_evidence,
    grade,
    has_tensors,
    steps_of,
)
from harness.compare.parity.step_rounding import step_rounding
from harness.compare.settings import AcceptanceSettings, LosslessSettings, SpeculativeOutputSettings
from harness.core.acceptance import histogram, mean_accepted_length, total_variation
from harness.core.details import divergence_text
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import RunArtifacts
from harness.records.contract import (
    GEN_TOKENS,
    GEN_TOPK_IDS,
    GEN_TOPK_LOGPROBS,
    SPEC_ACCEPTED,
    SPEC_DRAFTS,
    SPEC_REPREFILL_TOPK_IDS,
    SPEC_REPREFILL_TOPK_LOGPROBS,
    SPEC_TOKENS,
    SPEC_TOPK_IDS,
    SPEC_TOPK_LOGPROBS,
    tensor_key,
)


def _lossless_case(index: int, spec: list[int], plain: list[int], topk_ids: torch.Tensor | None,
                   topk_logprobs: torch.Tensor | None, near_tie: float) -> dict[str, Any]:
    pos = first_divergence(plain, spec)
    out: dict[str, Any] = {"index": index, "tokens": len(plain), "spec_tokens": len(spec),
                           "first_divergence": pos, "benign": None}
    if pos is None:
        return out
    out.update({"benign": False, "plain_token": plain[pos] if pos < len(plain) else None,
                "spec_token": spec[pos] if pos < len(spec) else None, "gap": None})
    if topk_ids is None or topk_logprobs is None or out["plain_token"] is None or out["spec_token"] is None:
        return out
    if pos < topk_ids.shape[0]:
        hits = (topk_ids[pos] == spec[pos]).nonzero()
        if hits.numel():
            lps = topk_logprobs.to(torch.float64)
            gap = float(lps[pos, 0] - lps[pos, int(hits[0, 0])])
            out["gap"] = gap
            out["top2_gap"] = float(top2_gaps(lps[pos:pos + 1])[0])
            out["benign"] = gap <= near_tie
    return out


def check_lossless(spec_tokens: Sequence[Sequence[int]], plain_tokens: Sequence[Sequence[int]],
                   settings: LosslessSettings = LosslessSettings(),
                   plain_topk_ids: Sequence[torch.Tensor] | None = None,
                   plain_topk_logprobs: Sequence[torch.Tensor] | None = None,
                   indices: Sequence[int] | None = None, gap_noise: float | None = None,
                   evidence: JumpEvidence | None = None) -> CheckResult:
    """Speculative greedy tokens vs plain greedy tokens of the same run, prompt by prompt: a divergence is
    benign at a near tie of the plain run (gap <= max(near_tie, near_tie_factor x `gap_noise`, the noise
    run's top-2 gap error)); one outside (a jump) FAILs unless as frequent as `evidence`'s (compare/parity/jumps.py)."""
    if len(spec_tokens) != len(plain_tokens):
        return CheckResult("lossless", Verdict.ERROR, f"{len(spec_tokens)} speculative generations for "
                                                      f"{len(plain_tokens)} prompts")
    if not plain_tokens:
        return CheckResult("lossless", Verdict.SKIP, "no prompts")
    idx = list(indices) if indices is not None else list(range(len(plain_tokens)))
    tie = Bound(settings.near_tie, settings.near_tie_factor, gap_noise).limit
    cases = [_lossless_case(i, list(s), list(p), plain_topk_ids[j] if plain_topk_ids else None,
                            plain_topk_logprobs[j] if plain_topk_logprobs else None, tie)
             for j, (i, s, p) in enumerate(zip(idx, spec_tokens, plain_tokens))]
    diverged = [c for c in cases if c["first_divergence"] is not None]
    jumped = [c for c in diverged if not c["benign"]]
    steps = sum(c["tokens"] if c["first_divergence"] is None else c["first_divergence"] + 1 for c in cases)
    noise_jumps, noise_steps = (evidence or NO_EVIDENCE).counted(tie, settings.jumps_alpha)
    test = JumpTest(len(jumped), steps, noise_jumps, noise_steps, settings.jumps_alpha)
    bad = [] if test.benign else jumped
    n = len(cases)
    metrics: dict[str, Any] = {"prompts": n, "identical": n - len(diverged), "divergences": len(bad),
                               "benign_divergences": len(diverged) - len(bad), "near_tie": tie,
                               "tokens": sum(c["tokens"] for c in cases), "per_prompt": cases, **test.metrics()}
    if bad:
        c = bad[0]
        gap = ("not in the plain top-k" if c["gap"] is None
               else f"plain logprob gap {c['gap']:.1e} > {tie:.1e}")
        reason = (f"prompt {c['index']}: speculative output diverges from plain greedy at token "
                  f"{c['first_divergence']} ({c['spec_token']} vs {c['plain_token']}; {gap}); "
                  f"{len(bad)}/{n} prompts not lossless{test.note()}")
        return CheckResult("lossless", Verdict.FAIL, reason, metrics)
    if diverged:
        jumps = f"; {len(jumped)} jump as often as rounding does ({test.describe()})" if jumped else ""
        return CheckResult("lossless", Verdict.PASS, f"{n - len(diverged)}/{n} prompts identical; "
                           f"{len(diverged) - len(jumped)} diverge only at near ties (gap <= {tie:.1e}){jumps}",
                           metrics)
    return CheckResult("lossless", Verdict.PASS,
                       f"{n}/{n} prompts identical to plain greedy ({metrics['tokens']} tokens)", metrics)


# ---- acceptance ---------------------------------------------------------------------------------------------


def check_acceptance(ref_accepted: Sequence[Sequence[int]], par_accepted: Sequence[Sequence[int]], k: int,
                     settings: AcceptanceSettings = AcceptanceSettings(),
                     indices: Sequence[int] | None = None,
                     describe: Callable[[int, int], dict[str, Any]] | None = None,
                     outputs: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> CheckResult:
    """Mean accepted length, histogram and per-prompt accept traces of a parallel run vs the reference.
    describe(j, step): what each run did at the first differing verify step of the j-th prompt
    (trace_step_detail), shown in the metrics and the FAIL reason. outputs: each prompt's committed tokens
    (reference, parallel); a trace that differs only at a verify step whose context the two outputs no longer
    share (the target diverged first: lossless and generation judge that) is not the speculator's difference."""
    if len(ref_accepted) != len(par_accepted):
        return CheckResult("acceptance", Verdict.ERROR,
                           f"reference has {len(ref_accepted)} prompts, parallel {len(par_accepted)}")
    try:
        ref_hist, par_hist = histogram(ref_accepted, k), histogram(par_accepted, k)
    except RunError as exc:
        return CheckResult("acceptance", Verdict.ERROR, str(exc))
    ref_mean, par_mean = mean_accepted_length(ref_accepted), mean_accepted_length(par_accepted)
    if math.isnan(ref_mean) or math.isnan(par_mean):
        return CheckResult("acceptance", Verdict.SKIP, "no verify steps (max_new_tokens too small?)")
    idx = list(indices) if indices is not None else list(range(len(ref_accepted)))
    traces = [(i, first_divergence(list(r), list(p))) for i, r, p in zip(idx, ref_accepted, par_accepted)]
    if outputs is not None:  # a verify step on another context than the reference's compares nothing
        shared = [step is None or _same_context(ref_accepted[j], outputs[j], step)
                  for j, (_, step) in enumerate(traces)]
        traces = [(i, step if same else None) for (i, step), same in zip(traces, shared)]
        after_output = len(shared) - sum(shared)
    else:
        after_output = 0
    diverged = [(i, step) for i, step in traces if step is not None]
    floor = settings.floor(ref_mean)
    drop = ref_mean - par_mean
    tv = total_variation(ref_hist, par_hist)
    frac = len(diverged) / len(traces) if traces else 0.0
    first: dict[str, Any] | None = None
    if diverged:
        j = next(j for j, (_, step) in enumerate(traces) if step is not None)
        first = {"prompt": diverged[0][0], "step": diverged[0][1],
                 **(describe(j, diverged[0][1]) if describe is not None else {})}
    metrics: dict[str, Any] = {
        "k": k, "mean_accepted_length": par_mean, "reference_mean_accepted_length": ref_mean,
        "drop": drop, "floor": floor, "histogram": par_hist, "reference_histogram": ref_hist,
        "total_variation": tv, "steps": sum(par_hist), "reference_steps": sum(ref_hist),
        "acceptance_rate": (par_mean - 1) / k, "reference_acceptance_rate": (ref_mean - 1) / k,
        "traces_differ": len(diverged), "prompts": len(traces), "traces_after_output_divergence": after_output,
        "first_trace_divergence": first, "source": "traces"}
    means = f"mean accepted length {par_mean:.3f} vs reference {ref_mean:.3f}"
    traces_text = f"{len(diverged)}/{len(traces)} prompts' accept traces differ" + (
        f" (first: {divergence_text(first)})" if first is not None else "") + (
        f"; {after_output} more differ only after the outputs diverged" if after_output else "")
    if drop > floor:
        return CheckResult("acceptance", Verdict.FAIL, f"{means}: drop {drop:.3f} > floor {floor:.3f} "
                           f"(max({settings.abs_floor:g}, {settings.rel_floor:g} x ref)); {traces_text}", metrics)
    if frac > settings.trace_fail_fraction:
        return CheckResult("acceptance", Verdict.FAIL, f"{traces_text} from the reference, more than "
                           f"{settings.trace_fail_fraction:.0%}: the speculator proposes differently; {means}", metrics)
    if tv > settings.tv_warn:
        return CheckResult("acceptance", Verdict.WARN, f"{means}; histogram total-variation distance "
                           f"{tv:.3f} > {settings.tv_warn:g}; {traces_text}", metrics)
    return CheckResult("acceptance", Verdict.PASS, f"{means} (floor {floor:.3f}); {traces_text}", metrics)


def _same_context(accepted: Sequence[int], outputs: tuple[Sequence[int], Sequence[int]], step: int) -> bool:
    """Whether verify step `step` (the traces agree before it) ran on the same committed tokens in both runs."""
    start = 1 + sum(int(a) + 1 for a in accepted[:step])  # the prefill's token, then accepted + 1 per step
    ref, par = outputs
    return [int(t) for t in ref[:start]] == [int(t) for t in par[:start]]


def trace_step_detail(accepted: Sequence[int], tokens: Sequence[int], drafts: torch.Tensor | None,
                      step: int) -> dict[str, Any]:
    """What one run did at verify step `step`: accepted count, the k proposals (when the run recorded
    them) and the tokens it committed (accepted proposals + the target's own token)."""
    # the first new token comes from the prefill; each verify step then commits accepted + 1
    start = 1 + sum(a + 1 for a in accepted[:step])
    if step >= len(accepted):
        return {"accepted": None, "proposed": None, "committed": [], "start": start}
    a = int(accepted[step])
    proposed = ([int(t) for t in drafts[step].tolist()] if drafts is not None and step < drafts.shape[0]
                else None)
    return {"accepted": a, "proposed": proposed, "committed": [int(t) for t in tokens[start:start + a + 1]],
            "start": start}


def check_acceptance_aggregate(ref_mean: float, par_mean: float, k: int, settings: AcceptanceSettings,
                               source: str, kind: str = "") -> CheckResult:
    """The mean-drop gate alone, for engines that give only a mean accepted length (their Prometheus
    counters: 1 + accepted draft tokens / drafts) and no per-step traces. A `kind` of speculator that proposes at
    every verify step (a draft model, an MTP head) counting no drafts is a FAIL: speculation silently off."""
    if math.isnan(par_mean) and kind in ("draft", "mtp"):
        return CheckResult("acceptance", Verdict.FAIL, (
            f"the engine counted no drafts for the parallel run, though its {kind} speculator proposes k={k} tokens "
            f"at every verify step: speculative decoding was silently off (from {source})"),
            {"k": k, "kind": kind, "mean_accepted_length": None, "source": source})
    if math.isnan(ref_mean) or math.isnan(par_mean):
        who = " and ".join(w for w, m in (("the reference", ref_mean), ("the parallel run", par_mean)) if math.isnan(m))
        return CheckResult("acceptance", Verdict.SKIP, (
            f"the engine counted no drafts for {who}: its speculator proposed nothing for these prompts (an "
            "n-gram speculator finds no repeated n-grams in them) or max_new_tokens is too small"))
    floor = settings.floor(ref_mean)
    drop = ref_mean - par_mean
    metrics: dict[str, Any] = {"k": k, "mean_accepted_length": par_mean, "reference_mean_accepted_length": ref_mean,
                               "drop": drop, "floor": floor, "acceptance_rate": (par_mean - 1) / k,
                               "reference_acceptance_rate": (ref_mean - 1) / k, "source": source}
    means = (f"mean accepted length {par_mean:.3f} vs reference {ref_mean:.3f} (from {source}; no per-step "
             f"traces, so no trace or histogram comparison)")
    if drop > floor:
        return CheckResult("acceptance", Verdict.FAIL, f"{means}: drop {drop:.3f} > floor {floor:.3f} "
                           f"(max({settings.abs_floor:g}, {settings.rel_floor:g} x ref))", metrics)
    return CheckResult("acceptance", Verdict.PASS, f"{means}, floor {floor:.3f}", metrics)


# ---- from run directories ------------------------------------------------------------------------------------


def speculative_manifest(run: RunArtifacts) -> Mapping[str, Any] | None:
    entry = run.manifest.get("speculative")
    return entry if isinstance(entry, Mapping) else None


def _tokens(run: RunArtifacts, kind: str) -> list[list[int]]:
    return [[int(t) for t in run.tensor(kind, c.index).tolist()] for c in run.cases]


def lossless_from_run(par: RunArtifacts, settings: LosslessSettings = LosslessSettings(),
                      ref: RunArtifacts | None = None, noise: RunArtifacts | None = None) -> CheckResult:
    """The lossless check of one -draft / -mtp run directory; the near-tie bound and the jump evidence from
    the reference and its noise run where given (the plain generations' rounding)."""
    if speculative_manifest(par) is None:
        return CheckResult("lossless", Verdict.ERROR, "run has no speculative decoding results")
    try:
        spec, plain = _tokens(par, SPEC_TOKENS), _tokens(par, GEN_TOKENS)
        ids = [par.tensor(GEN_TOPK_IDS, c.index) for c in par.cases]
        lps = [par.tensor(GEN_TOPK_LOGPROBS, c.index) for c in par.cases]
    except RunError as exc:
        return CheckResult("lossless", Verdict.ERROR, str(exc))
    gap_noise, evidence = None, None
    if ref is not None:
        gap_noise, _ = noise_gap_error(ref, noise)
        try:
            evidence = engine_evidence(ref, noise)
        except RunError:
            evidence = None
    return check_lossless(spec, plain, settings, ids, lps, [c.index for c in par.cases], gap_noise, evidence)


def has_traces(run: RunArtifacts) -> bool:
    """Whether the run recorded the accepted count of every verify step (spec_accepted.{i})."""
    return bool(run.cases) and all(tensor_key(SPEC_ACCEPTED, c.index) in run.tensors for c in run.cases)


def counted_mean(run: RunArtifacts) -> float:
    """The mean accepted length an engine reported in aggregate (manifest speculative.mean_accepted_length,
    from its counters); NaN when it counted no verify step."""
    value = (speculative_manifest(run) or {}).get("mean_accepted_length")
    if value is None:
        return float("nan")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RunError(f"{run.path}: speculative.mean_accepted_length {value!r} is not a number")
    return float(value)


def _drafts(run: RunArtifacts, index: int) -> torch.Tensor | None:
    key = tensor_key(SPEC_DRAFTS, index)
    return run.tensors[key] if key in run.tensors else None


def acceptance_from_runs(ref: RunArtifacts, par: RunArtifacts,
                         settings: AcceptanceSettings = AcceptanceSettings()) -> CheckResult:
    """The acceptance check of a -draft / -mtp run against the reference run with the same speculator:
    per-step accept traces when both runs recorded them, else the engines' aggregate means."""
    ref_m, par_m = speculative_manifest(ref), speculative_manifest(par)
    if ref_m is None or par_m is None:
        who = "reference" if ref_m is None else "parallel"
        return CheckResult("acceptance", Verdict.ERROR, f"{who} run has no speculative decoding results")
    if (ref_m.get("kind"), ref_m.get("k")) != (par_m.get("kind"), par_m.get("k")):
        return CheckResult("acceptance", Verdict.ERROR, f"reference speculates with {ref_m.get('kind')} "
                           f"k={ref_m.get('k')}, parallel with {par_m.get('kind')} k={par_m.get('k')}")
    k = int(par_m["k"])
    try:
        if not (has_traces(ref) and has_traces(par)):
            silent = [who for who, run, m in (("reference", ref, ref_m), ("parallel", par, par_m))
                      if not has_traces(run) and m.get("source") == "none"]
            if silent:
                return CheckResult("acceptance", Verdict.SKIP, f"the {' and '.join(silent)} engine exported no "
                                   f"per-step traces and no spec-decode counters (vllm:spec_decode_num_*_total)")
            ref_mean = mean_accepted_length(_tokens(ref, SPEC_ACCEPTED)) if has_traces(ref) else counted_mean(ref)
            par_mean = mean_accepted_length(_tokens(par, SPEC_ACCEPTED)) if has_traces(par) else counted_mean(par)
            return check_acceptance_aggregate(ref_mean, par_mean, k, settings, "the engines' spec-decode counters",
                                              str(par_m.get("proposer", par_m.get("kind")) or ""))
        ref_acc, par_acc = _tokens(ref, SPEC_ACCEPTED), _tokens(par, SPEC_ACCEPTED)
        ref_tok, par_tok = _tokens(ref, SPEC_TOKENS), _tokens(par, SPEC_TOKENS)
    except RunError as exc:
        return CheckResult("acceptance", Verdict.ERROR, str(exc))
    cases = par.cases

    def describe(j: int, step: int) -> dict[str, Any]:
        r = trace_step_detail(ref_acc[j], ref_tok[j], _drafts(ref, cases[j].index), step)
        p = trace_step_detail(par_acc[j], par_tok[j], _drafts(par, cases[j].index), step)
        return {"position": r.pop("start"), "prompt_tokens": len(cases[j].prompt_ids),
                "reference": r, "parallel": {n: v for n, v in p.items() if n != "start"}}

    return check_acceptance(ref_acc, par_acc, k, settings, [c.index for c in cases], describe,
                            list(zip(ref_tok, par_tok)))


def speculator_details(acceptance: CheckResult, kind: str, baseline: CheckResult | None = None,
                       baseline_key: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The cell's `details["speculator"]` section for the report (harness/report/details.py); the
    speculator's layout table is compare_cell's `details["speculator_layout"]`. baseline_key: the
    reference run's acceptance baseline key (what `harness baseline update` records the reference's
    mean and histogram under)."""
    m = acceptance.metrics
    b = baseline.metrics if baseline is not None else {}
    out: dict[str, Any] = {"kind": kind, "k": m.get("k"), "histogram": m.get("histogram"),
                           "reference_histogram": m.get("reference_histogram"),
                           "mean_acceptance": m.get("mean_accepted_length"),
                           "reference_mean_acceptance": m.get("reference_mean_accepted_length"),
                           "traces_differ": m.get("traces_differ"), "source": m.get("source"),
                           "first_divergence": m.get("first_trace_divergence"),
                           "baseline_mean_acceptance": b.get("baseline"),
                           "baseline_histogram": b.get("baseline_histogram"),
                           "baseline_verdict": baseline.verdict.value if baseline is not None else None,
                           "baseline_key": dict(baseline_key) if baseline_key is not None else None}
    return out


# ---- what a speculative server returns ---------------------------------------------------------------------

SPEC_STEPS = (SPEC_TOKENS, SPEC_TOPK_IDS, SPEC_TOPK_LOGPROBS)
SPEC_REPREFILL = (SPEC_REPREFILL_TOPK_IDS, SPEC_REPREFILL_TOPK_LOGPROBS)


def _spec_vs_plain(run: RunArtifacts) -> list[Pair]:
    return [compare_schedules(c.index, steps_of(run, c.index, GEN), steps_of(run, c.index, SPEC_STEPS))
            for c in run.cases]


def _spec_vs_reprefill(run: RunArtifacts) -> list[Pair]:
    pairs = []
    for c in run.cases:
        ids = run.tensor(SPEC_REPREFILL_TOPK_IDS, c.index)
        lps = run.tensor(SPEC_REPREFILL_TOPK_LOGPROBS, c.index).to(torch.float64)
        pairs.append(compare_consistency(c.index, steps_of(run, c.index, SPEC_STEPS),
                                         Steps([int(t) for t in ids[:, 0].tolist()], ids, lps)))
    return pairs


def check_speculative_output(par: RunArtifacts, ref: RunArtifacts,
                             settings: SpeculativeOutputSettings = SpeculativeOutputSettings()) -> list[CheckResult]:
    """speculative_logprobs (the speculative server vs the plain one) and speculative_consistency (its
    decode-time top-k vs its re-prefill) of a run whose speculative server's answers were kept."""
    if not has_tensors(par, (*GEN, *SPEC_STEPS)):
        why = ("the run kept only the speculative server's tokens, not its logprobs (spec_topk_*): the embedded "
               "engine's speculative path returns none")
        return [CheckResult("speculative_logprobs", Verdict.SKIP, why)]
    try:
        pairs = _spec_vs_plain(par)
        noise = [_spec_vs_plain(ref)] if has_tensors(ref, (*GEN, *SPEC_STEPS)) else []
        rounding = step_rounding(ref)
        out = [grade("speculative_logprobs", pairs, noise, settings, "speculative vs plain server", rounding=rounding)]
        if has_tensors(par, SPEC_REPREFILL):
            noise = [_spec_vs_reprefill(ref)] if has_tensors(ref, (*SPEC_STEPS, *SPEC_REPREFILL)) else []
            out.append(grade("speculative_consistency", _spec_vs_reprefill(par), noise, settings,
                             "speculative decode vs re-prefill", rounding=rounding))
        else:
            out.append(CheckResult("speculative_consistency", Verdict.SKIP,
                                   "the run holds no re-prefill of the speculative generations "
                                   "(spec_reprefill_topk_*)"))
    except RunError as exc:
        return [CheckResult("speculative_logprobs", Verdict.ERROR, str(exc))]
    return out
