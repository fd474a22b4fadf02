"""What a reference run produced, compact (a reference record), and one record against another within what
rounding in the dtype explains.

A record holds, per case i of the run (its own case index; tensors of a safetensors file, float32 values, int32 ids):

    prefill_ids.i, prefill_logprobs.i   [T, k]    top-k of the teacher-forced prefill (k = STORED_TOP_K)
    prefill_scale.i                     [T]       1 + max |logit| at each position (full-logit engines;
                                                  top-k-only engines: 1 + the top-k's spread)
    decode_ids.i, decode_logprobs.i, decode_scale.i   the same over the one-token decode steps [T-D, k]
    gen_tokens.i                        [N]       greedy generation
    gen_ids.i, gen_logprobs.i, gen_scale.i        its top-k at each step [N, k]; the scale: the top-k's spread, or
                                                  the case's largest prefill/decode scale where that is larger
    spec_tokens.i, spec_accepted.i, spec_drafts.i  -draft / -mtp runs: output, accepted count per verify
                                                  step, proposals
    layer_norm.i                        [L+1, P]  per-layer summary (engines with hidden states): the residual
    layer_proj.i                        [L+1, P, R] stream's norm and its projection on R fixed unit vectors at
                                                  the P probe positions
    sample_prefill_ids.i, sample_prefill_counts.i   [S, m]  sampling workloads: each sampled position's distinct
    sample_decode_ids.i, sample_decode_counts.i     [S, m]  drawn tokens (-1 padded) and how often each was drawn,
                                                  rank 0's draws on the prefill and decode paths

The bound is rounding's, from first principles (RoundingBound): never a noise run of the build under test. The
draws are held to the recorded ones by a two-sample test per position (the sampling checks' homogeneity test), at a
false-positive level of SAMPLE_ALPHA per comparison (Bonferroni over the positions): a seeded engine draws the same
tokens again, an unseeded one a sample of the same distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from harness.compare.sampling import homogeneity_p
from harness.compare.settings import SamplingSettings
from harness.records.artifacts import RunArtifacts
from harness.records.contract import SAMPLE_DECODE, SAMPLE_PREFILL, tensor_key

STORED_TOP_K = 5     # top-k logprobs kept per position
PROJECTIONS = 4      # fixed unit vectors each layer's residual stream is projected on
PROJECTION_SEED = 0  # their generator's seed (the vectors depend only on it and the width)
# unit roundoff (half the machine epsilon) of each dtype a model runs in
UNIT_ROUNDOFF: dict[str, float] = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
                                   "bfloat16": 2.0 ** -8}
GROWTH_CONSTANT = 4.0  # two computations (recorded, current) x a logprob's two rounded terms (logit, logsumexp)
LOGIT_PATHS: tuple[str, ...] = ("prefill", "decode", "gen")
PATH_WORDS = {"prefill": "prefill logprobs", "decode": "decode-path logprobs", "gen": "generation top-k"}
SAMPLE_WORDS = {SAMPLE_PREFILL: "sampled draws (prefill path)", SAMPLE_DECODE: "sampled draws (decode path)"}
SAMPLE_ALPHA = SamplingSettings().alpha  # the draws' false-positive level per record comparison
SAMPLE_MIN_EXPECTED = SamplingSettings().min_expected

Record = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RoundingBound:
    """What rounding in `dtype` explains between two computations of one model that differ only in rounding
    (another reduction order, another kernel, another machine):

        per logprob value:  u x G x scale,  G = GROWTH_CONSTANT x (layers + 2) x sqrt(width)

    u is the dtype's unit roundoff; a length-n reduction's rounding error grows as sqrt(n) u (the probabilistic
    bound of Higham and Mary, 2019) with n = width = max(hidden, ffn, sequence length); each of the layers, the
    embedding and the LM head adds its relative error (layers + 2); GROWTH_CONSTANT covers the two computations
    compared and a logprob's two rounded terms (the logit and the log-sum-exp); `scale` is the logits' magnitude
    at that position (1 + max |logit|). Hidden-state summaries at layer l: u x GROWTH_CONSTANT x (l + 1) x
    sqrt(width) relative to the stream's norm."""

    dtype: str
    layers: int
    width: int

    @property
    def unit_roundoff(self) -> float:
        return UNIT_ROUNDOFF.get(self.dtype, UNIT_ROUNDOFF["float32"])

    @property
    def growth(self) -> float:
        return GROWTH_CONSTANT * (self.layers + 2) * math.sqrt(self.width)

    def logprob(self, scale: torch.Tensor) -> torch.Tensor:
        """The bound of each logprob value at positions of logit magnitude `scale`."""
        return self.unit_roundoff * self.growth * scale

    def layer(self, layer: int) -> float:
        """The relative bound of the residual stream after `layer` layers (0: the embedding)."""
        return self.unit_roundoff * GROWTH_CONSTANT * (layer + 1) * math.sqrt(self.width)

    def describe(self) -> str:
        return (f"u({self.dtype}) = {self.unit_roundoff:.2e} x growth {self.growth:.0f} "
                f"(= {GROWTH_CONSTANT:g} x ({self.layers} layers + 2) x sqrt({self.width})) x (1 + max |logit|)")

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "layers": self.layers, "width": self.width,
                "unit_roundoff": self.unit_roundoff, "growth": self.growth}


def bound_of(model: Mapping[str, Any], dtype: str, run: RunArtifacts) -> RoundingBound:
    """The rounding bound of a run of `model` (its manifest's model spec) in `dtype`."""
    longest = max((len(c.sequence_ids) + len(c.generated_ids) for c in run.cases), default=1)
    width = max(int(model.get("hidden", 1)), int(model.get("ffn", 1)), longest)
    return RoundingBound(dtype, int(model.get("layers", 1)), width)


def _topk(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [T, k] int32, logprobs [T, k] float32, scale [T]) of full logits [T, V]."""
    wide = logits.double()
    logprobs = torch.log_softmax(wide, dim=-1)
    values, ids = logprobs.topk(min(STORED_TOP_K, logits.shape[-1]), dim=-1)
    return ids.to(torch.int32), values.float(), (1.0 + wide.abs().amax(dim=-1)).float()


def _from_topk(ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same from an engine's top-k [T, k'] (sorted by the engine, best first): its first STORED_TOP_K, and
    its spread as the scale (the logits are not at hand)."""
    k = min(STORED_TOP_K, ids.shape[-1])
    values = logprobs[..., :k].float()
    spread = (values[..., :1] - logprobs[..., -1:].float()).abs().squeeze(-1) if ids.shape[-1] else \
        torch.zeros(ids.shape[0])
    return ids[..., :k].to(torch.int32), values, 1.0 + spread + values[..., 0].abs()


def _projection(width: int) -> torch.Tensor:
    """[width, PROJECTIONS] fixed unit columns (from PROJECTION_SEED alone: the same for every run)."""
    gen = torch.Generator().manual_seed(PROJECTION_SEED)
    q = torch.randn(width, PROJECTIONS, generator=gen, dtype=torch.float64)
    return q / q.norm(dim=0, keepdim=True)


def _draw_counts(draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, counts) [S, m] int32 of draws [S, n]: each position's distinct tokens (-1 padded) and their counts."""
    rows = [torch.unique(row, return_counts=True) for row in draws]
    width = max((len(ids) for ids, _ in rows), default=0)
    ids = torch.full((len(rows), width), -1, dtype=torch.int32)
    counts = torch.zeros((len(rows), width), dtype=torch.int32)
    for s, (tokens, count) in enumerate(rows):
        ids[s, :len(tokens)], counts[s, :len(count)] = tokens.to(torch.int32), count.to(torch.int32)
    return ids, counts


def record_of(run: RunArtifacts) -> Record:
    """The compact record of a reference run (the module docstring's tensors), from the tensors it holds."""
    out: Record = {}
    t = run.tensors
    for case in run.cases:  # keyed by the run's case index (a workload's view holds some of them)
        i = case.index
        for path in ("prefill", "decode"):
            if f"{path}_logits.{i}" in t:
                ids, lp, scale = _topk(t[f"{path}_logits.{i}"])
            elif f"{path}_topk_ids.{i}" in t:
                ids, lp, scale = _from_topk(t[f"{path}_topk_ids.{i}"], t[f"{path}_topk_logprobs.{i}"])
            else:
                continue
            out.update({f"{path}_ids.{i}": ids, f"{path}_logprobs.{i}": lp, f"{path}_scale.{i}": scale})
        if f"gen_tokens.{i}" in t:
            out[f"gen_tokens.{i}"] = t[f"gen_tokens.{i}"].to(torch.int32)
        if f"gen_topk_ids.{i}" in t:
            ids, lp, scale = _from_topk(t[f"gen_topk_ids.{i}"], t[f"gen_topk_logprobs.{i}"])
            # the generation's own logits are not at hand: the case's largest logit magnitude on the other paths
            # (the same model on the same text) where it is larger than the top-k's spread shows
            seen = [out[f"{path}_scale.{i}"].max() for path in ("prefill", "decode") if f"{path}_scale.{i}" in out]
            scale = torch.maximum(scale, torch.stack(seen).max()) if seen else scale
            out.update({f"gen_ids.{i}": ids, f"gen_logprobs.{i}": lp, f"gen_scale.{i}": scale})
        for name in ("spec_tokens", "spec_accepted", "spec_drafts"):
            if f"{name}.{i}" in t:
                out[f"{name}.{i}"] = t[f"{name}.{i}"].to(torch.int32)
        for kind in SAMPLE_WORDS:
            if tensor_key(kind, i) in t:
                ids, counts = _draw_counts(t[tensor_key(kind, i)][0])  # rank 0's draws [S, n]
                out.update({f"{kind}_ids.{i}": ids, f"{kind}_counts.{i}": counts})
        if f"hidden.{i}" in t:
            hidden = t[f"hidden.{i}"].double()  # [L+1, P, H]
            out[f"layer_norm.{i}"] = hidden.norm(dim=-1).float()  # [L+1, P]
            out[f"layer_proj.{i}"] = (hidden @ _projection(hidden.shape[-1])).float()  # [L+1, P, R]
    return out


def record_bytes(record: Record) -> int:
    """The record's payload in bytes (what its file stores, less the safetensors header)."""
    return sum(x.numel() * x.element_size() for x in record.values())


@dataclass(frozen=True)
class Difference:
    """Where a current reference first leaves the recorded one: case, what, position (step), and the first
    layer whose summary differs there (None without per-layer summaries)."""

    case: int
    what: str
    position: int
    detail: str
    layer: int | None = None

    def text(self) -> str:
        where = f"case {self.case}, {self.what} at position {self.position}"
        layer = f"; first differing layer {self.layer}" if self.layer is not None else ""
        return f"{where}: {self.detail}{layer}"

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "what": self.what, "position": self.position, "detail": self.detail,
                "layer": self.layer}


@dataclass(frozen=True)
class Comparison:
    """A current record against the recorded one: the first difference (None: within rounding), how many values
    were compared, the largest logprob difference and its bound there."""

    difference: Difference | None
    compared: int
    max_error: float
    bound_at_max: float
    near_ties: int

    def to_dict(self) -> dict[str, Any]:
        return {"difference": self.difference.to_dict() if self.difference else None, "compared": self.compared,
                "max_logprob_error": self.max_error, "bound_at_max": self.bound_at_max, "near_ties": self.near_ties}


class _Walk:
    """One comparison's running state: the first difference in (case, path order, position) order."""

    def __init__(self, bound: RoundingBound) -> None:
        self.bound = bound
        self.first: Difference | None = None
        self.compared = 0
        self.max_error = 0.0
        self.bound_at_max = 0.0
        self.near_ties = 0

    def found(self, diff: Difference) -> None:
        if self.first is None:
            self.first = diff

    def topk_rows(self, case: int, what: str, old: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  new: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: int) -> int | None:
        """Compare top-k rows 0..rows-1; the first row that differs beyond rounding, else None. An id in one
        top-k only is benign where its logprob is within the bound of the other's k-th value (it crossed the
        cut-off); the same id's logprobs must agree within the bound."""
        (oid, olp, osc), (nid, nlp, nsc) = old, new
        tol = self.bound.logprob(torch.maximum(osc[:rows], nsc[:rows]).double())  # [rows]
        for t in range(rows):
            a = dict(zip(oid[t].tolist(), olp[t].double().tolist()))
            b = dict(zip(nid[t].tolist(), nlp[t].double().tolist()))
            cut_a, cut_b = min(a.values()), min(b.values())
            limit = float(tol[t])
            for token, value in a.items():
                other = b.get(token)
                self.compared += 1
                if other is None:
                    if value > cut_b + limit:
                        self.found(Difference(case, what, t, f"token {token} (logprob {value:.6g}) left the top-k "
                                                             f"(its k-th now {cut_b:.6g}; bound {limit:.2e})"))
                        return t
                    continue
                err = abs(value - other)
                if err >= self.max_error:
                    self.max_error, self.bound_at_max = err, limit
                if err > limit:
                    self.found(Difference(case, what, t, f"token {token} logprob {other:.6g}, recorded "
                                                         f"{value:.6g} (|diff| {err:.2e} > bound {limit:.2e})"))
                    return t
            for token, value in b.items():
                if token not in a and value > cut_a + limit:
                    self.found(Difference(case, what, t, f"token {token} (logprob {value:.6g}) entered the top-k "
                                                         f"(recorded k-th {cut_a:.6g}; bound {limit:.2e})"))
                    return t
        return None

    def tokens(self, case: int, what: str, old: torch.Tensor, new: torch.Tensor,
               gaps: torch.Tensor | None, tol: torch.Tensor | None) -> int:
        """Compare token sequences; the number of leading steps that agree (a benign divergence at a recorded near
        tie ends the comparison there; any other divergence is a difference)."""
        n = min(old.numel(), new.numel())
        differ = (old[:n] != new[:n]).nonzero()
        if not differ.numel():
            if old.numel() != new.numel():
                self.found(Difference(case, what, n, f"{new.numel()} tokens, recorded {old.numel()}"))
            return n
        s = int(differ[0])
        if gaps is not None and tol is not None and s < gaps.numel() and float(gaps[s]) <= 2 * float(tol[s]):
            self.near_ties += 1  # the recorded top-2 were within rounding of each other: either may win
            return s
        gap = f" (recorded top-1/top-2 gap {float(gaps[s]):.3g} > 2 x bound)" if gaps is not None and s < gaps.numel() \
            else ""
        self.found(Difference(case, what, s, f"token {int(new[s])}, recorded {int(old[s])}{gap}"))
        return s


def _triple(rec: Record, path: str, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    key = f"{path}_ids.{n}"
    if key not in rec:
        return None
    return rec[key], rec[f"{path}_logprobs.{n}"], rec[f"{path}_scale.{n}"]


def _first_layer(old: Record, new: Record, n: int, bound: RoundingBound) -> tuple[int, int] | None:
    """(layer, probe index) of the first layer (then probe position) whose summary differs beyond rounding."""
    if f"layer_norm.{n}" not in old or f"layer_norm.{n}" not in new:
        return None
    onorm, nnorm = old[f"layer_norm.{n}"].double(), new[f"layer_norm.{n}"].double()  # [L+1, P]
    oproj, nproj = old[f"layer_proj.{n}"].double(), new[f"layer_proj.{n}"].double()  # [L+1, P, R]
    if onorm.shape != nnorm.shape or oproj.shape != nproj.shape:
        return 0, 0
    for layer in range(onorm.shape[0]):
        limit = bound.layer(layer) * torch.maximum(onorm[layer], nnorm[layer])  # [P]
        off = ((nnorm[layer] - onorm[layer]).abs() > limit) | \
              ((nproj[layer] - oproj[layer]).abs().amax(dim=-1) > limit)  # [P]
        if bool(off.any()):
            return layer, int(off.nonzero()[0])
    return None


def compare_records(old: Record, new: Record, bound: RoundingBound, cases: Sequence[int]) -> Comparison:
    """The current record `new` against the recorded `old`, case by case: the top-k logprobs of each path, the
    greedy and speculative tokens (a divergence benign only at a recorded near tie, after which the case's later
    steps are not compared), the draft proposals and accept counts before any such divergence, and the per-layer
    summaries; the first difference localized to its case, position and (where summaries exist) layer."""
    walk = _Walk(bound)
    for n in cases:
        for path in ("prefill", "decode"):
            a, b = _triple(old, path, n), _triple(new, path, n)
            if a is None and b is None:
                continue
            if a is None or b is None or a[0].shape != b[0].shape:
                walk.found(Difference(n, PATH_WORDS[path], 0, f"shape {None if b is None else list(b[0].shape)}, "
                                                              f"recorded {None if a is None else list(a[0].shape)}"))
                continue
            walk.topk_rows(n, PATH_WORDS[path], a, b, a[0].shape[0])
        _compare_generation(walk, old, new, n)
        layer = _first_layer(old, new, n, bound)
        if walk.first is not None:  # the outputs differ: where in the stack it starts, where summaries exist
            if layer is not None:
                walk.first = replace(walk.first, layer=layer[0],
                                     detail=walk.first.detail + f" (hidden summaries first differ at probe {layer[1]})")
            break
        if layer is not None:
            walk.found(Difference(n, "per-layer summary", layer[1], "the residual stream's summary differs beyond "
                                  "rounding while the logprobs agree", layer[0]))
            break
    if walk.first is None:
        _compare_draws(walk, old, new, cases)
    return Comparison(walk.first, walk.compared, walk.max_error, walk.bound_at_max, walk.near_ties)


def _counts_row(ids: torch.Tensor, counts: torch.Tensor) -> dict[int, int]:
    return {int(t): int(c) for t, c in zip(ids.tolist(), counts.tolist()) if t >= 0}


def _compare_draws(walk: _Walk, old: Record, new: Record, cases: Sequence[int]) -> None:
    """Each sampled position's draws against the recorded ones (a recording made without draws compares none):
    the first position whose two-sample p-value is below SAMPLE_ALPHA / (positions compared)."""
    tests: list[tuple[int, str, int, float]] = []
    for n in cases:
        for kind, what in SAMPLE_WORDS.items():
            if f"{kind}_ids.{n}" not in old:
                continue
            if f"{kind}_ids.{n}" not in new:
                walk.found(Difference(n, what, 0, "draws recorded, none now (the sampled run drew nothing there)"))
                return
            oid, ocount = old[f"{kind}_ids.{n}"], old[f"{kind}_counts.{n}"]
            nid, ncount = new[f"{kind}_ids.{n}"], new[f"{kind}_counts.{n}"]
            if oid.shape[0] != nid.shape[0]:
                walk.found(Difference(n, what, 0, f"{nid.shape[0]} sampled positions, recorded {oid.shape[0]}"))
                return
            for s in range(oid.shape[0]):
                a, b = _counts_row(oid[s], ocount[s]), _counts_row(nid[s], ncount[s])
                tokens = sorted(a.keys() | b.keys())
                p = homogeneity_p(np.array([a.get(t, 0) for t in tokens]), np.array([b.get(t, 0) for t in tokens]),
                                  SAMPLE_MIN_EXPECTED)
                tests.append((n, what, s, p))
    walk.compared += len(tests)
    if not tests:
        return
    threshold = SAMPLE_ALPHA / len(tests)
    low = next((t for t in tests if t[3] < threshold), None)
    if low is not None:
        n, what, s, p = low
        walk.found(Difference(n, what, s, f"the draws differ from the recorded ones: two-sample p = {p:.2e} < "
                                          f"{SAMPLE_ALPHA:g} / {len(tests)} positions"))


def _compare_generation(walk: _Walk, old: Record, new: Record, n: int) -> None:
    """Greedy tokens and their top-k up to the first divergence; speculative output, proposals and accept counts
    up to it."""
    if f"gen_tokens.{n}" not in old and f"gen_tokens.{n}" not in new:
        return
    if f"gen_tokens.{n}" not in old or f"gen_tokens.{n}" not in new:
        walk.found(Difference(n, "greedy tokens", 0, "greedy generation recorded on one side only"))
        return
    a, b = _triple(old, "gen", n), _triple(new, "gen", n)
    gaps = tol = None
    if a is not None:
        gaps = (a[1][:, 0] - a[1][:, 1]).double() if a[1].shape[-1] > 1 else None
        tol = walk.bound.logprob(a[2].double())
    agree = walk.tokens(n, "greedy tokens", old[f"gen_tokens.{n}"], new[f"gen_tokens.{n}"], gaps, tol)
    if walk.first is not None and walk.first.case == n:
        return
    if a is not None and b is not None:
        rows = min(agree + 1, a[0].shape[0], b[0].shape[0])  # the divergence step's own top-k too
        if walk.topk_rows(n, PATH_WORDS["gen"], a, b, rows) is not None:
            return
    if f"spec_tokens.{n}" in old or f"spec_tokens.{n}" in new:
        if f"spec_tokens.{n}" not in old or f"spec_tokens.{n}" not in new:
            walk.found(Difference(n, "speculative tokens", 0, "speculative output recorded on one side only"))
            return
        agree = min(agree, walk.tokens(n, "speculative tokens", old[f"spec_tokens.{n}"], new[f"spec_tokens.{n}"],
                                       gaps, tol))
        if walk.first is not None and walk.first.case == n:
            return
        _compare_verify_steps(walk, old, new, n, agree)


def _compare_verify_steps(walk: _Walk, old: Record, new: Record, n: int, agree: int) -> None:
    """Accept counts and proposals of the verify steps that committed only tokens before step `agree` (later
    steps follow another output)."""
    if f"spec_accepted.{n}" not in old:
        return
    oacc, nacc = old[f"spec_accepted.{n}"], new.get(f"spec_accepted.{n}", torch.zeros(0, dtype=torch.int32))
    committed = 0
    for step in range(oacc.numel()):
        committed += int(oacc[step]) + 1
        if committed > agree:
            return
        if step >= nacc.numel() or int(nacc[step]) != int(oacc[step]):
            now = int(nacc[step]) if step < nacc.numel() else "none"
            walk.found(Difference(n, "draft acceptance", step, f"verify step {step} accepted {now} drafts, "
                                                               f"recorded {int(oacc[step])}"))
            return
        od, nd = old.get(f"spec_drafts.{n}"), new.get(f"spec_drafts.{n}")
        if od is not None and step < od.shape[0]:
            if nd is None or step >= nd.shape[0] or not torch.equal(od[step], nd[step]):
                shown = nd[step].tolist() if nd is not None and step < nd.shape[0] else None
                walk.found(Difference(n, "draft proposals", step, f"verify step {step} proposed {shown}, "
                                                                  f"recorded {od[step].tolist()}"))
                return
