"""The checks of a disaggregated (PREFILL>DECODE) cell: its KV transfer per row, its load path and pools,
and prefill-only vs prefill -> decode consistency (harness/compare/pd_transfer.py), read from the decode
run's PD_RECORD and PD_TENSORS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from harness.checks.context import CellContext
from harness.compare.pd_transfer import check_consistency, check_load, check_transfer
from harness.core.jsonio import read_json
from harness.core.verdict import CheckResult, Verdict
from harness.records import contract as c
from harness.records.pd_files import STORE_DAMAGE

PD_RECORD, PD_TENSORS = c.PD_RECORD_FILE, c.PD_TENSORS_FILE  # written by harness/backends/embedded/worker_pd.py


def _read(ctx: CellContext, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | CheckResult:
    path = Path(ctx.par.path)
    if not (path / PD_RECORD).exists() or not (path / PD_TENSORS).exists():
        return CheckResult(name, Verdict.ERROR, f"the disaggregated run left no {PD_RECORD} / {PD_TENSORS} in {path}")
    return read_json(path / PD_RECORD), load_file(str(path / PD_TENSORS))


def _unrecorded(name: str, record: dict[str, Any]) -> CheckResult | None:
    """A SKIP when the engine's connector keeps no per-rank load record (a shared-storage store: vLLM's
    ExampleConnector), which is what this check reads."""
    if "decode" in record:
        return None
    store = record.get("store", "unknown")
    return CheckResult(name, Verdict.SKIP, f"the engine's KV connector ({store} store) keeps no "
                       f"per-rank record of its loads and placed rows; the transfer is judged by the parity checks "
                       f"and pd_consistency", {"stored_files": len(record.get("stored_files", []))})


def pd_transfer(ctx: CellContext) -> list[CheckResult]:
    got = _read(ctx, "pd_transfer")
    if isinstance(got, CheckResult):
        return [got]
    skip = _unrecorded("pd_transfer", got[0])
    if skip is not None:
        return [skip]
    assert ctx.pd_plan is not None  # a pd cell (driver.belongs)
    return [check_transfer(ctx.pd_plan, *got, ctx.pd_state_plan)]


def pd_load(ctx: CellContext) -> list[CheckResult]:
    got = _read(ctx, "pd_load")
    if isinstance(got, CheckResult):
        return [got]
    record = got[0]
    fault = str(ctx.par.manifest.get("fault") or "")
    damage = str((record.get("store_damage") or {}).get("condition") or (fault if fault in STORE_DAMAGE else ""))
    return [_unrecorded("pd_load", record) or check_load(record, damage)]


def pd_consistency(ctx: CellContext) -> list[CheckResult]:
    got = _read(ctx, "pd_consistency")
    if isinstance(got, CheckResult):
        return [got]
    record, tensors = got
    # request i of the store is the run's case r["case"] (the same number unless a record predates it)
    requests = [(int(r["index"]), int(r.get("case", r["index"]))) for r in record["prefill"]["requests"]]
    prefill_only = [(tensors[f"prefill_only.topk_ids.{i}"], tensors[f"prefill_only.topk_logprobs.{i}"])
                    for i, _ in requests]
    decoded = [(ctx.par.tensor(c.GEN_TOPK_IDS, k)[:1].flatten(), ctx.par.tensor(c.GEN_TOPK_LOGPROBS, k)[:1].flatten())
               for _, k in requests]
    return [check_consistency(prefill_only, decoded)]
