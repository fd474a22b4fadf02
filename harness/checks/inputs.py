"""The `inputs` check: the reference and the parallel run saw the same prompts (token ids), the
same weights and the same tokenizer. Each run's manifest records their hashes
(contract.MANIFEST_PROMPTS_HASH, MANIFEST_WEIGHTS_HASH, MANIFEST_TOKENIZER_HASH) and cases.json the
token ids; a difference makes every other verdict of the cell meaningless, so it is a FAIL naming
what differs. A hash that one run does not record is noted, not failed; nothing comparable is a SKIP.
"""

from __future__ import annotations

from typing import Any

from harness.core.verdict import CheckResult, Verdict
from harness.records import contract as c
from harness.records.artifacts import RunArtifacts

HASHES: tuple[tuple[str, str], ...] = ((c.MANIFEST_PROMPTS_HASH, "prompts hash"),
                                       (c.MANIFEST_WEIGHTS_HASH, "weights hash"),
                                       (c.MANIFEST_TOKENIZER_HASH, "tokenizer hash"))


def _short(value: Any) -> str:
    return str(value)[:12]


def _token_problems(ref: RunArtifacts, par: RunArtifacts) -> list[str]:
    par_cases = {case.index: case for case in par.cases}
    out = []
    if len(par.cases) != len(ref.cases):
        out.append(f"prompt count differs: reference {len(ref.cases)}, parallel {len(par.cases)}")
    for case in ref.cases:
        other = par_cases.get(case.index)
        if other is None:
            continue
        for what, a, b in (("prompt token ids", case.prompt_ids, other.prompt_ids),
                           ("teacher-forced token ids", case.sequence_ids, other.sequence_ids)):
            if a != b:
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                out.append(f"prompt {case.index}: {what} differ at token {at} (reference {len(a)} tokens, "
                           f"parallel {len(b)})")
                break
    return out


def check_inputs(ref: RunArtifacts, par: RunArtifacts) -> CheckResult:
    problems = _token_problems(ref, par)
    compared, notes = [], []
    for key, label in HASHES:
        a, b = ref.manifest.get(key), par.manifest.get(key)
        if a is None or b is None:
            notes.append(f"{label} not recorded by the {'reference' if a is None else 'parallel'} run")
        elif a != b:
            problems.append(f"{label} differs: reference {_short(a)}, parallel {_short(b)}")
        else:
            compared.append(label)
    metrics = {"problems": problems, "compared": compared, "notes": notes, "prompts": len(ref.cases)}
    if problems:
        extra = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult("inputs", Verdict.FAIL, f"inputs differ: {problems[0]}{extra}", metrics)
    if not compared and not ref.cases:
        return CheckResult("inputs", Verdict.SKIP, "nothing to compare: no prompts and no input hashes", metrics)
    reason = f"{len(ref.cases)} prompts' token ids identical" + (f"; same {', '.join(compared)}" if compared else "")
    if notes:
        reason += f"; {'; '.join(notes)}"
    return CheckResult("inputs", Verdict.PASS, reason, metrics)
