"""Greedy generation agreement: reference vs parallel tokens, benign only at near ties.

Per prompt, the first step where the greedy tokens differ is a divergence. It is benign only
where the parallel token is among the reference's top-k at that step with a reference logprob gap
(top-1 minus that token) at or below the near-tie bound = max(near_tie, near_tie_factor x the
noise run's top-2 gap error); so the reference's top-2 gap is a near tie too. A parallel token outside the
reference's top-k is a near tie only where that top-k spans at most the bound (it does not exclude one) and the
reference's token sits in the parallel top-k within the bound (the same tie seen from the other run:
topk.crossed_tie). Any other divergence (a clear gap, a token outside the reference's top-k otherwise,
different lengths) is a jump, and FAILs the check
unless the reference engine's rounding-only comparisons (`evidence`, compare/parity/jumps.py) jump as often:
an engine with a discontinuous forward pass (top-k expert routing) jumps under rounding alone.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from harness.compare.parity.bounds import Bound, json_float
from harness.compare.parity.jumps import JumpEvidence, JumpTest
from harness.compare.parity.logprob_values import BadLogprobs, check_finite
from harness.compare.parity.step_rounding import half_floor, topology_ranks
from harness.compare.parity.topk import crossed_tie
from harness.compare.settings import GenerationSettings
from harness.core.errors import RunError
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import Case, RunArtifacts
from harness.records.contract import GEN_TOKENS, GEN_TOPK_IDS, GEN_TOPK_LOGPROBS

Decoder = Callable[[Sequence[int]], str]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where the sequences differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ids_text(ids: Sequence[int]) -> str:
    return "".join(f"[{i}]" for i in ids)


def top2_gaps(logprobs: torch.Tensor) -> torch.Tensor:
    """[N, k] top-k logprobs -> [N] top-1 minus top-2 (inf where k < 2)."""
    lp = logprobs.to(torch.float64)
    if lp.shape[-1] < 2:
        return torch.full(lp.shape[:1], float("inf"), dtype=torch.float64)
    return lp[:, 0] - lp[:, 1]


def noise_gap_error(ref: RunArtifacts, noise: RunArtifacts | None) -> tuple[float | None, str | None]:
    """Max |reference top-2 gap - noise top-2 gap| over the steps both runs share a context
    (up to and including their first divergence); None and why when there is no usable noise run."""
    if noise is None:
        return None, None
    if not noise.ok:
        return None, "noise run failed"
    worst_err = 0.0
    try:
        for case in ref.cases:
            ref_gap = top2_gaps(ref.tensor(GEN_TOPK_LOGPROBS, case.index))  # [N]
            noise_gap = top2_gaps(noise.tensor(GEN_TOPK_LOGPROBS, case.index))  # [N']
            div = first_divergence(ref.tensor(GEN_TOKENS, case.index).tolist(),
                                   noise.tensor(GEN_TOKENS, case.index).tolist())
            steps = min(len(ref_gap), len(noise_gap), len(ref_gap) if div is None else div + 1)
            err = (ref_gap[:steps] - noise_gap[:steps]).abs()  # [steps]
            err = err[torch.isfinite(ref_gap[:steps]) | torch.isfinite(noise_gap[:steps])]
            if err.numel():
                if not bool(torch.isfinite(err).all()):
                    return None, f"noise run unusable: non-finite logprobs in prompt {case.index}"
                worst_err = max(worst_err, float(err.max()))
    except RunError as exc:
        return None, f"noise run unusable: {exc}"
    return worst_err, None


def _context(ids: Sequence[int], pos: int, width: int, decode: Decoder) -> dict[str, str]:
    return {"before": decode(ids[max(0, pos - width):pos]),
            "token": decode(ids[pos:pos + 1]) if pos < len(ids) else "",
            "after": decode(ids[pos + 1:pos + 1 + width])}


def _compare_case(index: int, ref: RunArtifacts, par: RunArtifacts, par_case: Case | None, bound: float,
                  settings: GenerationSettings, decode: Decoder | None) -> dict[str, Any]:
    """One prompt, in the report's schema (harness/report/details.py): texts, first_divergence
    (token index or None), benign, ref_token/par_token (text) with their ids, context_ref and
    context_par ({before, token, after}), prompt_tail (the prompt's last tokens), ref_topk/par_topk
    (each run's top-k at the diverging step) and the gaps that decided benign."""
    ref_ids = [int(x) for x in ref.tensor(GEN_TOKENS, index).tolist()]
    par_ids = [int(x) for x in par.tensor(GEN_TOKENS, index).tolist()]
    ref_case = next((c for c in ref.cases if c.index == index), None)
    word = decode or _ids_text
    pos = first_divergence(ref_ids, par_ids)
    out: dict[str, Any] = {
        "index": index, "prompt": ref_case.prompt if ref_case else "",
        "ref_text": decode(ref_ids) if decode else (ref_case.generated_text if ref_case else ""),
        "par_text": decode(par_ids) if decode else (par_case.generated_text if par_case else ""),
        "ref_tokens": len(ref_ids), "par_tokens": len(par_ids), "first_divergence": pos, "benign": None}
    if pos is None:
        return out
    out.update({
        "benign": False, "near_tie_bound": bound, "ref_gap": None, "par_token_gap": None,
        "ref_token": _token_text(ref_ids, pos, word), "par_token": _token_text(par_ids, pos, word),
        "ref_token_id": ref_ids[pos] if pos < len(ref_ids) else None,
        "par_token_id": par_ids[pos] if pos < len(par_ids) else None,
        "context_ref": _context(ref_ids, pos, settings.context_tokens, word),
        "context_par": _context(par_ids, pos, settings.context_tokens, word),
        "prompt_tail": word(list(ref_case.prompt_ids[-settings.context_tokens:])) if ref_case else "",
        "ref_topk": _topk_at(ref, index, pos, word), "par_topk": _topk_at(par, index, pos, word)})
    lps = ref.tensor(GEN_TOPK_LOGPROBS, index).to(torch.float64)  # [N, k]
    ids = ref.tensor(GEN_TOPK_IDS, index)  # [N, k]
    if pos < len(ref_ids) and pos < len(par_ids) and pos < lps.shape[0]:
        out["ref_gap"] = json_float(float(top2_gaps(lps[pos:pos + 1])[0]))
        hits = (ids[pos] == par_ids[pos]).nonzero()
        if hits.numel():
            gap = float(lps[pos, 0] - lps[pos, int(hits[0, 0])])
            out["par_token_gap"] = json_float(gap)
            out["benign"] = gap <= bound
        elif pos < par.tensor(GEN_TOPK_IDS, index).shape[0]:  # outside the reference's top-k: the other side's view
            tie = crossed_tie(ids[pos], lps[pos], par.tensor(GEN_TOPK_IDS, index)[pos],
                              par.tensor(GEN_TOPK_LOGPROBS, index)[pos].to(torch.float64), ref_ids[pos])
            out["crossed_tie"] = None if tie is None else json_float(tie)
            out["benign"] = tie is not None and tie <= bound
    return out


def _topk_at(run: RunArtifacts, index: int, pos: int, word: Decoder) -> list[dict[str, Any]]:
    """The run's top-k at generation step `pos`: [{"id", "token" (text), "logprob"}], best first; [] past its end."""
    lps = run.tensor(GEN_TOPK_LOGPROBS, index)  # [N, k]
    ids = run.tensor(GEN_TOPK_IDS, index)  # [N, k]
    if pos >= min(lps.shape[0], ids.shape[0]):
        return []
    return [{"id": int(i), "token": word([int(i)]), "logprob": json_float(float(lp))}
            for i, lp in zip(ids[pos].tolist(), lps[pos].to(torch.float64).tolist())]


def _token_text(ids: Sequence[int], pos: int, word: Decoder) -> str | None:
    return word(ids[pos:pos + 1]) if pos < len(ids) else None


def _quoted(text: str) -> str:
    """repr() with U+FFFD (a partial UTF-8 sequence) escaped too, so it never prints as a blank box."""
    return repr(text).replace("\ufffd", "\\ufffd")


def _describe(p: dict[str, Any]) -> str:
    """'prompt 2 diverges at token 3: ref ' Paris' (id 12) vs par ' the' (id 9) (ref gap 4.2e+00 > near-tie
    1.0e-03)'."""
    ref_t = "<end>" if p["ref_token"] is None else f"{_quoted(p['ref_token'])} (id {p['ref_token_id']})"
    par_t = "<end>" if p["par_token"] is None else f"{_quoted(p['par_token'])} (id {p['par_token_id']})"
    if p["ref_token"] is None or p["par_token"] is None:
        why = f"lengths differ: ref {p['ref_tokens']} vs par {p['par_tokens']} tokens"
    elif p["par_token_gap"] is None:
        gap = "nan" if p["ref_gap"] is None else f"{p['ref_gap']:.1e}"
        crossed = "" if p.get("crossed_tie") is None else f"; a near tie only under a bound of {p['crossed_tie']:.1e}"
        why = f"par token not in the reference top-k; ref top-2 gap {gap}{crossed}"
    else:
        why = f"ref gap {p['par_token_gap']:.1e} > near-tie {p['near_tie_bound']:.1e}"
    return f"prompt {p['index']} diverges at token {p['first_divergence']}: ref {ref_t} vs par {par_t} ({why})"


def check_generation(ref: RunArtifacts, par: RunArtifacts, settings: GenerationSettings,
                     noise: RunArtifacts | None = None, decode: Decoder | None = None,
                     evidence: JumpEvidence | None = None,
                     noise_ref: RunArtifacts | None = None) -> tuple[CheckResult, list[dict[str, Any]]]:
    """Compare gen_tokens.{i} of every prompt; returns the check and one dict per prompt. `evidence`: the
    reference engine's jumps under rounding (schedule.engine_evidence; None: none measured). The noise is `noise`
    against `noise_ref` (default: `ref`; compare/parity/noise_source.py).

    `decode` turns token ids into text; without it texts come from each run's Case.generated_text
    and tokens show as [id]."""
    if not ref.cases:
        return CheckResult("generation", Verdict.SKIP, "no prompts"), []
    gap_err, note = noise_gap_error(ref if noise_ref is None else noise_ref, noise)
    floor, why = settings.near_tie, "no noise run"
    rounding = half_floor(ref, topology_ranks(par)) if not gap_err else None  # no noise, or zero: measures nothing
    if rounding is not None and 2.0 * rounding.abs_limit > floor:
        why = f"{why if gap_err is None else 'noise measured zero'}: 2 x {rounding.describe()}"
        floor = 2.0 * rounding.abs_limit
        gap_err = None
    bound = Bound(floor, settings.near_tie_factor, gap_err, no_noise=why)
    par_cases = {c.index: c for c in par.cases}
    try:
        for case in ref.cases:  # NaN / inf / null logprobs: the engine's output is wrong, whatever the tokens
            for who, run in (("reference", ref), ("parallel", par)):
                check_finite(run, who, GEN_TOPK_LOGPROBS, case.index, run.tensor(GEN_TOPK_LOGPROBS, case.index),
                             run.tensor(GEN_TOPK_IDS, case.index), unit="generation step", allow_padding=True)
        prompts = [_compare_case(c.index, ref, par, par_cases.get(c.index), bound.limit, settings, decode)
                   for c in ref.cases]
    except BadLogprobs as exc:
        return CheckResult("generation", Verdict.FAIL, str(exc)), []
    except RunError as exc:
        return CheckResult("generation", Verdict.ERROR, str(exc)), []
    diverged = [p for p in prompts if p["first_divergence"] is not None]
    jumped = [p for p in diverged if not p["benign"]]
    ev = evidence or JumpEvidence((), 0)
    steps = sum(min(p["ref_tokens"], p["par_tokens"]) if p["first_divergence"] is None else p["first_divergence"] + 1
                for p in prompts)
    noise_jumps, noise_steps = ev.counted(bound.limit, settings.jumps_alpha)
    test = JumpTest(len(jumped), steps, noise_jumps, noise_steps, settings.jumps_alpha)
    bad = [] if test.benign else jumped
    n = len(prompts)
    tie = f"near-tie bound {bound.limit:.1e} {bound.describe()}"
    if bad:
        verdict = Verdict.FAIL
        reason = f"{_describe(bad[0])}; {len(bad)}/{n} prompts diverge outside near ties{test.note()}"
    elif diverged:
        verdict = Verdict.PASS
        jumps = f"; {len(jumped)} jump as often as rounding does ({test.describe()})" if jumped else ""
        reason = (f"{n - len(diverged)}/{n} prompts identical; {len(diverged) - len(jumped)} diverge at near ties "
                  f"(first at token {diverged[0]['first_divergence']} of prompt {diverged[0]['index']}; {tie}){jumps}")
    else:
        verdict = Verdict.PASS
        reason = f"{n}/{n} prompts identical ({sum(p['ref_tokens'] for p in prompts)} tokens)"
    if note:
        reason += f"; {note}"
    metrics = {"prompts": n, "identical": n - len(diverged), "benign_divergences": len(diverged) - len(bad),
               "divergences": len(bad), "near_tie_bound": bound.to_dict(), "noise_note": note, **test.metrics(),
               "first_divergence": ({"prompt": (bad or diverged)[0]["index"],
                                     "position": (bad or diverged)[0]["first_divergence"]}
                                    if diverged else None)}
    return CheckResult("generation", verdict, reason, metrics), prompts
