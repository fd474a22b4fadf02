"""The sampling checks: a sampled run's draws against the reference's processed distribution, with no equal random
streams needed (docs/checks.md#sampling).

At each teacher-forced position that picks a new token the reference's logits are known, so its processed
distribution (harness/specs/sampling.py's order: penalties, temperature, min-p, top-k, top-p) is recomputed here,
in float64 numpy, from first principles (not by the engine's sampler). Every processing step keeps the most probable
tokens, so the support is the top m tokens by penalized logit. The parallel run's n draws per position (both paths:
prefill and decode logits) are then tested:

- support: a draw outside the reference's support FAILs, unless the token is a near tie at the cut-off (moving its
  own logit by the slack flips its membership);
- fit: a chi-square test of the draws that fall on tokens of certain membership against the reference's
  probabilities renormalized over them (bins of small expected count pooled); the cell FAILs when the smallest
  p-value is below alpha / tests (Bonferroni: at most alpha false positives per cell);
- two-sample (a reference without full logits: an HTTP engine answers top-k logprobs, which cannot place a
  repetition penalty, since it acts on the sign of the raw logit): each position's draws against the reference run's
  own draws at that position, a chi-square test of homogeneity (columns of small expected count pooled), with the same
  Bonferroni threshold; the support is not known, so a token outside it shows only as a shift of the fit;
- ranks: every rank drew the same tokens (the draws of each rank, gathered);
- seeded: a prompt sent twice with the same seed (alone and inside a batch) drew the same random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.special import chdtrc  # chi-square survival function chdtrc(df, x); scipy.stats costs ~2 s to import

from harness.compare.settings import SamplingSettings
from harness.core.verdict import CheckResult, Verdict
from harness.records.artifacts import RunArtifacts
from harness.records.contract import (
    GEN_TOKENS,
    PREFILL_LOGITS,
    SAMPLE_DECODE,
    SAMPLE_PREFILL,
    SAMPLE_UNIFORMS,
    tensor_key,
)
from harness.specs.sampling import SamplingParams

PATHS: dict[str, str] = {SAMPLE_PREFILL: "prefill", SAMPLE_DECODE: "decode"}


# -- the reference's processed distribution ----------------------------------------------------------------


def penalized(logits: np.ndarray, prompt: Sequence[int], output: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Raw logits [V] with the repetition penalty over prompt + output and presence / frequency over output."""
    x = logits.astype(np.float64).copy()
    seen = np.unique(np.asarray([*prompt, *output], dtype=np.int64))
    if p.repetition_penalty != 1.0 and seen.size:
        x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    if len(output):
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.size).astype(np.float64)
        x -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
    return x


def support(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The kept tokens [..., V] (bool) of penalized logits x [..., V], each row on its own: min-p, top-k (ties at
    the k-th value kept), top-p."""
    z = x / p.temperature
    order = np.argsort(-z, axis=-1, kind="stable")  # [..., V]
    zs = np.take_along_axis(z, order, axis=-1)  # [..., V], best first
    ps = np.exp(zs - zs[..., :1])
    ps /= ps.sum(axis=-1, keepdims=True)
    keep = ps >= p.min_p * ps[..., :1] if p.min_p > 0 else np.ones(z.shape, dtype=bool)
    if p.top_k and p.top_k < z.shape[-1]:
        keep &= zs >= zs[..., p.top_k - 1:p.top_k]
    if p.top_p < 1.0:
        q = np.where(keep, ps, 0.0)
        q /= q.sum(axis=-1, keepdims=True)
        keep &= (np.cumsum(q, axis=-1) - q) < p.top_p
    out = np.zeros(z.shape, dtype=bool)
    np.put_along_axis(out, order, keep, axis=-1)
    return out


def distribution(x: np.ndarray, keep: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Probabilities [V] over the kept tokens of penalized logits x."""
    z = np.where(keep, x / p.temperature, -np.inf)
    e = np.exp(z - z.max())
    return e / e.sum()


NEAR_TIE_BLOCK = 1 << 22  # logits per block of near_ties' moved copies (32 MiB of float64)


def near_ties(x: np.ndarray, keep: np.ndarray, p: SamplingParams, slack: float) -> np.ndarray:
    """Tokens [V] (bool) whose membership flips when their own logit moves by `slack` (raised when outside, lowered
    when inside); only tokens within 2 x slack of the cut-off are tried, each as one row of a block of moved
    copies of x."""
    out = np.zeros(x.size, dtype=bool)
    if slack <= 0 or keep.all():
        return out
    cut_in, cut_out = x[keep].min(), x[~keep].max()
    tried = np.nonzero((x >= cut_out - 2 * slack) & (x <= cut_in + 2 * slack))[0]
    step = max(1, NEAR_TIE_BLOCK // x.size)
    for start in range(0, tried.size, step):
        tokens = tried[start:start + step]  # [C]
        rows = np.arange(tokens.size)
        moved = np.repeat(x[None, :], tokens.size, axis=0)  # [C, V]: row c moves token tokens[c]
        moved[rows, tokens] += np.where(keep[tokens], -slack, slack)
        out[tokens] = support(moved, p)[rows, tokens] != keep[tokens]
    return out


# -- the goodness-of-fit test ------------------------------------------------------------------------------


def chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 20.0) -> float:
    """p-value of observed `counts` [m] against probabilities `probs` [m] (summing to 1): Pearson's chi-square,
    the bins of expected count below min_expected pooled into one (joined to the smallest other bin if still
    below it); 1.0 with fewer than two bins or no draws."""
    total = counts.sum()
    if total == 0:
        return 1.0
    expected = probs * total
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e > 0:
        if rest_e < min_expected and exp:
            j = int(np.argmin(exp))
            obs[j] += rest_o
            exp[j] += rest_e
        else:
            obs.append(rest_o)
            exp.append(rest_e)
    if len(exp) < 2:
        return 1.0
    o, e = np.asarray(obs, dtype=np.float64), np.asarray(exp, dtype=np.float64)
    return float(chdtrc(len(e) - 1, ((o - e) ** 2 / e).sum()))


def homogeneity_p(a: np.ndarray, b: np.ndarray, min_expected: float = 20.0) -> float:
    """p-value that token counts `a` [m] and `b` [m] (two samples over the same tokens) come from one distribution:
    Pearson's chi-square of the 2 x m table, each token whose smaller expected count (under the pooled distribution)
    is below min_expected pooled into one column (joined to the smallest other column if still below it); 1.0 with
    fewer than two columns or an empty sample."""
    na, nb = float(a.sum()), float(b.sum())
    if na == 0 or nb == 0:
        return 1.0
    pooled = (a + b).astype(np.float64) / (na + nb)
    small = np.minimum(pooled * na, pooled * nb) < min_expected
    cols = [(float(x), float(y)) for x, y in zip(a[~small], b[~small])]
    rest = (float(a[small].sum()), float(b[small].sum()))
    if rest[0] + rest[1] > 0:
        if min(na, nb) * (rest[0] + rest[1]) / (na + nb) < min_expected and cols:
            j = int(np.argmin([x + y for x, y in cols]))
            cols[j] = (cols[j][0] + rest[0], cols[j][1] + rest[1])
        else:
            cols.append(rest)
    if len(cols) < 2:
        return 1.0
    obs = np.asarray(cols, dtype=np.float64).T  # [2, m']
    expected = np.outer([na, nb], obs.sum(axis=0)) / (na + nb)
    return float(chdtrc(obs.shape[1] - 1, ((obs - expected) ** 2 / expected).sum()))


@dataclass(frozen=True)
class PositionTest:
    """One position's draws against the reference: p-value, draws outside the support (near ties apart)."""

    case: int
    path: str
    step: int
    p_value: float
    outside: tuple[int, ...]    # tokens drawn outside the reference's support, not near ties
    near_tie_draws: int
    support: int


@dataclass(frozen=True)
class ReferencePosition:
    """The reference's processed distribution at one position: its support, the near ties in it and the
    probabilities over the rest (the tokens certainly kept)."""

    keep: np.ndarray     # [V] bool
    ties: np.ndarray     # [V] bool
    certain: np.ndarray  # [V] bool: keep and not a near tie
    probs: np.ndarray    # [V]: over `certain` (zeros without any)

    @classmethod
    def of(cls, logits: np.ndarray, prompt: Sequence[int], output: Sequence[int], p: SamplingParams,
           slack: float) -> "ReferencePosition":
        """Of the reference's logits [V] at a position after `prompt` + `output`."""
        x = penalized(logits, prompt, output, p)
        keep = support(x, p)
        ties = near_ties(x, keep, p, slack)
        certain = keep & ~ties
        return cls(keep, ties, certain, distribution(x, certain, p) if certain.any() else np.zeros(x.size))

    def test(self, draws: np.ndarray, min_expected: float, where: tuple[int, str, int]) -> PositionTest:
        """`draws` [n] of one position against this distribution."""
        outside = sorted({int(t) for t in draws if not self.keep[t] and not self.ties[t]})
        counts = np.bincount(draws.astype(np.int64), minlength=self.keep.size)
        p_value = chi_square_p(counts[self.certain], self.probs[self.certain], min_expected)
        return PositionTest(*where, p_value, tuple(outside), int(counts[self.ties].sum()), int(self.keep.sum()))


# -- the checks ------------------------------------------------------------------------------------------


def _has(run: RunArtifacts, kind: str, index: int) -> bool:
    return tensor_key(kind, index) in run.tensors


def _slack(noise: RunArtifacts | None, base: RunArtifacts, index: int, rows: slice,
           settings: SamplingSettings) -> float:
    """max(slack_floor, slack_factor x the noise run's largest logit difference from its base over `rows`)."""
    if noise is None or not _has(noise, PREFILL_LOGITS, index) or not _has(base, PREFILL_LOGITS, index):
        return settings.slack_floor
    diff = (noise.tensor(PREFILL_LOGITS, index)[rows].double() - base.tensor(PREFILL_LOGITS, index)[rows].double())
    return max(settings.slack_floor, settings.slack_factor * float(diff.abs().max()))


def position_tests(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, noise_base: RunArtifacts,
                   params: SamplingParams, settings: SamplingSettings) -> list[PositionTest]:
    """Every sampled position of every case and path that the parallel run drew, rank 0's draws."""
    out: list[PositionTest] = []
    for case in par.cases:
        first, last = len(case.prompt_ids) - 1, len(case.sequence_ids) - 1
        logits = ref.tensor(PREFILL_LOGITS, case.index)[first:last].double().numpy()  # [S, V]
        slack = _slack(noise, noise_base, case.index, slice(first, last), settings)
        positions: dict[int, ReferencePosition] = {}  # by step: both paths' draws test against one distribution
        for kind, path in PATHS.items():
            if not _has(par, kind, case.index):
                continue
            draws = par.tensor(kind, case.index)[0].numpy()  # [S, n] of rank 0
            for s in range(min(draws.shape[0], logits.shape[0])):
                if s not in positions:
                    positions[s] = ReferencePosition.of(logits[s], case.prompt_ids,
                                                        case.sequence_ids[first + 1:first + 1 + s], params, slack)
                out.append(positions[s].test(draws[s], settings.min_expected, (case.index, path, s)))
    return out


def two_sample_tests(ref: RunArtifacts, par: RunArtifacts, settings: SamplingSettings) -> list[PositionTest]:
    """Every sampled position of every case and path that both runs drew: rank 0's draws of the parallel run
    against rank 0's of the reference (homogeneity_p); no support is known, so `outside` stays empty."""
    out: list[PositionTest] = []
    for case in par.cases:
        for kind, path in PATHS.items():
            if not _has(par, kind, case.index) or not _has(ref, kind, case.index):
                continue
            mine, theirs = par.tensor(kind, case.index)[0].numpy(), ref.tensor(kind, case.index)[0].numpy()  # [S, n]
            for s in range(min(mine.shape[0], theirs.shape[0])):
                size = int(max(mine[s].max(), theirs[s].max())) + 1
                a, b = np.bincount(mine[s], minlength=size), np.bincount(theirs[s], minlength=size)
                out.append(PositionTest(case.index, path, s, homogeneity_p(a, b, settings.min_expected), (), 0,
                                        int(((a + b) > 0).sum())))
    return out


def strip_rows(tests: Sequence[PositionTest], threshold: float) -> list[str]:
    """The report's p-value strip (text rows the drill-down shows under the reason): per prompt and path, each
    step's p-value, '!' below the threshold, 'x' where a token was drawn outside the support."""
    rows: dict[tuple[int, str], list[str]] = {}
    for t in tests:
        mark = ("!" if t.p_value < threshold else "") + ("x" if t.outside else "")
        rows.setdefault((t.case, t.path), []).append(f"{t.p_value:.1e}{mark}")
    return [f"prompt {case} {path}: " + " ".join(values) for (case, path), values in rows.items()]


def check_distribution(ref: RunArtifacts, par: RunArtifacts, noise: RunArtifacts | None, noise_base: RunArtifacts,
                       params: SamplingParams, settings: SamplingSettings, logits_agree: bool) -> CheckResult:
    """sampling_distribution: support and fit of every position's draws (the module docstring)."""
    name = "sampling_distribution"
    full = bool(par.cases) and all(_has(ref, PREFILL_LOGITS, case.index) for case in par.cases)
    if not full and not any(_has(ref, kind, case.index) for case in par.cases for kind in PATHS):
        return CheckResult(name, Verdict.SKIP, "the reference holds neither full logits (prefill_logits) nor draws "
                           "of its own (sample_prefill): no reference distribution to test the draws against")
    tests = (position_tests(ref, par, noise, noise_base, params, settings) if full
             else two_sample_tests(ref, par, settings))
    if not tests:
        return CheckResult(name, Verdict.SKIP, "the run holds no sampling draws (sample_prefill / sample_decode)")
    threshold = settings.alpha / len(tests)
    worst = min(tests, key=lambda t: t.p_value)
    outside = [t for t in tests if t.outside]
    strip: dict[str, list[float]] = {}
    outside_strip: dict[str, list[int]] = {}  # per prompt/path, each step's count of tokens outside the support
    for t in tests:
        strip.setdefault(f"{t.case}/{t.path}", []).append(t.p_value)
        outside_strip.setdefault(f"{t.case}/{t.path}", []).append(len(t.outside))
    metrics: dict[str, Any] = {
        "tests": len(tests), "draws_per_position": params.n, "alpha": settings.alpha, "threshold": threshold,
        "min_p_value": worst.p_value, "worst": {"case": worst.case, "path": worst.path, "step": worst.step},
        "outside_support": sum(len(t.outside) for t in tests), "near_tie_draws": sum(t.near_tie_draws for t in tests),
        "p_value_strip": strip, "outside_strip": outside_strip, "sampling": params.to_dict(),
        "p_values": strip_rows(tests, threshold),
        "reference": "processed distribution of its full logits" if full else "its own draws (two-sample)"}
    where = ("; the teacher-forced logits agree with the reference, so the sampler is the suspect"
             if logits_agree else "; the logits checks fail too: the sampled logits already differ")
    if outside:
        t = outside[0]
        return CheckResult(name, Verdict.FAIL, f"prompt {t.case} {t.path} step {t.step}: tokens {list(t.outside)[:5]} "
                           f"drawn outside the reference's support of {t.support} tokens ({len(outside)} of "
                           f"{len(tests)} positions){where}", metrics)
    against = "the reference's processed distribution" if full else "the reference's own draws (two-sample)"
    if worst.p_value < threshold:
        low = sum(t.p_value < threshold for t in tests)
        return CheckResult(name, Verdict.FAIL, f"prompt {worst.case} {worst.path} step {worst.step}: draws do not fit "
                           f"{against} (p = {worst.p_value:.1e} < {threshold:.1e} = alpha {settings.alpha:g} / "
                           f"{len(tests)} tests; {low} positions below){where}", metrics)
    support = ", none outside its support" if full else " (the support is not known without full logits)"
    return CheckResult(name, Verdict.PASS, f"{len(tests)} positions x {params.n} draws fit {against} (min p = "
                       f"{worst.p_value:.2g} >= {threshold:.1e}){support}", metrics)


def check_ranks(par: RunArtifacts) -> CheckResult:
    """sampling_ranks: every rank drew the same tokens at every position of both paths."""
    name = "sampling_ranks"
    seen = 0
    for case in par.cases:
        for kind, path in PATHS.items():
            if not _has(par, kind, case.index):
                continue
            draws = par.tensor(kind, case.index)  # [W, S, n]
            seen += 1
            for rank in range(1, draws.shape[0]):
                differ = (draws[rank] != draws[0]).any(dim=-1).nonzero()
                if differ.numel():
                    step = int(differ[0, 0])
                    return CheckResult(name, Verdict.FAIL, f"rank {rank} drew other tokens than rank 0 at prompt "
                                       f"{case.index} {path} step {step} ({int(differ.shape[0])} of "
                                       f"{draws.shape[1]} steps): the ranks' samplers disagree",
                                       {"rank": rank, "case": case.index, "path": path, "step": step})
    if not seen:
        return CheckResult(name, Verdict.SKIP, "the run holds no sampling draws (sample_prefill / sample_decode)")
    ranks = int(par.tensor(next(k for k in PATHS if _has(par, k, par.cases[0].index)), par.cases[0].index).shape[0])
    return CheckResult(name, Verdict.PASS, f"all {ranks} ranks drew the same tokens ({seen} case paths)",
                       {"ranks": ranks})


def check_seeded(par: RunArtifacts, seeds: Sequence[int]) -> CheckResult:
    """sampling_seeded: the cases sending the same prompt with the same seed (seeds[j]: case j's, in case order), one
    inside a batch and one alone. Where the run recorded each step's uniform (sample_uniforms) the copies must have
    drawn the same uniforms at every step they share (the per-request seed's promise, exact); their tokens then
    differ only where the batch moved the logits across a CDF boundary (an engine without batch invariance: counted,
    not failed). Without uniforms the tokens must be equal."""
    name = "sampling_seeded"
    groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for case, seed in zip(par.cases, seeds):
        groups.setdefault((case.prompt_ids, seed), []).append(case.index)
    copies = [g for g in groups.values() if len(g) > 1]
    if not copies:
        return CheckResult(name, Verdict.SKIP, "the workload sends no prompt twice with the same seed")
    flips: list[dict[str, int]] = []
    for group in copies:
        first = par.tensor(GEN_TOKENS, group[0]).tolist()
        for other in group[1:]:
            tokens = par.tensor(GEN_TOKENS, other).tolist()
            at = next((i for i, (a, b) in enumerate(zip(first, tokens)) if a != b), None)
            if at is None and len(first) == len(tokens):
                continue
            at = min(len(first), len(tokens)) if at is None else at
            if _has(par, SAMPLE_UNIFORMS, group[0]) and _has(par, SAMPLE_UNIFORMS, other):
                u0, u1 = par.tensor(SAMPLE_UNIFORMS, group[0]), par.tensor(SAMPLE_UNIFORMS, other)
                n = min(len(u0), len(u1), at + 1)
                differ = (u0[:n] != u1[:n]).nonzero()
                if not differ.numel():
                    flips.append({"request": other, "first": group[0], "step": at})
                    continue
                step = int(differ[0, 0])
                return CheckResult(name, Verdict.FAIL, f"request {other} (prompt {group[0]} sent again, same seed) "
                                   f"drew another random number than request {group[0]} at step {step}: the "
                                   f"request's seed does not determine its draws", {"request": other,
                                                                                    "first": group[0], "step": step})
            return CheckResult(name, Verdict.FAIL, f"request {other} (prompt {group[0]} sent again, same seed) "
                               f"generated other tokens than request {group[0]} from step {at}",
                               {"request": other, "first": group[0], "step": at})
    n = sum(len(g) for g in copies)
    note = (f"; {len(flips)} copies took another token from step {flips[0]['step']} with the same random numbers "
            f"(the batch moved the logits across a CDF boundary: no batch invariance is promised)" if flips else "")
    return CheckResult(name, Verdict.PASS, f"{n} requests of {len(copies)} seeded prompt(s) drew the same random "
                       f"numbers alone and in a batch{note}", {"requests": n, "boundary_flips": flips})
