"""Non-finite logprobs in a run: an engine that returned NaN, inf or null logprobs produced wrong output.

Every check that reads top-k logprobs (the prefill and decode paths, the greedy generation's per-step
top-k) calls `logprob_problem` on each run's tensor first; a problem is a FAIL of that check naming
the run, the prompt, the position (or generation step), the token and the value. An HTTP backend
stores a logprob the server answered as JSON null as NaN and records the answer's own spelling in the
manifest (`MANIFEST_LOGPROB_VALUES`: [{"case", "kind", "row", "token", "value"}]), so the reason says
"null" where the server said null. Padding (token id -1, logprob -inf: the engine returned fewer than k
entries at a position) is named as such.
"""

from __future__ import annotations

import math

import torch

from harness.core.errors import RunError
from harness.records.artifacts import RunArtifacts
from harness.records.contract import MANIFEST_LOGPROB_VALUES

PAD_ID = -1  # the token id of a top-k entry the engine did not return (its logprob is -inf)


class BadLogprobs(RunError):
    """A run's logprobs are NaN, infinite or missing: wrong output of the engine (a FAIL, not an ERROR)."""


def _value_text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return "inf" if value > 0 else "-inf"


def raw_value(run: RunArtifacts, kind: str, index: int, row: int, token: int) -> str | None:
    """How the engine spelled a non-finite logprob ('null', 'NaN', 'Infinity'), when its backend recorded it."""
    for entry in run.manifest.get(MANIFEST_LOGPROB_VALUES) or []:
        if (isinstance(entry, dict) and entry.get("kind") == kind and entry.get("case") == index
                and entry.get("row") == row and entry.get("token") == token):
            value = entry.get("value")
            return str(value) if value is not None else None
    return None


def logprob_problem(run: RunArtifacts, who: str, kind: str, index: int, lps: torch.Tensor,
                    ids: torch.Tensor | None = None, offset: int = 0, unit: str = "position",
                    allow_padding: bool = False) -> str | None:
    """None when every logprob of `lps` [R, k] (or [R]) is finite, else e.g. "parallel gen_topk_logprobs of
    prompt 2: NaN at step 3 (token 17; the server answered null) (+1 more non-finite value)". Row r is
    `unit` offset + r; entries whose id in `ids` is PAD_ID with logprob -inf are padding, named as missing
    (or, with `allow_padding`, no problem)."""
    lp = lps.reshape(lps.shape[0], -1) if lps.dim() else lps.reshape(1, 1)  # [R, k]
    token_ids = ids.reshape(lp.shape) if ids is not None and ids.numel() == lp.numel() else None  # [R, k]
    bad = ~torch.isfinite(lp)  # [R, k]
    if not bool(bad.any()):
        return None
    padding = (torch.zeros_like(bad) if token_ids is None
               else (token_ids == PAD_ID) & (lp == -math.inf))  # [R, k]
    real = bad & ~padding  # [R, k] non-finite values the engine returned
    where = f"{who} {kind} of prompt {index}"
    if bool(real.any()):
        row, col = (int(x) for x in real.nonzero()[0])
        value = float(lp[row, col])
        token = int(token_ids[row, col]) if token_ids is not None else None
        raw = raw_value(run, kind, index, row, token) if token is not None else None
        said = f"; the engine answered {raw}" if raw is not None and raw != _value_text(value) else ""
        tok = f" (token {token}{said})" if token is not None else ""
        more = int(real.sum()) - 1
        extra = f" (+{more} more non-finite value{'s' if more > 1 else ''})" if more else ""
        return f"{where}: {_value_text(value)} at {unit} {offset + row}{tok}{extra}"
    if allow_padding:
        return None
    row = int(padding.any(dim=-1).nonzero()[0, 0])
    missing = int(padding[row].sum())
    return (f"{where}: {missing} of {lp.shape[-1]} top-k entries missing at {unit} {offset + row} "
            f"(the engine returned fewer logprobs than asked)")


def check_finite(run: RunArtifacts, who: str, kind: str, index: int, lps: torch.Tensor,
                 ids: torch.Tensor | None = None, offset: int = 0, unit: str = "position",
                 allow_padding: bool = False) -> None:
    """Raise BadLogprobs naming the first non-finite logprob (logprob_problem)."""
    problem = logprob_problem(run, who, kind, index, lps, ids, offset, unit, allow_padding)
    if problem is not None:
        raise BadLogprobs(problem)

